"""Does training on DISTILL-V2 cells raise the DISTILL-V2 score on cells of other tasks? SmolLM2 on CPU.

    python -m bench.distill_learning --output-dir ~/runs/distill-learning

1. Cells, made once and kept (OUTPUT/cells-train/, OUTPUT/cells-held-out/, in the published layout): `--samples`
   episodes of one policy (the cpu preset's model, sampling at `--temperature`) on each of `--tasks` leduc_poker
   tasks against a random opponent, the same task id and seed within a cell, each rollout's reward the env's score
   (as real cells hold N samples of one teacher on one task). The first `--train-tasks` tasks train, the rest are
   held out: no held-out task's rollouts are ever trained on.
2. The held-out score of the base (the env's arithmetic, `ppo_affine/distill/`).
3. `--steps` AdamW steps on the LoRA, each on `--cells-per-step` training cells drawn with a seeded generator
   (`distill/training.py`: the score's own gradient, two passes a cell).
4. The held-out score after, and the paired difference by cell with its 95 % interval. A JSON summary is printed
   and written to OUTPUT/summary.json; with --resume-cells the cells of an earlier run are reused.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import evaluate
from ppo_affine.config import load_config
from ppo_affine.distill import read_cells, score_cells
from ppo_affine.distill.training import accumulate_cell_gradients
from ppo_affine.model_files import pick_device
from ppo_affine.policy import load_policy
from ppo_affine.report import mean_interval
from ppo_affine.testing.distill_cells import write_cells

GAME = "leduc_poker"


def play_cells(config, tasks: int, samples: int, seed: int, folder: Path) -> list[dict]:
    """`samples` episodes of each of `tasks` tasks, grouped into cells; the episodes file kept beside them."""
    distinct = evaluate.game_tasks(GAME, tasks, seed, "random", "openspiel")
    repeated = [task for task in distinct for _ in range(samples)]
    specs = evaluate.eval_env_specs(config, {"openspiel"})
    records = asyncio.run(evaluate.evaluate(config, repeated, specs, None, False, folder / "episodes.jsonl"))
    by_task = defaultdict(list)
    for record in records:
        by_task[(record["task_id"], record["seed"])].append(record)
    cells = []
    for task_idx, ((task_id, _), played) in enumerate(by_task.items()):
        rows = [{"reward": None if r["error"] else float(r["score"]), "messages": r["conversation"]} for r in played]
        cells.append({"task_idx": task_idx, "env_name": "openspiel", "task_id": task_id,
                      "teacher_name": "smollm2-t1", "rows": rows})
    return cells


def held_out_scores(policy, cells) -> dict[int, float]:
    with torch.no_grad(), policy.evaluating():
        return {idx: result.score for idx, result in score_cells(cells, policy).cells.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True, help="where cells and summary.json go")
    parser.add_argument("--tasks", type=int, default=48, help="leduc_poker tasks, one cell each (default 48)")
    parser.add_argument("--samples", type=int, default=4, help="rollouts per cell (default 4)")
    parser.add_argument("--train-tasks", type=int, default=32, help="the first N cells train (default 32)")
    parser.add_argument("--temperature", type=float, default=1.0, help="the rollouts' sampling (default 1.0)")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps (default 24)")
    parser.add_argument("--cells-per-step", type=int, default=4, help="training cells per step (default 4)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW on the LoRA (default 1e-4)")
    parser.add_argument("--seed", type=int, default=9300, help="tasks, sampling and the cell draws (default 9300)")
    parser.add_argument("--resume-cells", action="store_true", help="reuse OUTPUT's cells (default: make them)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config overrides on the cpu preset (default none), e.g. --set model.dtype=float32")
    args = parser.parse_args(argv)
    if not 0 < args.train_tasks < args.tasks:
        parser.error(f"--train-tasks must be between 1 and --tasks - 1 ({args.tasks - 1}), got {args.train_tasks}")

    config = load_config(presets=["cpu"], overrides=[f"generation.temperature={args.temperature}",
                                                     "generation.backend=local", f"run.seed={args.seed}",
                                                     *args.set])
    train_dir, held_dir = args.output_dir / "cells-train", args.output_dir / "cells-held-out"
    started = time.perf_counter()
    if not args.resume_cells:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        cells = play_cells(config, args.tasks, args.samples, args.seed, args.output_dir)
        write_cells(train_dir, cells[:args.train_tasks])
        write_cells(held_dir, cells[args.train_tasks:])
    played_seconds = time.perf_counter() - started
    train_cells, held_cells = read_cells(train_dir), read_cells(held_dir)

    cfg = config.train
    torch.manual_seed(args.seed)
    policy = load_policy(cfg.model, cfg.lora, pick_device(cfg.run.device))
    before = held_out_scores(policy, held_cells)
    trainable = [p for name, p in policy.named_parameters() if p.requires_grad and "lora_" in name]
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate)
    draws, curve = random.Random(args.seed), []
    with policy.evaluating():  # dropout off: both passes of a cell see the same model
        for step in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            chosen = draws.sample(train_cells, min(args.cells_per_step, len(train_cells)))
            result = accumulate_cell_gradients(policy, chosen)
            torch.nn.utils.clip_grad_norm_(trainable, cfg.ppo.max_grad_norm)
            optimizer.step()
            curve.append(round(result.score, 4))
            print(f"step {step + 1}: training cells' score before the step {result.score:+.3f}", flush=True)
    after = held_out_scores(policy, held_cells)

    differences = [after[idx] - before[idx] for idx in before]
    difference, interval = mean_interval(differences)
    summary = {
        "command": "python -m bench.distill_learning " + " ".join(sys.argv[1:] if argv is None else argv),
        "cells": {"train": len(train_cells), "held_out": len(held_cells), "samples": args.samples},
        "held_out_before": mean_interval(list(before.values())), "held_out_after": mean_interval(list(after.values())),
        "held_out_after_minus_before": {"mean": difference, "ci95": interval,
                                        "cells_up": sum(d > 0 for d in differences),
                                        "cells_down": sum(d < 0 for d in differences)},
        "training_curve": curve, "seconds": {"cells": round(played_seconds, 1),
                                             "total": round(time.perf_counter() - started, 1)},
    }
    (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
