"""Speed of the embedded OpenSpiel env per game, random vs MCTS opponents; prints one JSON document.

random: whole episodes through reset/step with a seeded random legal-action policy; microseconds
per env step (model move + opponent replies + chance + texts) and per reset.
mcts: seconds per opponent (bot) move, measured through env.step. The spec budgets cost seconds to
minutes per move on a laptop core, so by default each game searches with `--mcts-scale` (10 %) of
its spec simulations and the JSON also gives the linear extrapolation to the full budget (MCTS cost
is proportional to simulations until the search solves the position). `--mcts-scale 1` measures the
spec budgets themselves.

It ends with a threads-vs-worker-processes comparison: concurrent hex games against MCTS, played
by OpenSpielEnv(workers=0) and OpenSpielEnv(workers=N).

    python -m bench.env_speed                       # ~2-3 minutes on two free cores
    python -m bench.env_speed --games hex leduc_poker --mcts-scale 1 --mcts-moves 2 --workers 0
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time

from ppo_affine.envs.games import GAMES
from ppo_affine.envs.openspiel_env import OpenSpielEnv
from ppo_affine.envs.tasks import AVAILABLE_GAMES, game_task_id


async def random_speed(game: str, episodes: int, fmt: str) -> dict:
    env = OpenSpielEnv(fmt)
    await env.stop((await env.reset(game_task_id(game), seed=99, opponent="random"))["episode_id"])  # loads the game
    policy = random.Random(0)
    steps = 0
    step_seconds = reset_seconds = 0.0
    for seed in range(episodes):
        start = time.perf_counter()
        result = await env.reset(game_task_id(game), seed=seed, opponent="random")
        reset_seconds += time.perf_counter() - start
        while not result["done"]:
            action = str(policy.choice(result["info"]["legal_actions"]))
            start = time.perf_counter()
            result = await env.step(action, result["episode_id"])
            step_seconds += time.perf_counter() - start
            steps += 1
    return {
        "episodes": episodes, "steps": steps,
        "us_per_step": round(1e6 * step_seconds / max(steps, 1), 1),
        "us_per_reset": round(1e6 * reset_seconds / episodes, 1),
    }


async def mcts_speed(game: str, bot_moves: int, scale: float, fmt: str) -> dict | None:
    if GAMES[game].mcts is None:
        return None
    spec_simulations, n_rollouts = GAMES[game].mcts
    simulations = max(1, round(spec_simulations * scale))
    env = OpenSpielEnv(fmt, mcts_simulations=simulations)
    policy = random.Random(0)
    start = time.perf_counter()
    result = await env.reset(game_task_id(game), seed=0, opponent="mcts")
    seconds = time.perf_counter() - start
    moved = result["info"]["step_count"]  # the bot may move first (chess: player 0 is Black)
    while not result["done"] and moved < bot_moves:
        before = result["info"]["step_count"]
        action = str(policy.choice(result["info"]["legal_actions"]))
        start = time.perf_counter()
        result = await env.step(action, result["episode_id"])
        seconds += time.perf_counter() - start
        moved += result["info"]["step_count"] - before - 1
    if not result["done"]:
        await env.stop(result["episode_id"])
    per_move = seconds / max(moved, 1)
    return {
        "max_simulations": simulations, "spec_max_simulations": spec_simulations, "n_rollouts": n_rollouts,
        "bot_moves": moved, "s_per_bot_move": round(per_move, 3),
        "est_s_per_bot_move_at_spec_budget": round(per_move * spec_simulations / simulations, 2),
    }


async def concurrent_search(episodes: int, turns: int, simulations: int, workers: int) -> float:
    """Seconds for `episodes` concurrent hex games to play `turns` model turns against MCTS."""
    env = OpenSpielEnv("evaluate", mcts_simulations=simulations, workers=workers)
    if workers:  # start the worker processes outside the timing
        await asyncio.gather(*(env.reset(game_task_id("blackjack"), seed=s) for s in range(workers)))

    async def play(seed: int) -> None:
        result = await env.reset(game_task_id("hex"), seed=2 * seed, opponent="mcts")
        while not result["done"] and result["info"]["turns"] < turns:
            result = await env.step(str(result["info"]["legal_actions"][0]), result["episode_id"])

    start = time.perf_counter()
    await asyncio.gather(*(play(seed) for seed in range(episodes)))
    seconds = time.perf_counter() - start
    await env.close()
    return round(seconds, 2)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", nargs="+", default=AVAILABLE_GAMES, choices=AVAILABLE_GAMES)
    parser.add_argument("--format", default="evaluate", choices=["evaluate", "openenv"])
    parser.add_argument("--episodes", type=int, default=3, help="random-opponent episodes per game")
    parser.add_argument("--mcts-moves", type=int, default=2, help="bot moves timed per game (0 = skip MCTS)")
    parser.add_argument("--mcts-scale", type=float, default=0.1, help="fraction of the spec simulations to run")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="worker processes for the threads-vs-processes comparison (0 = skip it)")
    parser.add_argument("--url-games", nargs="*", default=["leduc_poker", "goofspiel"],
                        help="games for the url-mode row: per-step cost over HTTP vs in process (none = skip)")
    args = parser.parse_args()

    started = time.perf_counter()
    report: dict = {
        "format": args.format, "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
        "python": platform.python_version(), "mcts_scale": args.mcts_scale, "games": {},
    }
    for game in args.games:
        entry = {"random": await random_speed(game, args.episodes, args.format)}
        if args.mcts_moves:
            entry["mcts"] = await mcts_speed(game, args.mcts_moves, args.mcts_scale, args.format)
        report["games"][game] = entry
        print(f"{game}: {entry}", file=sys.stderr, flush=True)
    if args.workers:
        # Many episodes searching at once: threads share one core (GIL), worker processes do not.
        episodes, turns, simulations = 2 * args.workers, 3, 100
        report["concurrent_mcts"] = {
            "game": "hex 5x5", "episodes": episodes, "turns_each": turns, "max_simulations": simulations,
            "seconds_threads": await concurrent_search(episodes, turns, simulations, workers=0),
            f"seconds_{args.workers}_worker_processes": await concurrent_search(episodes, turns, simulations,
                                                                                 workers=args.workers),
        }
        print(f"concurrent_mcts: {report['concurrent_mcts']}", file=sys.stderr, flush=True)
    if args.url_games:
        report["url_mode"] = await url_rows(args.url_games, args.format, episodes=10)
    report["seconds_total"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=1))


async def url_rows(games: list[str], fmt: str, episodes: int) -> dict:
    """The same episodes in process and through `python -m ppo_affine.envs.server` + AffinetesEnv (bench/env_url_speed.py)."""
    from env_url_speed import play, start_server

    from ppo_affine.envs.affinetes_env import (
        AffinetesEnv,  # imported last: affinetes patches asyncio process-wide
    )

    seeds = range(episodes)
    rows = {game: {"in_process_us_per_step": (await play(OpenSpielEnv(fmt), game, seeds))["us_per_step"]}
            for game in games}
    server, url = start_server(fmt)
    try:
        env = AffinetesEnv(mode="url", base_url=url, call_timeout=60.0)
        for game in games:
            rows[game]["url_us_per_step"] = (await play(env, game, seeds))["us_per_step"]
            print(f"url {game}: {rows[game]}", file=sys.stderr, flush=True)
        await env.close()
    finally:
        server.terminate()
        server.wait(15)
    return rows


if __name__ == "__main__":
    asyncio.run(main())
