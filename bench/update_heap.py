"""How much resident memory an update holds beyond torch's own tensors, by where glibc serves its buffers: the
trainer's update runs under `allocator.training_allocations`, which keeps blocks under a threshold (16 MB) in the heap
for speed; passes over sequences of different lengths then leave freed blocks the next pass's do not fit.

Each threshold runs in its own process: SmolLM2's shape (random weights, `--layers` of its 30), LoRA r 16, the
scoring pass and `--epochs` PPO epochs over 4 sequences of 700–1 100 tokens (micro-batches of 1 024), under
training_allocations with that threshold. Printed: the update's seconds, the process's resident rise over it, and
(`--live`, slower) torch's bytes alive at once.

    OMP_NUM_THREADS=1 python -m bench.update_heap --layers 10 --mmap-bytes 16777216,4194304,1048576,262144
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

LENGTHS = (1100, 900, 700, 1000)


def measure(layers: int, mmap_bytes: int, epochs: int, live_bytes: bool) -> dict:
    import contextlib

    import torch
    from transformers import AutoConfig

    import ppo_affine.allocator as allocator
    from bench.long_update import build_policy, long_episode
    from bench.random_model_step import FULL
    from ppo_affine.config import PPOConfig
    from ppo_affine.experience import score_sequences
    from ppo_affine.phase_costs import phase_peak
    from ppo_affine.testing.live_bytes import LiveBytes
    from ppo_affine.update import UpdateSettings, UpdateState, build_optimizer, ppo_update

    allocator._TRAINING_MMAP_BYTES = mmap_bytes
    model_type, fields = FULL["smollm2-135m"]
    config = AutoConfig.for_model(model_type, **{**fields, "num_hidden_layers": layers})
    policy = build_policy(config, torch.device("cpu"), torch.float32, checkpointing=False)
    sequences = []
    for index, tokens in enumerate(LENGTHS):
        sequence = long_episode(tokens, 6, config.vocab_size, torch.Generator().manual_seed(index))
        sequence.episode = index
        sequences.append(sequence)
    cfg = PPOConfig(ppo_epochs=epochs, micro_batch_tokens=1024)
    live, resident = LiveBytes(), {}
    started = time.perf_counter()
    with allocator.training_allocations(), live.mode if live_bytes else contextlib.nullcontext(), \
            phase_peak(resident, "update"):
        score_sequences(policy, sequences, 1024, 1.0, with_values=True)
        for sequence in sequences:
            replies = sequence.response_len
            sequence.advantages = torch.randn(replies, generator=torch.Generator().manual_seed(replies))
            sequence.returns = sequence.old_values + sequence.advantages
            sequence.token_weights = torch.ones(replies)
            sequence.value_weights = torch.ones(replies)
        settings = UpdateSettings(cfg, kl_coef=0.0, temperature=1.0, micro_batch_tokens=1024, shuffle_seed=0)
        ppo_update(policy, build_optimizer(policy, cfg, 1e-4), sequences, settings, UpdateState())
    row = {"layers": layers, "mmap_bytes": mmap_bytes, "seconds": round(time.perf_counter() - started, 1),
           "rss_rise_gb": round(resident["perf/update_rss_rise_bytes"] / 1e9, 3)}
    if live_bytes:
        row["torch_peak_gb"] = round(live.peak / 1e9, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10, help="of SmolLM2's 30 (default: 10)")
    parser.add_argument("--mmap-bytes", default="16777216,262144", help="thresholds, comma-separated")
    parser.add_argument("--epochs", type=int, default=2, help="PPO epochs (default: 2)")
    parser.add_argument("--live", action="store_true", help="also count torch's bytes alive at once (slower)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: this threshold only
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.layers, args.one, args.epochs, args.live)), flush=True)
        return
    for threshold in (int(t) for t in args.mmap_bytes.split(",")):
        child = [sys.executable, "-m", "bench.update_heap", "--layers", str(args.layers), "--epochs", str(args.epochs),
                 "--one", str(threshold)] + (["--live"] if args.live else [])
        out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
