"""Per-step cost of the OpenSpiel env over HTTP (affinetes url mode) vs in process; prints one JSON document.

Each game plays the same episodes both ways: the same seeds, random opponent, and a seeded random
legal-action policy, so both sides do the same env work (the JSON says whether the trajectories
matched). in_process: OpenSpielEnv called directly, timed before affinetes is imported (its import
patches asyncio process-wide). url: AffinetesEnv against `python -m ppo_affine.envs.server` on 127.0.0.1 (or
`--url`), one episode at a time, so the difference is the HTTP round trip plus (de)serialisation.
url_concurrent: `--concurrency` episodes in flight at once, wall-clock microseconds per step.

    python -m bench.env_url_speed
    python -m bench.env_url_speed --games leduc_poker --episodes 50 --url http://envhost:8765
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from ppo_affine.envs.openspiel_env import OpenSpielEnv
from ppo_affine.envs.tasks import game_task_id

ROOT = Path(__file__).resolve().parents[1]


async def play(env, game: str, seeds: range) -> dict:
    """Episodes one after another; time inside reset/step only; a digest of every observation seen."""
    policy = random.Random(0)
    digest = hashlib.sha256()
    steps = 0
    step_seconds = reset_seconds = 0.0
    for seed in seeds:
        start = time.perf_counter()
        result = await env.reset(task_id=game_task_id(game), seed=seed, opponent="random")
        reset_seconds += time.perf_counter() - start
        digest.update(result["observation"].encode())
        while not result["done"]:
            action = str(policy.choice(result["info"]["legal_actions"]))
            start = time.perf_counter()
            result = await env.step(action, result["episode_id"])
            step_seconds += time.perf_counter() - start
            digest.update(result["observation"].encode())
            steps += 1
    return {"episodes": len(seeds), "steps": steps,
            "us_per_step": round(1e6 * step_seconds / max(steps, 1), 1),
            "us_per_reset": round(1e6 * reset_seconds / len(seeds), 1),
            "digest": digest.hexdigest()[:16]}


async def play_concurrently(env, game: str, seeds: range, concurrency: int) -> dict:
    """`concurrency` episodes in flight; wall-clock time over all steps and resets."""
    queue = iter(seeds)
    steps = 0

    async def worker() -> None:
        nonlocal steps
        for seed in queue:
            policy = random.Random(seed)
            result = await env.reset(task_id=game_task_id(game), seed=seed, opponent="random")
            while not result["done"]:
                result = await env.step(str(policy.choice(result["info"]["legal_actions"])), result["episode_id"])
                steps += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    return {"episodes": len(seeds), "concurrency": concurrency, "steps": steps,
            "wall_us_per_step": round(1e6 * seconds / max(steps, 1), 1)}


def start_server(fmt: str) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen([sys.executable, "-m", "ppo_affine.envs.server", "--env", "openspiel", "--format", fmt,
                               "--host", "127.0.0.1", "--port", "0"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = server.stderr.readline()
        found = re.search(r"serving openspiel env at (http://\S+)", line)
        if found:
            return server, found.group(1)
        if not line and server.poll() is not None:
            break
    server.kill()
    raise RuntimeError("python -m ppo_affine.envs.server did not start")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", nargs="+", default=["leduc_poker", "goofspiel"])
    parser.add_argument("--format", default="evaluate", choices=["evaluate", "openenv"])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--url", help="an already running `python -m ppo_affine.envs.server --env openspiel` (same --format)")
    args = parser.parse_args()

    report: dict = {"format": args.format, "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
                    "python": platform.python_version(), "games": {}}
    seeds = range(args.episodes)
    for game in args.games:
        report["games"][game] = {"in_process": await play(OpenSpielEnv(args.format), game, seeds)}

    from ppo_affine.envs.affinetes_env import AffinetesEnv

    server, url = (None, args.url) if args.url else start_server(args.format)
    report["url"] = url
    try:
        env = AffinetesEnv(mode="url", base_url=url, call_timeout=60.0)
        for game in args.games:
            row = report["games"][game]
            row["url"] = await play(env, game, seeds)
            row["url_concurrent"] = await play_concurrently(env, game, seeds, args.concurrency)
            row["http_overhead_us_per_step"] = round(row["url"]["us_per_step"] - row["in_process"]["us_per_step"], 1)
            row["same_trajectories"] = row["url"]["digest"] == row["in_process"]["digest"]
            print(f"{game}: {row}", file=sys.stderr, flush=True)
        report["env_errors"] = env.error_counts()
        await env.close()
    finally:
        if server is not None:
            server.terminate()
            server.wait(15)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
