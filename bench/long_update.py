"""One PPO update of one long agent episode, by a model built from its config with random weights on the device:
the peak memory against the memory plan, and seconds. The GPU row `bash bench/gpu_rows.sh long-update` (Qwen3.6-35B-A3B
in bf16 at 32 k and 64 k tokens, on an H200); at tiny size it runs on any CPU (tests/test_bench_long_update.py).

The episode is one sequence, as an agent episode whose turns extend each other is: `--turns` turns, each an
observation and then a reply that is a quarter of the turn, random token ids. The trainer's own path runs on it:
LoRA on the architecture's default targets, gradient checkpointing as the trainer turns it on, the scoring pass
(old and reference log-probs, values), then one epoch of `ppo_update` with random advantages. Peak memory is
torch.cuda.max_memory_allocated on a GPU, torch's live tensor bytes on a CPU (`LiveBytes`); the plan is
memory_plan.py's trainer terms for the same settings, without the CUDA reserve (nothing is generated: no caches). On
a CPU the row also has the process's resident memory's rise over the update (rss_rise_gb; the weights were resident
before it).

    python -m bench.long_update --model qwen3.6-35b-a3b --device cuda --tokens 32768,65536   # a lent H200
    python -m bench.long_update --model tiny-qwen3_5_moe --tokens 2048                        # any machine, seconds
    python -m bench.long_update --model smollm2-135m --no-checkpointing --tokens 2048,4096 --turns 10   # the cpu preset
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from bench.random_model_step import MODELS, model_config


def long_episode(tokens: int, turns: int, vocab: int, generator: torch.Generator):
    """One sequence of `tokens` random ids: `turns` turns, the last quarter of each a reply."""
    from ppo_affine.batching import TrainSequence

    width = tokens // turns
    spans = [(start + width - max(1, width // 4), start + width) for start in range(0, width * turns, width)]
    ids = torch.randint(2, vocab, (width * turns,), generator=generator).tolist()
    return TrainSequence(episode=0, input_ids=ids, spans=spans, turns=list(range(turns)))


def build_policy(config, device: torch.device, dtype: torch.dtype, checkpointing: bool = True):
    """The trainer's policy on `config`'s model with random weights, built on `device`: LoRA (r 16) on the default
    targets, gradient checkpointing (non-reentrant) as model_files.py turns it on, unless `checkpointing` is off."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ppo_affine.architectures import default_lora_targets
    from ppo_affine.policy import Policy, resolve_lora_targets
    from ppo_affine.testing.tiny import make_tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    targets = resolve_lora_targets(base, default_lora_targets(config), explicit=False)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    return Policy(model, make_tokenizer()).train()


def one_update(policy, sequence, micro_batch_tokens: int) -> dict[str, float]:
    """Score the episode and run one PPO epoch over it; the seconds of each."""
    from ppo_affine.config import PPOConfig
    from ppo_affine.experience import score_sequences
    from ppo_affine.update import UpdateSettings, UpdateState, build_optimizer, ppo_update

    cfg = PPOConfig(ppo_epochs=1, micro_batch_tokens=micro_batch_tokens)
    started = time.perf_counter()
    score_sequences(policy, [sequence], micro_batch_tokens, 1.0, with_values=True)
    scored = time.perf_counter()
    replies = sequence.response_len
    sequence.advantages = torch.randn(replies, generator=torch.Generator().manual_seed(1))
    sequence.returns = sequence.old_values + sequence.advantages
    sequence.token_weights = torch.ones(replies)
    sequence.value_weights = torch.ones(replies)
    settings = UpdateSettings(cfg, kl_coef=0.0, temperature=1.0, micro_batch_tokens=micro_batch_tokens,
                              shuffle_seed=0)
    ppo_update(policy, build_optimizer(policy, cfg, 1e-4), [sequence], settings, UpdateState())
    if policy.device.type == "cuda":
        torch.cuda.synchronize(policy.device)
    return {"score_s": round(scored - started, 2), "update_s": round(time.perf_counter() - scored, 2)}


def planned_bytes(config, tokens: int, micro_batch_tokens: int, dtype_bytes: int, device: torch.device,
                  checkpointing: bool = True) -> float:
    from ppo_affine.memory_plan import RunShape, plan, probe_activations

    shape = RunShape(dtype_bytes=dtype_bytes, use_4bit=False, gradient_checkpointing=checkpointing,
                     micro_batch_tokens=micro_batch_tokens, lora_r=16, lora_targets=None, adapt_experts=False,
                     backend="local", episodes=0, context_tokens=tokens)
    per_kind = probe_activations(config, shape, device=str(device))
    return sum(t.bytes for t in plan(config, shape, 1e12, per_kind).trainer if t.name != "CUDA reserve")


def run(args) -> list[dict]:
    from ppo_affine.memory_plan import GB
    from ppo_affine.allocator import training_allocations
    from ppo_affine.phase_costs import phase_peak
    from ppo_affine.testing.live_bytes import LiveBytes

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(args.model)
    vocab = config.get_text_config().vocab_size
    checkpointing = not getattr(args, "no_checkpointing", False)
    policy = build_policy(config, device, dtype, checkpointing)
    frozen = sum(p.numel() * p.element_size() for p in policy.parameters() if not p.requires_grad)
    rows = []
    for tokens in args.tokens:
        sequence = long_episode(tokens, args.turns, vocab, torch.Generator().manual_seed(tokens))
        live = LiveBytes() if device.type != "cuda" else None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        resident: dict[str, float] = {}  # the process's resident memory: its rise over the update (CPU)
        # as the trainer runs an update: glibc's heap for the passes' buffers (allocator.py), the mark reset first
        with training_allocations(), live.mode if live is not None else contextlib.nullcontext(), \
                phase_peak(resident, "update"):
            seconds = one_update(policy, sequence, args.micro_batch_tokens)
        peak = torch.cuda.max_memory_allocated(device) if live is None else frozen + live.peak
        planned = planned_bytes(config, tokens, args.micro_batch_tokens, dtype.itemsize, device, checkpointing)
        rows.append({"model": args.model, "device": str(device), "tokens": len(sequence.input_ids),
                     "reply_tokens": sequence.response_len, "turns": args.turns, "checkpointing": checkpointing,
                     **seconds, "peak_gb": round(peak / GB, 3), "planned_gb": round(planned / GB, 3),
                     "planned_over_peak": round(planned / peak, 3),
                     **({"rss_rise_gb": round(resident["perf/update_rss_rise_bytes"] / GB, 3),
                         "weights_gb": round(frozen / GB, 3)} if resident else {})})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--device", default="cpu", help="cuda on a lent GPU (default: cpu)")
    parser.add_argument("--tokens", type=lambda text: [int(t) for t in text.split(",")], default=[2048],
                        help="episode lengths, comma-separated (default: 2048)")
    parser.add_argument("--turns", type=int, default=50, help="turns of the episode (default: 50)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="ppo.micro_batch_tokens (default: 4096)")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="without gradient checkpointing, as the cpu preset trains (default: on)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
