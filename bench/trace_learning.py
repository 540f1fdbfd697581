"""Does the trace env learn? Exact match of base, SFT (the interpreter as teacher) and SFT+PPO on held-out tasks.

    python -m bench.trace_learning --output-dir ~/runs/trace-learn
    python -m bench.trace_learning --output-dir ~/runs/trace-learn-credit --set ppo.reward.trace_line_credit=0.5

1. base: the model replies greedily to the held-out tasks of each level in `--levels` (the first `--eval-tasks`
   ids of the level's block, which training never draws: docs/trace.md), through evaluate.py (the env's prompt,
   one turn, exact match), replies stopping at their closing fence (the first fenced block is what the env
   scores, so the stop changes no score);
2. SFT: `sft_warmstart.py --games '' --trace N --trace-levels LEVELS` (the program's real stdout as the reply);
3. PPO from the SFT adapter (`train_ppo.py`, cpu + trace + warm_start presets): a curriculum of one stage per
   level, promoting on `--threshold` over `--min-episodes` (`--review R`: a later stage draws R of its tasks
   from the levels before it); exact match is the reward unless `--set
   ppo.reward.trace_line_credit=C` adds partial credit;
4. the SFT and SFT+PPO adapters reply to the same held-out tasks.

The table: per level and model, exact match with its Wilson interval, and the paired differences (the same
task both ways; Student t) SFT − base, SFT+PPO − base and SFT+PPO − SFT; then the stage the PPO run reached and
the minutes of each phase. Every phase's output stays in `--output-dir` (eval-*.jsonl, sft/, ppo/), and a phase
whose output is there is not run again: a stopped bench goes on where it was with the same command (a PPO run
resumes from its last checkpoint).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import evaluate
import sft_warmstart
import train_ppo
from ppo_affine import report
from ppo_affine.checkpoint import find_resumable
from ppo_affine.config import load_config
from ppo_affine.envs.tasks import Task, trace_level_of, trace_level_range, validator_seed
from ppo_affine.policy import adapter_folder

MODELS = ("base", "sft", "sft+ppo")
# PPO's step: 8 episodes, one epoch, the rate bench/learning.py tuned for SmolLM2 on two cores
TRAIN_OVERRIDES = ["ppo.batch_size=8", "ppo.ppo_epochs=1", "ppo.learning_rate=2e-4",
                   "generation.max_concurrent_episodes=8", "ppo.micro_batch_tokens=4096",
                   "logging.log_samples_every=1"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="0,1", help="comma-separated trace levels, in curriculum order")
    parser.add_argument("--eval-tasks", type=int, default=48, help="held-out tasks per level")
    parser.add_argument("--sft-tasks", type=int, default=400, help="interpreter-teacher records, cycling the levels")
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="PPO steps")
    parser.add_argument("--threshold", type=float, default=0.5, help="success rate that promotes a stage")
    parser.add_argument("--min-episodes", type=int, default=32, help="episodes a stage plays before promotion")
    parser.add_argument("--review", type=float, default=0.0,
                        help="share of each later stage's tasks drawn from the levels before it (curriculum 'review')")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/trace-learning"))
    parser.add_argument("--set", action="append", default=[], help="more --set overrides, for every phase")
    args = parser.parse_args(argv)
    args.levels = [int(level) for level in args.levels.split(",")]
    return args


def common_sets(args: argparse.Namespace) -> list[str]:
    return ["generation.stop_at_closing_fence=true", f"generation.max_new_tokens={args.max_new_tokens}",
            "generation.context_strategy=full", *args.set]


def held_out_tasks(args: argparse.Namespace, env_name: str) -> list[Task]:
    """The first `eval_tasks` ids of each level's block, with the validators' seed of each."""
    return [Task(env_name, task_id, validator_seed("trace", task_id), None, "eval", False)
            for level in args.levels
            for task_id in range(trace_level_range(level)[0], trace_level_range(level)[0] + args.eval_tasks)]


def evaluated(args: argparse.Namespace, label: str, adapter: Path | None) -> list[dict]:
    """The model's records on the held-out tasks, from `eval-<label>.jsonl` when an earlier run played them."""
    path = args.output_dir / f"eval-{label.replace('+', '-')}.jsonl"
    if path.exists():
        return [json.loads(line) for line in path.read_text().splitlines()]
    config = load_config(presets=["cpu", "trace"], overrides=["generation.max_concurrent_episodes=16",
                                                              *common_sets(args), "generation.temperature=0",
                                                              "generation.backend=local"])
    specs = evaluate.eval_env_specs(config, {"trace"})
    tasks = held_out_tasks(args, specs["trace"][0])
    records = asyncio.run(evaluate.evaluate(config, tasks, specs, adapter_folder(adapter) if adapter else None,
                                            False, None))
    for record in records:
        record["model"], record["level"] = label, trace_level_of(record["task_id"])
    staging = path.with_suffix(".tmp")
    staging.write_text("".join(json.dumps(r) + "\n" for r in records))
    staging.replace(path)
    return records


def last_checkpoint(folder: Path) -> Path | None:
    return find_resumable(folder) if folder.exists() else None


def warm_start(args: argparse.Namespace) -> Path:
    """The SFT checkpoint, made now unless an earlier run saved it."""
    done = last_checkpoint(args.output_dir / "sft" / "checkpoints")
    if done is not None:
        return done
    sets = [arg for s in [f"generation.max_new_tokens={args.max_new_tokens}", *args.set] for arg in ("--set", s)]
    code = sft_warmstart.main(["--preset", "cpu", "--preset", "trace", "--games", "", "--trace", str(args.sft_tasks),
                               "--trace-levels", ",".join(map(str, args.levels)), "--epochs", str(args.sft_epochs),
                               "--output-dir", str(args.output_dir / "sft"), *sets])
    if code != 0:
        sys.exit("the SFT failed")
    return last_checkpoint(args.output_dir / "sft" / "checkpoints")


def ppo(args: argparse.Namespace, sft: Path) -> Path:
    """The PPO run from the SFT adapter through the levels; resumed where an earlier run stopped."""
    folder = args.output_dir / "ppo"
    stages = [{"name": f"level-{level}", "success_threshold": args.threshold, "min_episodes": args.min_episodes,
               "review": args.review if index else 0.0, "tasks": [{"env": "trace", "trace_difficulty": [level]}]}
              for index, level in enumerate(args.levels)]
    sets = [*TRAIN_OVERRIDES, *common_sets(args), f"curriculum.stages={json.dumps(stages)}", "run.name=ppo",
            "checkpointing.save_every=1"]
    command = ["--preset", "cpu", "--preset", "trace", "--preset", "warm_start", "--output-dir", str(folder),
               "--max-steps", str(args.steps), *[arg for s in sets for arg in ("--set", s)]]
    started = last_checkpoint(folder / "ppo" / "checkpoints")
    command += ["--resume", "latest"] if started is not None else ["--init-adapter", str(sft)]
    if started is None or started.name != f"checkpoint-{args.steps}":
        if train_ppo.main(command) != 0:
            sys.exit("PPO failed")
    checkpoint = last_checkpoint(folder / "ppo" / "checkpoints")
    if checkpoint is None or checkpoint.name != f"checkpoint-{args.steps}":
        sys.exit(f"PPO stopped early ({checkpoint}); no evaluation of a partial run")
    return checkpoint


def stages_reached(metrics_path: Path) -> list[dict]:
    """Each step's stage and rolling success, from the PPO run's metrics."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [{"step": r.get("step"), "stage": r.get("curriculum/stage"), "score": r.get("env/score_mean"),
             "rolling_success": r.get("curriculum/rolling_success")} for r in rows]


def paired(records: list[dict], model: str, baseline: str, level: int) -> dict | None:
    scores = {(r["model"], r["task_id"]): r["score"] for r in records if not r["error"] and r["level"] == level}
    diffs = [scores[(model, t)] - scores[(baseline, t)] for (who, t) in scores
             if who == model and (baseline, t) in scores]
    if not diffs:
        return None
    mean, interval = report.mean_interval(diffs, -1.0, 1.0)
    return {"pairs": len(diffs), "diff": mean, "diff_ci95": interval, "changed": sum(d != 0 for d in diffs)}


def results_table(records: list[dict], levels: list[int]) -> dict:
    result: dict = {}
    for level in levels:
        row: dict = {}
        for model in MODELS:
            group = [r for r in records if r["model"] == model and r["level"] == level]
            if group:
                row[model] = report.trace_summary(group)
        row["paired"] = {f"{m} - {b}": paired(records, m, b, level)
                         for m, b in (("sft", "base"), ("sft+ppo", "base"), ("sft+ppo", "sft"))}
        result[f"level {level}"] = row
    return result


def print_table(table: dict) -> None:
    def rate(summary: dict | None) -> str:
        if not summary or summary["accuracy"] is None:
            return "-"
        low, high = summary["accuracy_ci95"]
        return f"{summary['accuracy']:.3f} [{low:.2f}, {high:.2f}]"

    def diff(pair: dict | None) -> str:
        if pair is None:
            return "-"
        low, high = pair["diff_ci95"] if pair["diff_ci95"] else (float("nan"), float("nan"))
        return f"{pair['diff']:+.3f} [{low:+.2f}, {high:+.2f}] ({pair['changed']} of {pair['pairs']} differ)"

    print("| level | base | SFT | SFT+PPO | SFT − base | SFT+PPO − base | SFT+PPO − SFT |")
    print("|---|---|---|---|---|---|---|")
    for level, row in table.items():
        pairs = row["paired"]
        print(f"| {level} | {rate(row.get('base'))} | {rate(row.get('sft'))} | {rate(row.get('sft+ppo'))} | "
              f"{diff(pairs['sft - base'])} | {diff(pairs['sft+ppo - base'])} | {diff(pairs['sft+ppo - sft'])} |")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    minutes: dict[str, float] = {}

    def timed(name: str, work):
        started = time.perf_counter()
        value = work()
        minutes[name] = round((time.perf_counter() - started) / 60, 2)
        return value

    records = timed("eval base", lambda: evaluated(args, "base", None))
    sft = timed("sft", lambda: warm_start(args))
    records += timed("eval sft", lambda: evaluated(args, "sft", sft))
    trained = timed("ppo", lambda: ppo(args, sft))
    records += timed("eval sft+ppo", lambda: evaluated(args, "sft+ppo", trained))
    stages = stages_reached(args.output_dir / "ppo" / "ppo" / "metrics.jsonl")
    result = {"levels": args.levels, "eval_tasks_per_level": args.eval_tasks, "sft_tasks": args.sft_tasks,
              "steps": args.steps, "threshold": args.threshold, "review": args.review, "overrides": args.set,
              "table": results_table(records, args.levels),
              "stages": stages, "stage_reached": stages[-1]["stage"] if stages else None,
              "promotions": sum(a["stage"] != b["stage"] for a, b in zip(stages, stages[1:])),
              "minutes": minutes}
    (args.output_dir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print_table(result["table"])
    print(f"stage reached: {result['stage_reached']} ({result['promotions']} promotions); minutes: {minutes}")
    return result


if __name__ == "__main__":
    main()
