"""A release too large to merge by loading it: a Llama in bfloat16 cut into one shard a layer, written tensor by tensor,
with a random adapter built on the meta device, and the merge's peak memory measured in a fresh process."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
BIG_SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 16,
             "vocab_size": 1024}  # ~103 MB of bfloat16 a layer


def write_sharded_release(folder: Path, layers: int) -> Path:
    """A Llama release of `layers` layers in bfloat16, one shard a layer (the embeddings and head in the first and
    last), written tensor by tensor so the test itself never holds the model."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder.mkdir(parents=True)
    LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, **BIG_SHAPE).save_pretrained(folder)
    hidden, width, vocab = BIG_SHAPE["hidden_size"], BIG_SHAPE["intermediate_size"], BIG_SHAPE["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for layer in range(layers):
        shapes = {f"self_attn.{p}_proj.weight": (hidden, hidden) for p in "qkvo"}
        shapes.update({"mlp.gate_proj.weight": (width, hidden), "mlp.up_proj.weight": (width, hidden),
                       "mlp.down_proj.weight": (hidden, width), "input_layernorm.weight": (hidden,),
                       "post_attention_layernorm.weight": (hidden,)})
        tensors = {f"model.layers.{layer}.{name}": torch.randn(shape, generator=generator).mul_(0.02).bfloat16()
                   for name, shape in shapes.items()}
        if layer == 0:
            tensors["model.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=generator).bfloat16()
        if layer == layers - 1:
            tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
            tensors["lm_head.weight"] = torch.randn(vocab, hidden, generator=generator).bfloat16()
        file = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def write_random_adapter(base: Path, folder: Path, r: int = 8, alpha: int = 16) -> Path:
    """A peft adapter on every attention and MLP projection of `base` with random A and B (B ~ N(0, 0.01)), built
    on the meta device: the base's weights are never loaded."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    config = PeftLoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(skeleton, config)
    generator = torch.Generator().manual_seed(1)
    factors = {name.replace(".default.", "."): torch.randn(p.shape, generator=generator) * (0.01 if "lora_B" in name
                                                                                          else 0.02)
               for name, p in peft_model.named_parameters() if ".lora_" in name}
    folder.mkdir(parents=True)
    config.base_model_name_or_path = str(base)
    config.save_pretrained(folder)
    save_file(factors, str(folder / "adapter_model.safetensors"))
    return folder


def merge_peak(base: Path, adapter: Path, output: Path) -> tuple[int, float, str]:
    """merge.py of `adapter` into `base` in a fresh process: its peak resident memory in bytes (the kernel's
    high-water mark), its wall seconds and what it printed (with `imports_kb`, the peak after the libraries' import
    alone); a RuntimeError with its stderr when it fails."""
    # the libraries' own import is printed apart (imports_kb): a fixed cost of the interpreter, not of the merge
    program = ("import resource, sys, merge, torch, transformers, peft, safetensors; "
               "print('imports_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); code = merge.main(sys.argv[1:]); "
               "print('peak_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", program, "--adapter", str(adapter), "--output", str(output),
                           "--set", f"model.name_or_path={base}", "--set", "model.use_4bit=false",
                           "--set", "run.device=cpu"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"merge.py failed: {done.stderr[-2000:]}")
    return int(done.stdout.split("peak_kb")[-1].split()[0]) * 1024, time.perf_counter() - start, done.stdout
