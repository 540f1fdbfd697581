"""What a local rollout adds to resident memory, against its plan (the keys and values it held at most, and the folded
adapter's weight copies): the cpu preset's SmolLM2 generates two 128-token replies to two prompts of about 800 tokens,
twice (the second rollout's prompts extend the first's), with the adapter folded or not. Printed per rollout: the
resident rise, how much of it is file-backed (the weights, mapped from their file, fault in at the first forward),
and the plan's terms.

    OMP_NUM_THREADS=1 python -m bench.rollout_memory            # folded, as the trainer generates in float32
    OMP_NUM_THREADS=1 python -m bench.rollout_memory --no-fold
"""
from __future__ import annotations

import argparse
import asyncio
import json


def status_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


async def rollouts(generator, prompts: list[list[int]]) -> list[dict]:
    from ppo_affine.phase_costs import phase_peak

    rows = []
    for step in range(2):
        resident, file_before = {}, status_bytes("RssFile")
        with phase_peak(resident, "rollout"):
            async with generator.rollout(step):
                replies = await asyncio.gather(*[generator.generate(prompt + [1] * 50 * step, key, key)
                                                 for key, prompt in enumerate(prompts)])
        kv = generator.peak_cache_tokens * generator.caches.bytes_per_token
        folded = generator.folded_copy_bytes()
        rise = resident["perf/rollout_rss_rise_bytes"]
        rows.append({"rollout": step + 1, "reply_tokens": [len(r.token_ids) for r in replies],
                     "rss_rise_gb": round(rise / 1e9, 3),
                     "file_backed_rise_gb": round((status_bytes("RssFile") - file_before) / 1e9, 3),
                     "planned_kv_gb": round(kv / 1e9, 3), "planned_folded_gb": round(folded / 1e9, 3),
                     "planned_over_rise": round((kv + folded) / rise, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-fold", action="store_true", help="generate through the adapter path")
    args = parser.parse_args()
    import torch

    from ppo_affine.allocator import return_freed_memory_to_the_os
    from ppo_affine.config import load_config
    from ppo_affine.local_generation import LocalGenerator
    from ppo_affine.policy import load_policy

    fold = str(not args.no_fold).lower()
    train = load_config(presets=["cpu"], overrides=["train.generation.max_new_tokens=128",
                                                    f"train.generation.fold_adapter={fold}"]).train
    return_freed_memory_to_the_os()  # as the trainer sets glibc up for generation
    policy = load_policy(train.model, train.lora, torch.device("cpu"))
    generator = LocalGenerator(policy, train.generation, seed=0)
    prompts = [torch.randint(10, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (800, 760)]
    for row in asyncio.run(rollouts(generator, prompts)):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
