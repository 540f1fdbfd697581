"""One PPO step of a model built from its config with random weights, straight into memory: no weights on disk (a
32–35 B model in bf16 fits neither a lent GPU machine's disk nor one of its calls), so a lent GPU can measure the
admitted models at their real size. Prints one JSON line: the step's time and phases and the peak memory beside
the memory plan's prediction for the same settings.

The trainer loads its model through `from_pretrained`; here that call is answered with the random model (built on the
run's device in model.dtype; with `--4bit` each nn.Linear but lm_head is then replaced by an NF4 one, as
bitsandbytes' loader would), so everything after it is the trainer's own path: LoRA, local generation, scoring, the
update. The tokenizer is the tiny test tokenizer (its ids lie inside any vocabulary); the game is Leduc poker against
a random opponent.

    python -m bench.random_model_step --model qwen3-32b --4bit --device cuda        # on a lent GPU
    python -m bench.random_model_step --model qwen3.6-35b-a3b --device cuda
    python -m bench.random_model_step --model tiny-qwen3_5_moe                       # any machine, seconds
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import train_ppo
from ppo_affine.testing.tiny import TINY_ARCHITECTURES, make_tokenizer, tiny_architecture_config

FULL = {
    "qwen3-32b": ("qwen3", dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=25600, vocab_size=151936,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                                max_position_embeddings=40960)),
    "qwen3.6-35b-a3b": ("qwen3_5_moe", {}),  # transformers' defaults are the release's sizes
    # the cpu preset's model (its config.json), for the CPU rows of bench/long_update.py
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                                   tie_word_embeddings=True, max_position_embeddings=8192)),
}
MODELS = sorted(FULL) + [f"tiny-{name}" for name in TINY_ARCHITECTURES]


def model_config(name: str):
    from transformers import AutoConfig

    if name.startswith("tiny-"):
        tokenizer = make_tokenizer()
        return tiny_architecture_config(name.removeprefix("tiny-"), len(tokenizer), tokenizer.pad_token_id,
                                        tokenizer.eos_token_id)
    model_type, fields = FULL[name]
    return AutoConfig.for_model(model_type, **fields)


def quantise_linears(model, compute_dtype: torch.dtype) -> None:
    """Every nn.Linear but lm_head as bitsandbytes' NF4 layer (double-quantised scales), as its loader leaves them."""
    import bitsandbytes as bnb

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, torch.nn.Linear) or child_name == "lm_head":
                continue
            quantised = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=True,
                                          device="meta")
            device = child.weight.device
            quantised.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True).to(device)
            if child.bias is not None:
                quantised.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, child_name, quantised)
            del child
    model.is_loaded_in_4bit = True


def random_model_loader(config, device: torch.device, use_4bit: bool):
    """A stand-in for `AutoModelForCausalLM.from_pretrained` answering with `config`'s model, random weights."""
    from transformers import AutoModelForCausalLM

    def load(path, dtype=None, quantization_config=None, device_map=None, **kwargs):
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if use_4bit:
            quantise_linears(model, dtype)
        return model

    return load


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from ppo_affine.memory_plan import GB, RunShape, plan
    from ppo_affine.config import load_config

    device = torch.device(args.device)
    config = model_config(args.model)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    sets = {"model.gguf_package": "null", "model.use_4bit": str(args.use_4bit).lower(), "model.dtype": dtype,
            "model.gradient_checkpointing": "true", "run.device": args.device, "generation.backend": "local",
            "generation.max_new_tokens": str(args.max_new_tokens), "ppo.batch_size": str(args.episodes),
            "generation.max_concurrent_episodes": str(args.episodes), "ppo.micro_batch_tokens": str(args.micro_batch_tokens),
            "ppo.ppo_epochs": "1", "checkpointing.save_every": "1000"}
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "model"
        folder.mkdir()
        config.save_pretrained(folder)
        make_tokenizer().save_pretrained(folder)
        sets["model.name_or_path"] = str(folder)
        original = AutoModelForCausalLM.from_pretrained
        AutoModelForCausalLM.from_pretrained = random_model_loader(config, device, args.use_4bit)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        try:
            argv = ["--preset", "cpu", "--output-dir", str(Path(work) / "runs"), "--max-steps", "1"]
            code = train_ppo.main(argv + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
        finally:
            AutoModelForCausalLM.from_pretrained = original
        wall = time.perf_counter() - started
        metrics = [json.loads(line) for line in next(Path(work).glob("runs/*/metrics.jsonl")).read_text().splitlines()]
    train = load_config(presets=["cpu"], overrides=[f"{k}={v}" for k, v in sets.items()]).train
    predicted = plan(config, RunShape.of(train, gpu=device.type == "cuda"), 1e12)
    peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None  # CPU: no allocator count
    step = metrics[-1]
    return {"model": args.model, "device": args.device, "use_4bit": args.use_4bit, "exit_code": code,
            "wall_s": round(wall, 1), "step_s": step.get("perf/step_seconds"),
            "rollout_s": step.get("perf/rollout_seconds"), "update_s": step.get("perf/update_seconds"),
            "generated_tokens_per_s": step.get("perf/tokens_per_s"),
            "peak_gb": round(peak, 2) if peak is not None else None,
            "planned_trainer_gb": round(predicted.trainer_bytes / GB, 2),
            "planned_terms_gb": {t.name: round(t.bytes / GB, 3) for t in predicted.trainer}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--4bit", dest="use_4bit", action="store_true", help="NF4 linear layers, as model.use_4bit")
    parser.add_argument("--device", default="cpu", help="cuda on a lent GPU (default: cpu)")
    parser.add_argument("--episodes", type=int, default=4, help="episodes of the step (default: 4)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="reply length (default: 16)")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024, help="ppo.micro_batch_tokens (default: 1024)")
    print(json.dumps(run(parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()
