"""Evaluation arithmetic on recorded episodes: rates, confidence intervals, per-game summaries, the table.

Input is a list of episode records as `evaluate.py` writes them to `episodes.jsonl` (one dict per
episode: game, task_id, seed, score, outcome, turns, illegal_moves, parse_failed_game,
generated_tokens, error, model, ...). Nothing here plays, loads or writes anything.

Statistics (all 95 %):
- Rates (win, draw, loss, trace accuracy) get a Wilson score interval: unlike the normal
  approximation it stays inside [0, 1] and is not zero-width at 0/n or n/n.
- The mean score gets a Student-t interval, mean ± t(0.975, n-1)·s/√n with the sample standard
  deviation s, clipped to [0, 1]. Scores are bounded and mostly 0 / 0.5 / 1, so for small n this is
  approximate, and it has zero width when every score is equal; read it next to the Wilson interval.
- `--compare-base` pairs adapter and base episodes on (game, task_id, seed) and gives the same
  t interval for the mean paired difference; pairing removes the task-to-task variance. Each
  difference also says how many of its pairs changed and how many pairs the same mean and spread
  would need before the interval leaves 0 out: the size an evaluation must have to decide it.
Episodes with an `error` (env failure, cut off by max_turns, prompt too long) are counted apart and
left out of every rate and mean, the way validators set errored samples apart from genuine zeros.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.table import Table

Z_975 = 1.959963984540054  # standard normal 97.5 % quantile
TRACE = "trace"  # the game name of trace episodes
ALL_GAMES = "all_games"  # summary key pooling every game episode of a model


def wilson_interval(successes: int, trials: int, z: float = Z_975) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) when there are no trials."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def t_quantile_975(df: int) -> float:
    """Student-t 97.5 % quantile: exact for df 1 and 2, a 4-term Cornish-Fisher expansion from df 3
    (within 0.4 % at df 3, 0.01 % from df 5)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df == 1:
        return math.tan(math.pi * 0.475)
    if df == 2:
        return 0.95 * math.sqrt(2 / (1 - 0.95**2))
    z = Z_975
    return (z + (z**3 + z) / (4 * df)
            + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4))


def mean_interval(values: Sequence[float], low: float = -math.inf, high: float = math.inf
                  ) -> tuple[float | None, list[float] | None]:
    """(mean, [lo, hi]) with the t interval clipped to [low, high]; no interval for fewer than 2 values."""
    n = len(values)
    if n == 0:
        return None, None
    if n < 2:
        return sum(values) / n, None
    mean, std = mean_and_std(values)
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return mean, [max(low, mean - half), min(high, mean + half)]


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (n - 1 in the denominator) of two or more values."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _rate(count: int, total: int) -> float | None:
    return count / total if total else None


def _mean(values: Sequence[float | None]) -> float | None:
    """Mean of the known values (an env's evaluate() reports no token counts: None)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def game_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Outcome rates, mean score with CI, illegal-move and parse-error rates of one model on one game.

    illegal_rate = unusable replies / model replies; parse_error_rate = share of episodes lost to
    3 failed parses in a row."""
    scored = [r for r in records if not r["error"]]
    n = len(scored)
    wins = sum(r["outcome"] == "win" for r in scored)
    mean_score, score_ci = mean_interval([r["score"] for r in scored], 0.0, 1.0)
    replies = sum(r["turns"] for r in scored)
    illegal = sum(r["illegal_moves"] for r in scored)
    return {
        "episodes": len(records),
        "errors": len(records) - n,
        "win_rate": _rate(wins, n),
        "win_rate_ci95": list(wilson_interval(wins, n)) if n else None,
        "draw_rate": _rate(sum(r["outcome"] == "draw" for r in scored), n),
        "loss_rate": _rate(sum(r["outcome"] == "loss" for r in scored), n),
        "mean_score": mean_score,
        "score_ci95": score_ci,
        "illegal_rate": _rate(illegal, replies),
        "illegal_rate_ci95": list(wilson_interval(illegal, replies)) if replies else None,
        "parse_error_rate": _rate(sum(bool(r["parse_failed_game"]) for r in scored), n),
        "mean_turns": _mean([r["turns"] for r in scored]),
        "mean_generated_tokens": _mean([r["generated_tokens"] for r in scored]),
    }


def trace_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy (exact-output match) with its Wilson interval for one model's trace episodes."""
    scored = [r for r in records if not r["error"]]
    n = len(scored)
    correct = sum(r["outcome"] == "correct" for r in scored)
    mean_score, score_ci = mean_interval([r["score"] for r in scored], 0.0, 1.0)
    return {
        "episodes": len(records),
        "errors": len(records) - n,
        "accuracy": _rate(correct, n),
        "accuracy_ci95": list(wilson_interval(correct, n)) if n else None,
        "mean_score": mean_score,
        "score_ci95": score_ci,
        "mean_generated_tokens": _mean([r["generated_tokens"] for r in scored]),
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{model: {game: summary}} in first-seen order, plus `all_games` when a model played several games."""
    by_model: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for record in records:
        by_model.setdefault(record["model"], {}).setdefault(record["game"], []).append(record)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for model, by_game in by_model.items():
        summary[model] = {game: trace_summary(group) if game == TRACE else game_summary(group)
                          for game, group in by_game.items()}
        games = [g for g in by_game if g != TRACE]
        if len(games) > 1:
            summary[model][ALL_GAMES] = game_summary([r for g in games for r in by_game[g]])
    return summary


def paired_differences(records: list[dict[str, Any]], model: str = "adapter", baseline: str = "base"
                       ) -> dict[str, dict[str, Any]]:
    """Per game: mean of (model score - baseline score) over episodes with the same task and seed."""
    keyed = {(r["model"], r["game"], r["task_id"], r["seed"]): r for r in records if not r["error"]}
    diffs: dict[str, list[float]] = {}
    for (who, game, task_id, seed), record in keyed.items():
        other = keyed.get((baseline, game, task_id, seed))
        if who == model and other is not None:
            diffs.setdefault(game, []).append(record["score"] - other["score"])
    if len([g for g in diffs if g != TRACE]) > 1:
        diffs[ALL_GAMES] = [d for g, values in diffs.items() if g != TRACE for d in values]
    result = {}
    for game, values in diffs.items():
        mean, interval = mean_interval(values, -1.0, 1.0)
        result[game] = {"pairs": len(values), "score_diff": mean, "score_diff_ci95": interval,
                        "changed": sum(v != 0 for v in values), "pairs_to_decide": pairs_to_decide(values)}
    return result


def pairs_to_decide(differences: Sequence[float]) -> int | None:
    """How many pairs, with these differences' mean and spread, a 95 % t interval needs to leave 0 out:
    the smallest n with t(n-1)·s/√n < |mean|. None when the mean is 0 (no number of pairs decides)."""
    if len(differences) < 2:
        return None
    mean, std = mean_and_std(differences)
    if mean == 0:
        return None
    needed = max(2, math.ceil((Z_975 * std / abs(mean)) ** 2))  # the normal quantile's answer: a lower bound
    while t_quantile_975(needed - 1) * std / math.sqrt(needed) >= abs(mean):
        needed += 1
    return needed


# ---------------------------------------------------------------------- console tables
def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _with_ci(value: float | None, interval: list[float] | None, percent: bool = False) -> str:
    """'40% (17-69)' or '0.450 (0.21-0.69)'."""
    if value is None:
        return "-"
    if percent:
        shown = _pct(value)
        bounds = [f"{100 * x:.0f}" for x in interval] if interval else None
    else:
        shown = f"{value:.3f}"
        bounds = [f"{x:.2f}" for x in interval] if interval else None
    return shown if bounds is None else f"{shown} ({bounds[0]}-{bounds[1]})"


def _number(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def game_table(summary: dict[str, dict[str, dict[str, Any]]],
               comparison: dict[str, dict[str, Any]] | None = None, source: str | None = None) -> Table | None:
    """Games: one row per game and model; with a comparison, the paired score difference per game.
    `source` (where the scores came from) becomes the caption."""
    rows = [(game, model, stats) for model, games in summary.items()
            for game, stats in games.items() if game != TRACE]
    if not rows:
        return None
    table = Table(title="Games: 95% CI in parentheses (Wilson for the win rate, t for the mean score)",
                  caption=source, box=box.SIMPLE_HEAD)
    for header in ("game", "model", "n", "win", "draw", "loss", "mean score", "illegal", "parse-fail",
                   "turns", "tokens", "errors"):
        table.add_column(header, justify="left" if header in ("game", "model") else "right")
    if comparison is not None:
        table.add_column("score - base", justify="right")
    games = list(dict.fromkeys(game for game, _, _ in rows))
    for game in games:
        of_game = [(model, stats) for g, model, stats in rows if g == game]
        for index, (model, stats) in enumerate(of_game):
            cells = [game, model, str(stats["episodes"]), _with_ci(stats["win_rate"], stats["win_rate_ci95"], True),
                     _pct(stats["draw_rate"]), _pct(stats["loss_rate"]),
                     _with_ci(stats["mean_score"], stats["score_ci95"]), _pct(stats["illegal_rate"]),
                     _pct(stats["parse_error_rate"]), _number(stats["mean_turns"]),
                     _number(stats["mean_generated_tokens"]), str(stats["errors"])]
            if comparison is not None:
                pair = comparison.get(game) if model == "adapter" else None
                cells.append("" if pair is None else _signed(pair))
            # a rule under each game's block when several models share it
            table.add_row(*cells, end_section=len(of_game) > 1 and index == len(of_game) - 1)
    return table


def trace_table(summary: dict[str, dict[str, dict[str, Any]]],
                comparison: dict[str, dict[str, Any]] | None = None, source: str | None = None) -> Table | None:
    """Trace: accuracy with its Wilson interval per model; `source` becomes the caption."""
    rows = [(model, games[TRACE]) for model, games in summary.items() if TRACE in games]
    if not rows:
        return None
    table = Table(title="Trace: 95% Wilson CI in parentheses", caption=source, box=box.SIMPLE_HEAD)
    for header in ("model", "n", "accuracy", "tokens", "errors"):
        table.add_column(header, justify="left" if header == "model" else "right")
    if comparison is not None:
        table.add_column("accuracy - base", justify="right")
    for model, stats in rows:
        cells = [model, str(stats["episodes"]), _with_ci(stats["accuracy"], stats["accuracy_ci95"], True),
                 _number(stats["mean_generated_tokens"]), str(stats["errors"])]
        if comparison is not None:
            pair = comparison.get(TRACE) if model == "adapter" else None
            cells.append("" if pair is None else _signed(pair))
        table.add_row(*cells)
    return table


def _signed(pair: dict[str, Any]) -> str:
    if pair["score_diff"] is None:
        return "-"
    text = f"{pair['score_diff']:+.3f}"
    if pair["score_diff_ci95"] is not None:
        low, high = pair["score_diff_ci95"]
        text += f" ({low:+.2f} to {high:+.2f})"
    needed = pair.get("pairs_to_decide")
    # an interval that still holds 0 says how large an evaluation would settle it
    return f"{text} n={pair['pairs']}" + (f", needs {needed}" if needed and needed > pair["pairs"] else "")
