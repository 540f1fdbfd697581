"""The interpreter as the trace env's teacher: every trace task comes with its answer.

The env runs a task's program (debug prints injected) in its sandbox to score replies; that stdout is the
perfect reply. A record here is the env's own prompt, then that stdout in a fenced block, the form the env
scores (its answer cleaning takes the first fenced block) and the form a reply that stops at its closing fence
has. Tasks are drawn above each level's held-out ids (`tasks.trace_training_range`) from seeds of their own, and
a task whose program is a held-out task's under another id is passed over, so no record is a task evaluation
judges on. Degenerate tasks (an empty, crashing or timed-out program) are swapped
for the next id, as the env does in training.
"""
from __future__ import annotations

import asyncio
from typing import Any

from ppo_affine.envs.tasks import trace_training_range
from ppo_affine.envs.trace_programs import repeats_a_held_out_program
from ppo_affine.seeds import derive_seed

TEACHER = "interpreter"


def teacher_reply(ground_truth: str) -> str:
    """The reply the env scores 1.0 for this ground truth, ending at its closing fence."""
    return f"```\n{ground_truth}\n```"


def trace_task_ids(levels: list[int], count: int, seed: int) -> list[int]:
    """`count` distinct task ids cycling through `levels`, each uniform over its level's training ids whose
    program no held-out task has."""
    chosen: list[int] = []
    taken: set[int] = set()
    draw = 0
    while len(chosen) < count:
        level = levels[len(chosen) % len(levels)]
        low, high = trace_training_range(level)
        task_id = low + derive_seed(seed, "sft-trace", level, draw) % (high - low)
        draw += 1
        if task_id not in taken and not repeats_a_held_out_program(task_id):
            taken.add(task_id)
            chosen.append(task_id)
    return chosen


def trace_env_from(config) -> Any:
    """A local TraceEnv with the config's trace env settings (its first local trace env), else the defaults;
    degenerate tasks skipped."""
    from ppo_affine.config import EnvSpec
    from ppo_affine.envs.factory import make_env

    spec = next((s for s in config.env.envs.values() if s.kind == "trace" and s.mode == "local"), EnvSpec(kind="trace"))
    return make_env(spec.model_copy(update={"skip_degenerate": True}), seed=config.train.run.seed)


async def _records(env, task_ids: list[int], seed: int) -> list[dict[str, Any]]:
    async def one(index: int, task_id: int) -> dict[str, Any]:
        episode_seed = derive_seed(seed, "sft-trace-seed", index)
        started = await env.reset(task_id=task_id, seed=episode_seed)
        info = started["info"]
        if info.get("error"):
            raise RuntimeError(f"trace task {task_id}: {info['error']['message']}")
        challenge = await env.challenge(info["task_id"])  # the task served (a degenerate one swapped)
        await env.stop(started["episode_id"])
        return {"step": 0, "env": "trace", "task_id": challenge.task_id, "seed": episode_seed, "game": "trace",
                "level": challenge.location.get("difficulty"), "score": 1.0, "error": None, "expert": TEACHER,
                "messages": [{"role": "user", "content": started["observation"]},
                             {"role": "assistant", "content": teacher_reply(challenge.ground_truth)}]}

    try:
        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(task_ids))))
    finally:
        await env.close()


def interpreter_records(config, levels: list[int], count: int, seed: int) -> list[dict[str, Any]]:
    """`count` trace conversations whose reply is the program's real stdout, in the env's prompt and format."""
    if count == 0:
        return []
    return asyncio.run(_records(trace_env_from(config), trace_task_ids(levels, count, seed), seed))
