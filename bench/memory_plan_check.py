"""The memory plan's trainer terms against what one training pass really holds on the CPU, for random models of
three sizes and the admitted architectures' layer kinds.

Each case runs in its own process (so its peak is its own): the model is built from a config with random weights
as the trainer loads it (LoRA on the architecture's default targets), one micro-batch of `--tokens` tokens runs
forward and backward and AdamW steps once. Measured: the process's peak resident memory above what the same
process held before the model was built (`VmHWM`), and torch's own bytes per term (weights, adapter + AdamW state,
the tensors autograd saved). Predicted: `ppo_affine/memory_plan.py`'s weights, adapter + AdamW, activations and
logits (no CUDA reserve, no generation caches: the pass generates nothing). The CPU peak checks the arithmetic, not
the CUDA allocator.

    python -m bench.memory_plan_check                  # 3 sizes x (qwen3, qwen3_5_moe_text), 2048 tokens
    python -m bench.memory_plan_check --tokens 4096 --cases qwen3-m
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from ppo_affine.testing.live_bytes import LiveBytes

CASES = {  # name: (model type, fields)
    "qwen3-s": ("qwen3", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=64, vocab_size=32000)),
    "qwen3-m": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                              num_key_value_heads=4, head_dim=64, vocab_size=32000)),
    "qwen3-l": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
                              num_key_value_heads=4, head_dim=128, vocab_size=32000)),
    "qwen3_5_moe-s": ("qwen3_5_moe_text", dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
        vocab_size=32000, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)),
}


def measure(name: str, tokens: int, checkpointing: bool) -> dict:
    """Run in a child process: build, one pass, and every number of the row."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ppo_affine.memory_plan import RunShape, plan
    from ppo_affine.policy import Policy, resolve_lora_targets
    from ppo_affine.architectures import default_lora_targets

    model_type, fields = CASES[name]
    config = AutoConfig.for_model(model_type, **fields)
    shape = RunShape(dtype_bytes=4, use_4bit=False, gradient_checkpointing=checkpointing, micro_batch_tokens=tokens,
                     lora_r=16, lora_targets=None, adapt_experts=False, backend="local", episodes=0,
                     context_tokens=0)
    predicted = {t.name: t.bytes for t in plan(config, shape, 1e12).trainer}

    def high_water() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    before = high_water()
    torch.manual_seed(0)
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=resolve_lora_targets(
        base, default_lora_targets(config), explicit=False)))
    policy = Policy(model, tokenizer=None)
    optimizer = torch.optim.AdamW(policy.adapter_parameters(), lr=1e-4)
    saved: dict[int, int] = {}

    def keep(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    ids = torch.randint(0, config.vocab_size, (1, tokens))
    response = torch.ones_like(ids)
    policy.train()
    live = LiveBytes()
    with live.mode:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            scored = policy.score(ids, None, response, with_values=False)
        weights = {p.untyped_storage().data_ptr() for p in policy.parameters()}
        saved_bytes = sum(size for pointer, size in saved.items() if pointer not in weights)
        scored.logprobs.sum().backward()
        optimizer.step()
    peak = high_water() - before
    trainable = [p for p in policy.adapter_parameters()]
    adapter = sum(p.numel() * 4 * 4 for p in trainable)  # weight, grad, two moments, float32
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    measured_total = weight_bytes + adapter + saved_bytes
    predicted_total = sum(v for k, v in predicted.items() if k != "CUDA reserve")
    return {"case": name, "tokens": tokens, "checkpointing": checkpointing,
            "weights_gb": [round(predicted["weights"] / 1e9, 3), round(weight_bytes / 1e9, 3)],
            "adapter_adamw_gb": [round(predicted["adapter + AdamW"] / 1e9, 4), round(adapter / 1e9, 4)],
            "activations_gb": [round(predicted["activations"] / 1e9, 3), round(saved_bytes / 1e9, 3)],
            "logits_gb": round(predicted["logits"] / 1e9, 3),
            "predicted_total_gb": round(predicted_total / 1e9, 3),
            "torch_terms_gb": round(measured_total / 1e9, 3), "peak_rss_above_start_gb": round(peak / 1e9, 3),
            "peak_torch_gb": round((weight_bytes + live.peak) / 1e9, 3),
            "predicted_over_peak_torch": round(predicted_total / (weight_bytes + live.peak), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"from {sorted(CASES)}")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the micro-batch")
    parser.add_argument("--checkpointing", action="store_true", help="with gradient checkpointing")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tokens, args.checkpointing)))
        return
    for name in args.cases.split(","):
        command = [sys.executable, "-m", "bench.memory_plan_check", "--child", name, "--tokens", str(args.tokens)]
        command += ["--checkpointing"] if args.checkpointing else []
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        print(result.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
