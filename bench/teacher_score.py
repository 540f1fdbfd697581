"""How well a game's teacher (ppo_affine/experts.py) plays against the validators' opponent.

Plays `--games-played` games of the env's evaluate() conversation with the teacher in the model's seat,
both seats in turn, against the MCTS at the game's validator budget (the fast search where the game
table says so), and prints one JSON document: the mean score per seat and over both with 95 % t
intervals. For liars_dice it adds the most a first bid can win against an opponent that sees every die
and always answers with the highest bid that holds (`highest_true_bid_guess_rate` below): a bar
the real MCTS is measured against.

    python -m bench.teacher_score --game liars_dice --games-played 200
    python -m bench.teacher_score --game leduc_poker --expert cfr --games-played 200

`--records FILE` keeps the games (sft_warmstart's JSONL); `--paired-with FILE` reads an earlier run's
records and adds the paired difference on the games both played (same seeds: the deals and the
opponent's streams are the same, so only the teacher differs), e.g. a teacher before and after a change.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ppo_affine import report
from ppo_affine.config import ConfigError
from ppo_affine.envs.games import GAMES
from ppo_affine.experts import ExpertUnavailable, dice_compositions, expert_choices, expert_kind, true_bid_totals
from ppo_affine.warm_start.config import WarmStartConfig
from ppo_affine.warm_start.expert_play import OpponentSetup, generate, plan_jobs

SEED = 424_242  # apart from the SFT data's and the evaluation's seeds


def highest_true_bid_guess_rate(dice: int) -> float:
    """liars_dice with `dice` dice each, moving first against an opponent that sees every die and
    answers with the highest bid that holds: the first bid wins only if it is that highest bid. The
    chance of naming it with the best guess from one's own dice (averaged over one's hands); the
    second mover never wins against that opponent, so both seats average half of this."""
    counts, weights = dice_compositions(dice, 6)
    rate = 0.0
    for mine, weight in zip(counts, weights):
        _, highest = true_bid_totals(mine, counts)
        rate += weight * max(np.bincount(highest, weights=weights))
    return float(rate)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--game", required=True, choices=sorted(g for g in GAMES if expert_choices(g)))
    parser.add_argument("--expert", help="a teacher other than the game's default (sft_warmstart --expert kinds)")
    parser.add_argument("--games-played", type=int, default=200, help="games, seats alternating")
    parser.add_argument("--config-ids", default="0", help="comma-separated game variants to cycle through")
    parser.add_argument("--workers", type=int, default=2, help="processes playing games")
    parser.add_argument("--records", type=Path, help="write the games here (JSONL)")
    parser.add_argument("--paired-with", type=Path, help="an earlier run's --records: report the paired difference")
    args = parser.parse_args(argv)
    chosen = {args.game: args.expert} if args.expert else {}
    try:
        kind = expert_kind(args.game, chosen)
    except ExpertUnavailable as exc:
        parser.error(f"--expert: {exc}")
    if args.games_played < 2:
        parser.error(f"--games-played must be at least 2 (one a seat), got {args.games_played}")
    earlier = None
    if args.paired_with:
        try:
            earlier = {(r["task_id"], r["seed"]): r["score"]
                       for r in map(json.loads, args.paired_with.read_text().splitlines())}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--paired-with {args.paired_with}: expected a teacher_score --records file ({exc})")

    try:
        settings = WarmStartConfig.from_options(games=[args.game], episodes=args.games_played, opponent="mcts",
                                                config_ids=args.config_ids, experts=chosen)
    except ConfigError as exc:
        parser.error(str(exc))
    started = time.perf_counter()
    jobs = plan_jobs(settings, SEED, OpponentSetup())
    if earlier is not None and not any((job.task_id, job.seed) in earlier for job in jobs):
        parser.error(f"--paired-with {args.paired_with}: no game shares a seed with this run")
    records = generate(jobs, args.workers, args.records)
    scores = {seat: [r["score"] for r in records if r["llm_player_id"] == seat] for seat in (0, 1)}

    def summary(values: list[float], low: float = 0.0, key: str = "mean_score") -> dict:
        mean, interval = report.mean_interval(values, low, 1.0)
        return {"games": len(values), key: round(mean, 4),
                "ci95": [round(x, 4) for x in interval] if interval else None}

    budget = GAMES[args.game].mcts  # None where the env's "mcts" opponent is uniform random (goofspiel)
    result = {"game": args.game, "expert": kind, "opponent": "mcts" if budget else "random",
              "opponent_budget": list(budget) if budget else None, "config_ids": args.config_ids,
              "both_seats": summary(scores[0] + scores[1]),
              "by_seat": {str(seat): summary(values) for seat, values in scores.items() if values},
              "minutes": round((time.perf_counter() - started) / 60, 1)}
    if earlier is not None:
        diffs = {seat: [r["score"] - earlier[(r["task_id"], r["seed"])] for r in records
                        if r["llm_player_id"] == seat and (r["task_id"], r["seed"]) in earlier] for seat in (0, 1)}
        result["minus_earlier"] = {"both_seats": summary(diffs[0] + diffs[1], -1.0, "score_diff"),
                                   "by_seat": {str(seat): summary(values, -1.0, "score_diff")
                                               for seat, values in diffs.items() if values}}
    if args.game == "liars_dice":
        dice = GAMES["liars_dice"].params(0)["numdice"]
        first = highest_true_bid_guess_rate(dice)
        result["vs_a_perfect_opponent"] = {"first_seat": round(first, 4), "second_seat": 0.0,
                                           "both_seats": round(first / 2, 4)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
