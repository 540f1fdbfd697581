"""Steps per second of the real training loop on 1 and 2 (or N) data-parallel ranks, side by side.

Each setting is `torchrun --standalone --nproc-per-node R train_ppo.py ...` with the same global batch
(`ppo.batch_size` episodes per step, R ranks x batch/R each) for 1 warm-up step + `--steps` timed ones;
steps/s = 1 / the mean `perf/step_seconds` (rollout -> update -> curriculum -> log) of the timed steps.

    python -m bench.distributed_speed                          # tiny random model, CPU (gloo), 1 vs 2 ranks
    python -m bench.distributed_speed --model smollm2 --steps 3 --episodes 4
    python -m bench.distributed_speed --gpu-ranks 1,8          # also on CUDA GPUs (NCCL) when there are any

CPU settings share the machine's cores between the ranks (OMP_NUM_THREADS = cores / ranks), so on a
machine with few cores this measures what the exchanges cost, not a speed-up; the GPU rows (one GPU
per rank) are the scaling figures. Without a CUDA GPU they are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

STAGES = json.dumps([{"name": "s", "opponent": "random", "min_episodes": 10**6,
                      "tasks": [{"env": "openspiel", "games": ["leduc_poker"], "config_ids": [0]}]}])


def model_settings(model: str, folder: Path) -> list[str]:
    if model == "tiny":
        from ppo_affine.testing.tiny import make_tiny_model_dir

        model_dir = make_tiny_model_dir(folder / "tiny-model")
        return ["--set", f"model.name_or_path={model_dir}", "--set", "model.use_4bit=false",
                "--set", "model.dtype=float32", "--set", "model.gradient_checkpointing=false",
                "--set", "generation.max_new_tokens=3", "--set", "generation.max_turns=6"]
    return ["--preset", "cpu"]  # SmolLM2-135M


def run(ranks: int, device: str, args: argparse.Namespace, folder: Path, settings: list[str]) -> dict:
    """One torchrun launch; its per-step timings from metrics.jsonl."""
    output = folder / f"{device}-{ranks}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(ROOT / "train_ppo.py"), *settings, "--output-dir", str(output), "--max-steps", str(args.steps + 1),
               "--set", "run.name=bench", "--set", f"run.device={device}", "--set", "generation.backend=local",
               "--set", f"ppo.batch_size={args.episodes}",
               "--set", f"generation.max_concurrent_episodes={args.episodes}",
               "--set", "checkpointing.save_every=100000", "--set", f"curriculum.stages={STAGES}",
               *[a for s in args.set for a in ("--set", s)]]
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if device == "cpu":  # the ranks share the cores, as a single process would use them all
        environment["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment)
    if done.returncode != 0:
        sys.exit(f"{ranks} rank(s) on {device} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (output / "bench" / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:]  # the first step pays one-off costs (allocations, first generate)
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    return {"device": device, "ranks": ranks, "threads_per_rank": environment.get("OMP_NUM_THREADS", "-"),
            "episodes_per_step": records[0]["env/episodes"], "world_size_logged": records[0]["dist/world_size"],
            "steps_per_s": round(1.0 / mean("perf/step_seconds"), 4),
            "step_seconds": round(mean("perf/step_seconds"), 3),
            "rollout_seconds": round(mean("perf/rollout_seconds"), 3),
            "update_seconds": round(mean("perf/update_seconds"), 3) if all("perf/update_seconds" in r for r in timed)
            else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--episodes", type=int, default=8, help="ppo.batch_size: episodes per step, all ranks together")
    parser.add_argument("--cpu-ranks", default="1,2", help="rank counts to run on the CPU (gloo)")
    parser.add_argument("--gpu-ranks", default="1,2", help="rank counts to run on CUDA GPUs (NCCL), if any")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    results, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="distributed-speed-") as folder:
        settings = model_settings(args.model, Path(folder))
        for ranks in map(int, args.cpu_ranks.split(",")):
            results.append(run(ranks, "cpu", args, Path(folder), settings))
        gpus = torch.cuda.device_count()
        for ranks in map(int, args.gpu_ranks.split(",")):
            if ranks <= gpus:
                results.append(run(ranks, "cuda", args, Path(folder), settings))
            else:
                skipped.append(f"{ranks} rank(s) on CUDA: {gpus} GPU(s) visible")
    for result in results:
        alone = next((r for r in results if r["device"] == result["device"] and r["ranks"] == 1), None)
        result["speedup_vs_1_rank"] = round(result["steps_per_s"] / alone["steps_per_s"], 3) if alone else None
    if args.json:
        print(json.dumps({"model": args.model, "cpu_count": os.cpu_count(), "settings": results, "skipped": skipped},
                         indent=1))
        return
    columns = ["device", "ranks", "threads_per_rank", "episodes_per_step", "steps_per_s", "speedup_vs_1_rank",
               "step_seconds", "rollout_seconds", "update_seconds"]
    print(f"model {args.model}, {os.cpu_count()} CPU cores")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for result in results:
        print("| " + " | ".join(str(result[c]) for c in columns) + " |")
    for line in skipped:
        print(f"skipped: {line}")


if __name__ == "__main__":
    main()
