"""Does folding the adapter into the weights change what local generation samples? The sampler's log-prob gap.

Local generation returns each sampled token's log-prob (from the logits it sampled from), and the trainer scores
the same tokens with the adapter path (`local/logprob_gap`, the mean |scoring - sampling| over sampled tokens).
With `generation.fold_adapter` the sampler runs W + ΔW held in the weights' dtype: in bfloat16 the sum rounds
to W's 8-bit mantissa, and a small ΔW (early in training, |B| small) is mostly lost, so the sampler is closer to
the base model than the policy being trained. This bench plays real leduc_poker episodes against a random
opponent with the fold on and off, at several scales of the LoRA B matrices (A as initialised), scores them the
way the trainer does, and reports per scale and setting:

- `gap_fold`, `gap_no_fold`: the mean log-prob gap over the sampled tokens;
- `fold_over_no_fold`: their ratio (the fold would stay on by default in a dtype only where this is <= 1.1;
  in bfloat16 it is not: docs/benchmarks.md, so local generation folds only float32 weights);
- `delta_lost`: ||fold(W + ΔW) - W - ΔW|| / ||ΔW|| over the adapted layers, the share of the delta the folded
  copy does not hold (the same for every layer kind; 0 in float32 to float noise).

    python -m bench.fold_gap --dtype bfloat16                      # SmolLM2-135M (the cpu preset), on CPU
    python -m bench.fold_gap --dtype bfloat16 --device cuda --json fold_gap.json
    python -m bench.fold_gap --tiny --dtype bfloat16 --episodes 2  # CI size
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import torch

from ppo_affine.batching import build_sequences
from ppo_affine.config import GenerationConfig, load_config
from ppo_affine.envs.factory import make_envs
from ppo_affine.envs.tasks import Task, game_task_id
from ppo_affine.experience import sampler_gap, score_sequences
from ppo_affine.local_generation import FoldedAdapter, LocalGenerator
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import RolloutRunner

TOKEN_BUDGET = 16384


class AlwaysFolds(LocalGenerator):
    """The local generator folding the adapter in any dtype (it folds only float32 weights by itself)."""

    def folds_adapter(self) -> bool:
        return FoldedAdapter.foldable_layers(self.policy.model) is not None


def load(args):
    from ppo_affine.policy import load_policy

    overrides = [f"model.dtype={args.dtype}", "model.use_4bit=false", *args.set]
    if args.tiny:
        from ppo_affine.testing.tiny import make_tiny_model_dir

        folder = make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="fold-gap-")) / "tiny")
        overrides += [f"model.name_or_path={folder}", "model.gguf_package=null"]
    config = load_config(presets=[args.preset], overrides=overrides)
    torch.manual_seed(0)
    return load_policy(config.train.model, config.train.lora, torch.device(args.device)), config


def set_lora_b(policy, std: float) -> None:
    """Every LoRA B entry drawn from N(0, std), the same draws at every scale (a seeded generator)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                draw = torch.randn(parameter.shape, generator=generator, dtype=torch.float32) * std
                parameter.copy_(draw.to(parameter.dtype))


def delta_lost(policy) -> float:
    """||fold(W + ΔW) - W - ΔW|| / ||ΔW|| over the adapted layers, ΔW and the difference in float32."""
    lost, total = 0.0, 0.0
    layers = FoldedAdapter.foldable_layers(policy.model) or []
    with torch.no_grad():
        for layer in layers:
            weight = layer.get_base_layer().weight
            delta = sum(layer.get_delta_weight(name).float() for name in layer.active_adapters if name in layer.lora_A)
            folded = (weight + delta.to(weight.dtype)).float()
            lost += float((folded - weight.float() - delta).square().sum())
            total += float(delta.square().sum())
    return (lost / total) ** 0.5 if total else 0.0


async def gap_of_a_rollout(policy, envs, cfg: GenerationConfig, episodes: int, fold: bool) -> tuple[float, int]:
    """The mean |scoring - sampling| log-prob over the sampled tokens of one rollout, and how many tokens."""
    generator = AlwaysFolds(policy, cfg, seed=0) if fold else LocalGenerator(policy, cfg, seed=0)
    builder = PromptBuilder(policy.tokenizer, cfg.max_prompt_tokens)
    tasks = [Task("openspiel", game_task_id("leduc_poker", 0), 7000 + i, "random", "bench", False)
             for i in range(episodes)]
    played = await RolloutRunner(envs, generator, builder, cfg).run(tasks, step=0)
    await generator.close()
    sequences = build_sequences(played)
    score_sequences(policy, sequences, TOKEN_BUDGET, cfg.temperature, with_values=False)
    return sampler_gap(sequences), sum(len(s.sampler_logprobs) for s in sequences)


async def measure(policy, scales: list[float], episodes: int, max_new_tokens: int, temperature: float) -> dict:
    envs = make_envs(load_config(overrides=["env.envs.openspiel.workers=0"]).env, seed=0, meets_search=False)
    rows = {}
    try:
        for std in scales:
            set_lora_b(policy, std)
            row = {"delta_lost": round(delta_lost(policy), 4)}
            for label, fold in (("fold", True), ("no_fold", False)):
                cfg = GenerationConfig(backend="local", max_concurrent_episodes=episodes, temperature=temperature,
                                       max_new_tokens=max_new_tokens, fold_adapter=fold)
                row[f"gap_{label}"], row[f"tokens_{label}"] = await gap_of_a_rollout(policy, envs, cfg, episodes, fold)
            row["fold_over_no_fold"] = row["gap_fold"] / row["gap_no_fold"] if row["gap_no_fold"] else None
            rows[f"{std:g}"] = row
            print(f"B std {std:g}: {json.dumps(row)}", flush=True)
    finally:
        for _, env in envs.values():
            await env.close()
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu", help="the model (default: the cpu preset's SmolLM2-135M)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model built locally instead")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scales", default="1e-5,1e-4,1e-3", help="comma-separated std of the LoRA B entries")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--set", action="append", default=[], help="config overrides")
    parser.add_argument("--json", type=Path, default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    policy, config = load(args)
    scales = [float(s) for s in args.scales.split(",")]
    result = {"model": config.train.model.name_or_path if not args.tiny else "tiny", "dtype": args.dtype,
              "device": args.device, "lora_r": config.train.lora.r, "episodes": args.episodes,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "by_b_std": asyncio.run(measure(policy, scales, args.episodes, args.max_new_tokens, args.temperature))}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return result


if __name__ == "__main__":
    main()
