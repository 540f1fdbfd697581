"""The cpu preset in full precision against the same run with a 4-bit NF4 base (`model.use_4bit=true`),
side by side: peak memory, step time and the score of one evaluation.

Each run is its own process, started in turn (full, 4-bit, full, 4-bit, ...), so a machine whose speed drifts
(cores shared with other jobs) slows both alike: quote the 4-bit / full ratios of the pairs. Peak memory is
the process's own maximum resident set (what `/usr/bin/time -v` reports), step times come from the run's
metrics.jsonl, and the score is `evaluate.py` on the trained checkpoint (and, `--compare-base`, on the base
model) with the same seeds in both precisions.

    python -m bench.quantized_speed                      # 3 pairs of training runs, 24 evaluation episodes
    python -m bench.quantized_speed --repeats 2 --episodes 12 --opponent mcts
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"full": [], "nf4": ["--set", "model.use_4bit=true"]}


def run_measured(argv: list[str], log: Path) -> dict:
    """Run a program to its end; its wall seconds and peak resident memory (GB), from the kernel's accounting."""
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(argv)} failed; see {log}")
    return {"wall_s": round(seconds, 1), "peak_rss_gb": round(usage.ru_maxrss / 1e6, 2)}  # ru_maxrss is in KiB


def train(mode: str, out: Path, name: str) -> dict:
    measured = run_measured(["train_ppo.py", "--preset", "cpu", *MODES[mode], "--output-dir", str(out),
                             "--set", f"run.name={name}"], out / f"{name}.log")
    steps = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    for key in ("step_seconds", "rollout_seconds", "update_seconds", "tokens_per_s"):
        measured[key] = round(statistics.median(s[f"perf/{key}"] for s in steps), 1)
    return measured


def evaluate(mode: str, checkpoint: Path, out: Path, args: argparse.Namespace) -> dict:
    folder = out / f"eval-{mode}"
    measured = run_measured(["evaluate.py", "--preset", "cpu", *MODES[mode], "--checkpoint", str(checkpoint),
                             "--games", args.game, "--episodes", str(args.episodes), "--opponent", args.opponent,
                             "--compare-base", "--output-dir", str(folder)], out / f"eval-{mode}.log")
    models = json.loads((folder / "summary.json").read_text())["models"]
    for model in ("adapter", "base"):
        stats = models[model][args.game]
        measured[f"{model}_score"] = round(stats["mean_score"], 3)
        measured[f"{model}_score_ci95"] = [round(x, 3) for x in stats["score_ci95"]]
        measured[f"{model}_illegal_rate"] = round(stats["illegal_rate"], 3)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs of training runs (full, then 4-bit)")
    parser.add_argument("--episodes", type=int, default=24, help="evaluation episodes per model")
    parser.add_argument("--game", default="leduc_poker")
    parser.add_argument("--opponent", default="random", choices=["random", "mcts"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="quantized-speed-") as scratch:
        out = Path(scratch)
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES:
                runs[mode].append(train(mode, out, f"{mode}-{repeat}"))
                print(json.dumps({"train": mode, "repeat": repeat, **runs[mode][-1]}), flush=True)
        evaluations = {}
        for mode in MODES:  # the runs are seeded: every repeat trained the same adapter
            evaluations[mode] = evaluate(mode, out / f"{mode}-0" / "checkpoints" / "checkpoint-3", out, args)
            print(json.dumps({"evaluate": mode, **evaluations[mode]}), flush=True)
    ratios = {key: round(statistics.median(nf4[key] / full[key] for full, nf4 in zip(runs["full"], runs["nf4"])), 2)
              for key in ("wall_s", "peak_rss_gb", "step_seconds", "rollout_seconds", "update_seconds", "tokens_per_s")}
    print(json.dumps({"train_median": {mode: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
                                       for mode, rows in runs.items()},
                      "nf4_over_full_median_of_pairs": ratios, "evaluate": evaluations,
                      "settings": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
