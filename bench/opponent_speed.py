"""Seconds per move of the validators' MCTS opponent: `exact` (the Affine env's Python search) and
`fast` (open_spiel's C++ search), side by side on the same positions at the validators' budgets;
then `fast` searches of concurrent episodes through the env: the same games one at a time, then all at once
on threads in this process and on worker processes.
Prints one JSON document (progress on stderr).

    python -m bench.opponent_speed                                # leduc_poker, liars_dice, gin_rummy
    python -m bench.opponent_speed --games all --scale 0.1        # every MCTS game at a tenth of its budget
    python -m bench.opponent_speed --positions 2 --episodes 8 --workers 8

Positions are reached by uniformly random play from seeded deals (a few moves in, someone other than
chance to move), so both searches face exactly the same states; `--scale` multiplies the simulations
of both alike. `parallel`: `--episodes` games against the fast opponent play `--turns` model turns
each, all at once through OpenSpielEnv, with the searches on threads of this process (workers=0) and on
`--workers` worker processes; `speedup_*` is the wall seconds per opponent move of the same games played one at a
time over theirs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time

import numpy as np

from ppo_affine.envs.games import GAMES
from ppo_affine.envs.factory import usable_cores
from ppo_affine.envs.openspiel_env import OpenSpielEnv
from ppo_affine.envs.openspiel_episode import load_game, mcts_bot
from ppo_affine.envs.tasks import game_task_id

VALIDATOR_SEARCH_GAMES = ["leduc_poker", "liars_dice", "gin_rummy"]


def positions(game_name: str, count: int) -> list:
    """`count` states 0-2 random moves into seeded deals, each with a player (not chance) to move."""
    spec = GAMES[game_name]
    game = load_game(game_name, tuple(sorted(spec.params(0).items())))
    found, seed = [], 0
    while len(found) < count:
        rng = np.random.RandomState(seed)
        state, depth = game.new_initial_state(), seed % 3  # the first decisions: the searches that cost most
        seed += 1
        while not state.is_terminal() and (state.is_chance_node() or depth > 0):
            if not state.is_chance_node():
                depth -= 1
            actions = state.legal_actions()
            state.apply_action(actions[rng.randint(len(actions))])
        if not state.is_terminal() and len(state.legal_actions()) > 1:
            found.append(state)
    return found


def seconds_per_move(game_name: str, states: list, simulations: int, search: str) -> list[float]:
    n_rollouts = GAMES[game_name].mcts[1]
    times = []
    for index, state in enumerate(states):
        bot = mcts_bot(state.get_game(), (simulations, n_rollouts), 1000 + index, 2000 + index, search)
        start = time.perf_counter()
        bot.step(state)
        times.append(time.perf_counter() - start)
    return times


async def timed_turns(game_name: str, episodes: int, turns: int, simulations: int, workers: int,
                      concurrent: bool = True) -> dict:
    """Wall seconds for `episodes` games (seeds 0..episodes-1) to play `turns` model turns each against the fast
    search: all at once, or one after another (`concurrent=False`, the baseline on the same games)."""
    env = OpenSpielEnv("evaluate", mcts_simulations={game_name: simulations}, workers=workers,
                       opponent_search="fast")
    if workers:  # start the worker processes outside the timing
        await asyncio.gather(*(env.reset(game_task_id("blackjack"), seed=s) for s in range(workers)))
    bot_moves = 0

    async def play(seed: int) -> None:
        nonlocal bot_moves
        policy = random.Random(seed)
        result = await env.reset(game_task_id(game_name), seed=seed, opponent="mcts")
        bot_moves += result["info"]["step_count"]
        while not result["done"] and result["info"]["turns"] < turns:
            before = result["info"]["step_count"]
            result = await env.step(str(policy.choice(result["info"]["legal_actions"])), result["episode_id"])
            bot_moves += result["info"]["step_count"] - before - 1

    start = time.perf_counter()
    if concurrent:
        await asyncio.gather(*(play(seed) for seed in range(episodes)))
    else:
        for seed in range(episodes):
            await play(seed)
    seconds = time.perf_counter() - start
    await env.close()
    return {"seconds": round(seconds, 2), "bot_moves": bot_moves}


def summary(times: list[float]) -> dict:
    return {"mean_s": round(statistics.fmean(times), 4), "median_s": round(statistics.median(times), 4),
            "max_s": round(max(times), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", default=",".join(VALIDATOR_SEARCH_GAMES),
                        help="comma-separated games with an MCTS opponent, or 'all'")
    parser.add_argument("--positions", type=int, default=4, help="positions timed per game and search")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each game's simulations (both searches)")
    parser.add_argument("--searches", default="exact,fast", help="which searches to time per move")
    parser.add_argument("--episodes", type=int, default=8, help="concurrent episodes in the parallel rows (0 = skip)")
    parser.add_argument("--turns", type=int, default=2, help="model turns per episode in the parallel rows")
    parser.add_argument("--workers", type=int, default=usable_cores(), help="worker processes in the parallel rows")
    args = parser.parse_args()
    games = [g for g in GAMES if GAMES[g].mcts] if args.games == "all" else args.games.split(",")
    unknown = [g for g in games if g not in GAMES or GAMES[g].mcts is None]
    if unknown:
        parser.error(f"--games: {unknown} have no MCTS opponent; choose from {[g for g in GAMES if GAMES[g].mcts]}")
    if not 0 < args.scale <= 1:
        parser.error(f"--scale must be in (0, 1], got {args.scale}")

    report: dict = {"cpu_count": os.cpu_count(), "usable_cores": usable_cores(), "load_average_1m": os.getloadavg()[0],
                    "python": platform.python_version(), "scale": args.scale, "games": {}}
    started = time.perf_counter()
    for game_name in games:
        simulations = max(1, round(GAMES[game_name].mcts[0] * args.scale))
        states = positions(game_name, args.positions)
        entry: dict = {"max_simulations": simulations, "n_rollouts": GAMES[game_name].mcts[1]}
        for search in args.searches.split(","):
            entry[search] = summary(seconds_per_move(game_name, states, simulations, search))
            print(f"{game_name} {search}: {entry[search]}", file=sys.stderr, flush=True)
        if "exact" in entry and "fast" in entry:
            entry["exact_over_fast"] = round(entry["exact"]["mean_s"] / entry["fast"]["mean_s"], 1)
        if args.episodes:
            in_turn = asyncio.run(timed_turns(game_name, args.episodes, args.turns, simulations, 0, concurrent=False))
            in_process = asyncio.run(timed_turns(game_name, args.episodes, args.turns, simulations, 0))
            on_workers = asyncio.run(timed_turns(game_name, args.episodes, args.turns, simulations, args.workers))
            per_move = {name: run["seconds"] / max(run["bot_moves"], 1)
                        for name, run in (("one", in_turn), ("threads", in_process), ("workers", on_workers))}
            entry["parallel"] = {
                "episodes": args.episodes, "turns_each": args.turns, "workers": args.workers,
                "one_at_a_time": in_turn, "in_process": in_process, "on_workers": on_workers,
                # wall seconds per opponent move: the same games one at a time, then all at once; the ratio is the
                # parallel speedup (the C++ search releases the GIL, so threads run it in parallel too)
                "s_per_bot_move": {name: round(value, 4) for name, value in per_move.items()},
                "speedup_threads": round(per_move["one"] / per_move["threads"], 2),
                "speedup_workers": round(per_move["one"] / per_move["workers"], 2),
            }
            print(f"{game_name} parallel: {entry['parallel']}", file=sys.stderr, flush=True)
        report["games"][game_name] = entry
    report["seconds_total"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
