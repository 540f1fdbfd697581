"""PNG plots of a training run from its `metrics.jsonl`, one file per panel group.

Each figure draws its metrics against the step, with a dashed vertical line wherever
`curriculum/stage` changes (labelled with the new stage). A figure whose metrics never appear in
the file is skipped with a printed note, so runs without a critic, a curriculum or vLLM still plot.

Run:  python visualize.py --run-dir runs/qwen3-4b-games            (writes runs/qwen3-4b-games/plots/*.png)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402

from ppo_affine.run_log import console, report_failure  # noqa: E402
from utils import program_parser  # noqa: E402

STAGE_KEY = "curriculum/stage"


@dataclass(frozen=True)
class Panel:
    """One subplot: exact metric names and/or a family of names '<prefix>*<suffix>'."""
    title: str
    metrics: tuple[str, ...] = ()
    family: tuple[str, str] | None = None  # (prefix, suffix); the part between is the line label
    ylabel: str = ""


@dataclass(frozen=True)
class Figure:
    filename: str
    panels: tuple[Panel, ...]


FIGURES = (
    Figure("reward_score.png", (
        Panel("Reward and score per episode", ("env/reward_mean", "env/score_mean", "reward/episode_return")),
        Panel("Success rate", ("env/success_rate", "curriculum/rolling_success"), ylabel="rate"),
    )),
    Figure("success_by_game.png", (
        Panel("Success by game", family=("game/", "/success"), ylabel="rate"),
        Panel("Score by game", family=("game/", "/score"), ylabel="score"),
    )),
    Figure("success_by_stage.png", (
        Panel("Success by curriculum stage", family=("stage/", "/success"), ylabel="rate"),
    )),
    Figure("illegal_rate.png", (Panel("Illegal moves per model reply", ("env/illegal_rate",), ylabel="rate"),)),
    Figure("kl_beta.png", (
        Panel("KL to the reference", ("reward/kl_per_token",), ylabel="nats per token (the controller's target)"),
        Panel("KL coefficient β", ("kl/coef",)),
        Panel("Approx KL to the rollout policy", ("policy/approx_kl_k3",), ylabel="nats per token"),
    )),
    Figure("losses.png", (
        Panel("Policy loss", ("policy/loss",)),
        Panel("Value loss", ("value/loss",)),
        Panel("Entropy", ("policy/entropy",), ylabel="nats per token"),
        Panel("Explained variance", ("value/explained_variance",)),
    )),
    Figure("clipfrac.png", (Panel("Clip fraction", ("policy/clipfrac", "value/vf_clipfrac"), ylabel="fraction"),)),
    Figure("signal.png", (
        Panel("Update direction: corr(advantage, Δ log-prob) per reply", ("signal/advantage_logprob_corr",)),
        Panel("Δ log-prob of replies after the update", ("signal/logprob_change_positive",
                                                         "signal/logprob_change_negative"), ylabel="nats"),
    )),
    Figure("throughput.png", (
        Panel("Generation throughput", ("perf/tokens_per_s",), ylabel="tokens/s"),
        Panel("Phase time", ("perf/rollout_seconds", "perf/update_seconds"), ylabel="seconds"),
    )),
)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl records sorted by step; a blank or cut-off last line (a run killed mid-write) is ignored."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            raise ValueError(f"{path}, line {number}: not a JSON object ({line[:60]!r})") from None
    return sorted(records, key=lambda r: r.get("step", 0))


def stage_changes(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, new stage) for every step whose stage differs from the previous logged one."""
    changes, previous = [], None
    for record in records:
        stage = record.get(STAGE_KEY)
        if stage is None:
            continue
        if previous is not None and stage != previous:
            changes.append((record["step"], stage))
        previous = stage
    return changes


def panel_series(panel: Panel, records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """label -> (steps, values) of every metric of the panel present in the records (non-finite values skipped)."""
    names: dict[str, str] = {name: name for name in panel.metrics}
    if panel.family:
        prefix, suffix = panel.family
        for record in records:
            for key in record:
                if key.startswith(prefix) and key.endswith(suffix) and len(key) > len(prefix) + len(suffix):
                    names.setdefault(key, key[len(prefix):-len(suffix)])
    series = {}
    for key, label in names.items():
        points = [(r["step"], r[key]) for r in records
                  if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if points:
            steps, values = zip(*points)
            series[label] = (list(steps), list(values))
    return series


def draw(figure: Figure, records: list[dict[str, Any]], changes: list[tuple[int, str]], path: Path) -> bool:
    """Write one PNG; False (nothing written) when none of its metrics are present."""
    panels = [(panel, panel_series(panel, records)) for panel in figure.panels]
    panels = [(panel, series) for panel, series in panels if series]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), sharex=True, squeeze=False)
    for ax, (panel, series) in zip(axes[:, 0], panels):
        for label, (steps, values) in sorted(series.items()):
            ax.plot(steps, values, label=label, marker="." if len(steps) < 30 else None)
        for step, stage in changes:
            ax.axvline(step, color="grey", linestyle="--", linewidth=1)
            ax.annotate(stage, (step, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                        fontsize=8, color="grey")
        ax.set_title(panel.title)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_run(metrics_path: Path, output: Path) -> list[Path]:
    """Every figure with data, written under `output`; returns the files written."""
    records = [r for r in read_metrics(metrics_path) if "step" in r]
    if not records:
        raise ValueError(f"{metrics_path} holds no step records; nothing to plot.")
    output.mkdir(parents=True, exist_ok=True)
    changes = stage_changes(records)
    written = []
    for figure in FIGURES:
        path = output / figure.filename
        if draw(figure, records, changes, path):
            written.append(path)
        else:
            names = [m for p in figure.panels for m in p.metrics] + [f"{p.family[0]}*{p.family[1]}"
                                                                     for p in figure.panels if p.family]
            console.print(f"skipped {figure.filename}: no {', '.join(names)} in {metrics_path.name}", highlight=False,
                          soft_wrap=True)
    return written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = program_parser(__doc__)
    parser.add_argument("--run-dir", type=Path, required=True, help="run folder holding metrics.jsonl")
    parser.add_argument("--output", type=Path, help="folder for the PNGs (default <run-dir>/plots)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    metrics_path = args.run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        return report_failure("Error", f"{metrics_path} does not exist. Pass --run-dir the run folder a training "
                              "run writes metrics.jsonl into (<run.output_dir>/<run.name>).", 2)
    try:
        written = plot_run(metrics_path, args.output or args.run_dir / "plots")
    except ValueError as exc:
        return report_failure("Error", exc, 2)
    console.print(f"wrote {len(written)} plots to {args.output or args.run_dir / 'plots'}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
