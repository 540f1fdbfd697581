"""How fast the embedded trace env produces tasks: generation alone, generation + sandboxed run
(ground-truth cache cold), and replay (cache warm). Prints one JSON object.

    python -m bench.trace_speed --tasks 40 --level 2 --concurrency 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

from ppo_affine.envs.sandbox import detect_protections
from ppo_affine.envs.tasks import trace_level_range
from ppo_affine.envs.trace_env import TraceEnv, inject_debug_prints
from ppo_affine.envs.trace_programs import generate_program


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=40, help="distinct task ids per measurement")
    parser.add_argument("--level", type=int, default=2, choices=(1, 2, 3), help="embedded difficulty level")
    parser.add_argument("--concurrency", type=int, default=4, help="sandboxes running at once")
    return parser.parse_args()


async def episodes(env: TraceEnv, task_ids: list[int]) -> dict[str, float]:
    """Full reset + step + stop per task, all at once; returns tasks/s and the degenerate share."""
    start = time.perf_counter()
    resets = await asyncio.gather(*(env.reset(task_id=t, seed=0) for t in task_ids))
    for reset in resets:
        await env.step("", reset["episode_id"])
        await env.stop(reset["episode_id"])
    elapsed = time.perf_counter() - start
    degenerate = sum(reset["info"]["degenerate"] is not None for reset in resets)
    return {"tasks_per_s": round(len(task_ids) / elapsed, 2), "seconds": round(elapsed, 3),
            "degenerate_share": round(degenerate / len(task_ids), 3)}


async def main() -> None:
    args = parse_args()
    low, _ = trace_level_range(args.level)
    task_ids = list(range(low, low + args.tasks))
    protections = detect_protections()

    start = time.perf_counter()
    for task_id in task_ids:
        inject_debug_prints(generate_program(task_id).source, task_id)
    generate_s = time.perf_counter() - start

    env = TraceEnv(max_concurrent_runs=args.concurrency)
    cold = await episodes(env, task_ids)
    warm = await episodes(env, task_ids)
    await env.close()
    print(json.dumps({
        "level": args.level, "tasks": args.tasks, "concurrency": args.concurrency,
        "sandbox": {"bwrap": protections.bwrap_path is not None, "drop_uid": protections.drop_uid},
        "generated_tasks_per_s": round(len(task_ids) / generate_s, 1),
        "executed_cache_cold": cold,
        "replayed_cache_warm": warm,
        "sandbox_runs": env.sandbox_runs,
    }))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main())
