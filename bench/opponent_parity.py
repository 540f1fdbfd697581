"""Is the fast MCTS opponent the validators' opponent? Games played outside the env, seat by seat, with
95 % intervals; prints one JSON document and appends every finished game to `--log` (JSONL), so a
long run can stop and continue where it was.

Matchups, each over seeds 0..N-1 (the subject plays seat seed % players, every other seat plays the
opponent; chance comes from RandomState(seed), the variants cycle with the seed):
- `fast_vs_exact`: the fast search (subject) against the exact one. Parity: the subject's mean score
  has a 95 % interval that contains 0.5 (the scores of all seats average 0.5: zero-sum scores of two
  seats add up to 1, places in 4-player games are 1, 2/3, 1/3, 0).
- `random_vs_{exact,fast}` and `teacher_vs_{exact,fast}`: a fixed player (uniform random; the SFT
  teacher of experts.py) against each search, on the same seeds. Parity: the paired difference of its
  scores (vs fast - vs exact) has an interval that contains 0.

    python -m bench.opponent_parity --games leduc_poker,liars_dice --games-per-matchup 200
    python -m bench.opponent_parity --games gin_rummy --minutes-per-matchup 60
    python -m bench.opponent_parity --games others --matchups fast_vs_exact,random --scale 0.05 --rollout-scale 0.1

`--scale` / `--rollout-scale` reduce both searches' simulations / rollouts per leaf alike (the other
games' budgets cost seconds to minutes per exact move). `--minutes-per-matchup` stops starting new
games of a matchup once its games have used that many minutes of one core.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyspiel

from ppo_affine.envs.factory import usable_cores
from ppo_affine.envs.games import GAMES, is_playable
from ppo_affine.envs.openspiel_episode import (
    compute_score,
    has_search_opponent,
    load_game,
    mcts_bot,
)
from ppo_affine.envs.tasks import game_task_id
from ppo_affine.experts import Expert, expert_kind
from ppo_affine.report import mean_interval

VALIDATOR_SEARCH_GAMES = ["leduc_poker", "liars_dice", "gin_rummy"]
FIXED_PLAYERS = ("random", "teacher")
MATCHUPS = ("fast_vs_exact", "random_vs_exact", "random_vs_fast", "teacher_vs_exact", "teacher_vs_fast")
TEACHER_BUDGET = 300  # the teacher's own search simulations (experts.py, sft_warmstart's default)


def search_games() -> list[str]:
    """Games with an MCTS opponent that open_spiel can load (bridge's Affine parameters cannot be)."""
    return [g for g, spec in GAMES.items() if spec.mcts is not None and is_playable(game_task_id(g))]


def _budget(game_name: str, scale: float, rollout_scale: float) -> tuple[int, int]:
    simulations, rollouts = GAMES[game_name].mcts
    return max(1, round(simulations * scale)), max(1, round(rollouts * rollout_scale))


def _chooser(kind: str, game: pyspiel.Game, seat: int, seed: int, budget: tuple[int, int]
             ) -> Callable[[pyspiel.State], int]:
    if kind in ("fast", "exact"):  # the env's seat seeds: rollouts on seed+5+p, tree on seed+6+p
        bot = mcts_bot(game, budget, seed + 5 + seat, seed + 6 + seat, kind)
        return lambda state: int(bot.step(state))
    if kind == "random":
        rng = np.random.RandomState((seed + 4 + seat) % 2**32)
        return lambda state: int(rng.choice(state.legal_actions()))
    teacher = Expert(expert_kind(game.get_type().short_name), game, seat, seed, TEACHER_BUDGET, 300)
    return lambda state: teacher.choose(state, {a: str(a) for a in state.legal_actions()})[0]


def play_one(game_name: str, matchup: str, seed: int, budget: tuple[int, int]) -> dict[str, Any]:
    """One game of `matchup` on `seed`; the subject's score, how many moves each side made and the seconds."""
    subject, opponent = matchup.split("_vs_")
    playable = [c for c in range(8) if is_playable(game_task_id(game_name, c))]  # bridge: 2 of its 4 variants
    config_id = playable[seed % len(playable)]
    game = load_game(game_name, tuple(sorted(GAMES[game_name].params(config_id).items())))
    seat = seed % game.num_players()
    players = {p: _chooser(subject if p == seat else opponent, game, p, seed, budget)
               for p in range(game.num_players())}
    chance = np.random.RandomState(seed)
    state, moves = game.new_initial_state(), [0] * game.num_players()
    started = time.process_time()
    while not state.is_terminal():
        if state.is_chance_node():
            outcomes, probs = zip(*state.chance_outcomes())
            state.apply_action(int(chance.choice(outcomes, p=probs)))
            continue
        player = state.current_player()
        state.apply_action(players[player](state))
        moves[player] += 1
    zero_sum = game.get_type().utility == pyspiel.GameType.Utility.ZERO_SUM
    score = compute_score(state.returns(), seat, zero_sum, game.min_utility(), game.max_utility())
    return {"game": game_name, "matchup": matchup, "seed": seed, "seat": seat, "score": score,
            "subject_moves": moves[seat], "opponent_moves": sum(moves) - moves[seat],
            "cpu_seconds": round(time.process_time() - started, 3), "budget": list(budget)}


def _interval(values: list[float], low: float, high: float) -> dict[str, Any]:
    mean, interval = mean_interval(values, low, high)
    return {"n": len(values), "mean": None if mean is None else round(mean, 4),
            "ci95": None if interval is None else [round(v, 4) for v in interval]}


def verdict(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per matchup: mean score with its interval; the paired differences; whether parity holds."""
    by_matchup: dict[str, dict[int, float]] = defaultdict(dict)
    minutes: dict[str, float] = defaultdict(float)
    for record in records:
        by_matchup[record["matchup"]][record["seed"]] = record["score"]
        minutes[record["matchup"]] += record["cpu_seconds"] / 60
    result: dict[str, Any] = {"matchups": {m: {**_interval(list(scores.values()), 0, 1),
                                               "cpu_minutes": round(minutes[m], 1)}
                                           for m, scores in sorted(by_matchup.items())}}
    checks = []
    head_to_head = result["matchups"].get("fast_vs_exact")
    if head_to_head and head_to_head["ci95"]:
        checks.append(head_to_head["ci95"][0] <= 0.5 <= head_to_head["ci95"][1])
    for player in FIXED_PLAYERS:
        exact, fast = by_matchup.get(f"{player}_vs_exact", {}), by_matchup.get(f"{player}_vs_fast", {})
        seeds = sorted(exact.keys() & fast.keys())
        if len(seeds) < 2:
            continue
        difference = _interval([fast[s] - exact[s] for s in seeds], -1, 1)
        result[f"{player}_fast_minus_exact"] = difference
        checks.append(difference["ci95"][0] <= 0 <= difference["ci95"][1])
    result["parity_holds"] = bool(checks) and all(checks)
    return result


def _read_log(path: Path | None) -> list[dict[str, Any]]:
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", default=",".join(VALIDATOR_SEARCH_GAMES),
                        help="comma-separated games with an MCTS opponent, 'others' (all but the validator "
                        "games) or 'all'")
    parser.add_argument("--matchups", default=",".join(MATCHUPS),
                        help=f"comma-separated from {MATCHUPS}; 'random'/'teacher' mean both of its matchups")
    parser.add_argument("--games-per-matchup", type=int, default=200)
    parser.add_argument("--minutes-per-matchup", type=float, help="stop a matchup after this much CPU time")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the simulations, both searches")
    parser.add_argument("--rollout-scale", type=float, default=1.0, help="fraction of the rollouts per leaf")
    parser.add_argument("--jobs", type=int, default=usable_cores(), help="games played at once (processes)")
    parser.add_argument("--log", type=Path, help="JSONL of finished games, read back to continue a run")
    args = parser.parse_args()

    everything = search_games()
    games = {"all": everything, "others": [g for g in everything if g not in VALIDATOR_SEARCH_GAMES]}.get(
        args.games, args.games.split(","))
    unknown = [g for g in games if g not in everything]
    if unknown:
        parser.error(f"--games: {unknown} have no MCTS opponent; choose from {everything}")
    matchups = [m for name in args.matchups.split(",")
                for m in ((f"{name}_vs_exact", f"{name}_vs_fast") if name in FIXED_PLAYERS else (name,))]
    if any(m not in MATCHUPS for m in matchups):
        parser.error(f"--matchups: expected names from {MATCHUPS} or {FIXED_PLAYERS}, got {args.matchups}")
    for name in ("games_per_matchup", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not (0 < args.scale <= 1 and 0 < args.rollout_scale <= 1):
        parser.error("--scale and --rollout-scale must be in (0, 1]")

    records = _read_log(args.log)
    done = {(r["game"], r["matchup"], r["seed"]) for r in records}
    cpu_minutes: dict[tuple[str, str], float] = defaultdict(float)
    for record in records:
        cpu_minutes[record["game"], record["matchup"]] += record["cpu_seconds"] / 60
    # Interleave matchups seed by seed, so a time limit leaves every matchup with the same seeds.
    pending = [(game, matchup, seed) for game in games for seed in range(args.games_per_matchup)
               for matchup in matchups if (game, matchup, seed) not in done
               and not (matchup.startswith("teacher") and not _has_teacher(game))]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        running: dict[Any, tuple[str, str]] = {}
        while pending or running:
            while pending and len(running) < args.jobs:
                game, matchup, seed = pending.pop(0)
                if args.minutes_per_matchup and cpu_minutes[game, matchup] >= args.minutes_per_matchup:
                    continue
                budget = _budget(game, args.scale, args.rollout_scale)
                running[pool.submit(play_one, game, matchup, seed, budget)] = (game, matchup)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                running.pop(future)
                record = future.result()
                records.append(record)
                cpu_minutes[record["game"], record["matchup"]] += record["cpu_seconds"] / 60
                if args.log:
                    with args.log.open("a") as log:
                        log.write(json.dumps(record) + "\n")
                print(f"{record['game']} {record['matchup']} seed {record['seed']}: {record['score']:.3f} "
                      f"({record['cpu_seconds']:.1f} s)", file=sys.stderr, flush=True)

    report = {"scale": args.scale, "rollout_scale": args.rollout_scale, "jobs": args.jobs,
              "wall_minutes": round((time.perf_counter() - started) / 60, 1), "cpu_count": os.cpu_count(),
              "games": {g: {"budget": list(_budget(g, args.scale, args.rollout_scale)),
                            **verdict([r for r in records if r["game"] == g and r["matchup"] in matchups])}
                        for g in games}}
    print(json.dumps(report, indent=1))


def _has_teacher(game_name: str) -> bool:
    try:
        expert_kind(game_name)
    except ValueError:
        return False
    return has_search_opponent(load_game(game_name, tuple(sorted(GAMES[game_name].params(0).items()))),
                               GAMES[game_name])


if __name__ == "__main__":
    main()
