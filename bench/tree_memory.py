"""Peak memory of one training pass over reasoned episodes, as trees and per turn, at one micro-batch budget.

Two synthetic episodes of seven turns: each turn's sequence is a growing prefix of one 1 650-token history
(500 tokens at the first turn, 165 more each turn) followed by its own 20-token reply. The pass is the
update's: micro-batches of `--budget` tokens, log-probs and values with gradients, backward. Glibc keeps
freed memory in its arenas, which makes peak RSS depend on the order of allocations more than on their size
(one identical pass peaked at 8.2 and at 12.1 GB); run it with large allocations mapped and unmapped one by
one, so that RSS follows what is alive:

    MALLOC_MMAP_THRESHOLD_=65536 python -m bench.tree_memory --mode per-turn
    MALLOC_MMAP_THRESHOLD_=65536 python -m bench.tree_memory --mode tree
"""
from __future__ import annotations

import argparse
import json
import random
import resource


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["tree", "per-turn"], required=True)
    parser.add_argument("--budget", type=int, default=4096, help="ppo.micro_batch_tokens")
    parser.add_argument("--preset", default="cpu")
    args = parser.parse_args()

    from ppo_affine.batching import TrainSequence, as_trees, micro_batches
    from ppo_affine.config import load_config
    from ppo_affine.model_files import pick_device
    from ppo_affine.policy import load_policy

    cfg = load_config(presets=[args.preset]).train
    policy = load_policy(cfg.model, cfg.lora, pick_device(cfg.run.device))
    rng = random.Random(0)
    sequences = []
    for episode in range(2):
        history = [rng.randrange(100, 5000) for _ in range(1650)]
        for turn in range(7):
            start = 500 + 165 * turn
            reply = [rng.randrange(100, 5000) for _ in range(20)]
            sequences.append(TrainSequence(episode=episode, input_ids=history[:start] + reply,
                                           spans=[(start, start + 20)], turns=[turn]))
    if args.mode == "tree":
        sequences = as_trees(sequences, args.budget)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for batch in micro_batches(sequences, args.budget, policy.tokenizer.pad_token_id, policy.device,
                               policy.shares_prefixes_with_gradients()):
        scored = policy.score(batch.input_ids, None, batch.response_mask, tree=batch.tree, with_values=True)
        (scored.logprobs.sum() + scored.values.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mode": args.mode, "budget": args.budget, "rows": len(sequences),
                      "tokens": sum(len(s.input_ids) for s in sequences),
                      "pass_peak_gb_over_start": round((peak - before) / 1e6, 2)}))


if __name__ == "__main__":
    main()
