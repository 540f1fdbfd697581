"""After a 4-bit run, which base should the adapter be merged into? The logit gap of each merge to the model the run
trained (the NF4-rounded base + adapter), on a fixed chat prompt (the one merge.py once checked with), side by side.

For each base: an adapter whose B matrices are drawn at a scale (`--scales`: trained adapters' deltas are small),
merged by merge.py's own code `--into full-precision` (the release's weights + update) and `--into nf4` (the
NF4-rounded weights + update), each stored in float32 (so the gap is the merge target's, not a 16-bit dtype's) and
as the base stores it. The base's own gap (no adapter: the release against its NF4 rounding) is printed beside
them for scale.

    python -m bench.merge_gap                          # tiny qwen3 and qwen3_5_moe, and SmolLM2 when installed
    python -m bench.merge_gap --models smollm2 --scales 0.001,0.01
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import merge
from ppo_affine.config import LoraConfig, load_config
from ppo_affine.model_files import load_adapter_model, load_dequantised_base, load_tokenizer, pick_device
from ppo_affine.policy import load_policy
from ppo_affine.prompts import PromptBuilder
from ppo_affine.testing.tiny import activate_adapter, make_tiny_architecture_dir

TINY = ("qwen3", "qwen3_5_moe")
CHECK_MESSAGES = [
    {"role": "system", "content": "You are playing leduc_poker as Player 0."},
    {"role": "user", "content": "Legal actions:\n0 -> Fold\n1 -> Call\n2 -> Raise\nReply with the action ID."},
]


@torch.no_grad()
def prompt_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[T, V] float32 logits of one prompt."""
    return model.eval()(input_ids=input_ids.to(model.device)).logits[0].float().cpu()


def model_sets(name: str, work: Path) -> list[str]:
    if name == "smollm2":
        return []  # the cpu preset's packaged GGUF
    folder = make_tiny_architecture_dir(work / name, name)
    return [f"model.name_or_path={folder}", "model.gguf_package=null"]


def gaps(name: str, scale: float, work: Path) -> dict:
    config = load_config(presets=["cpu"], overrides=[*model_sets(name, work), "model.use_4bit=true",
                                                      "model.dtype=float32", "run.device=cpu"])
    model_cfg = config.train.model
    torch.manual_seed(0)
    policy = load_policy(model_cfg, LoraConfig(), pick_device("cpu"))
    activate_adapter(policy.model, scale)
    checkpoint = work / f"{name}-{scale}"
    policy.save(checkpoint)
    del policy
    row = {"model": name, "b_scale": scale}
    ids = check_prompt(model_cfg)
    trained = prompt_logits(load_adapter_model(load_dequantised_base(model_cfg, pick_device("cpu")),
                                               checkpoint / "adapter", name), ids)
    for into in ("full-precision", "nf4"):
        for dtype in ("float32", None):
            output = work / f"{name}-{scale}-{into}-{dtype}"
            merge.merge(config, checkpoint / "adapter", output, dtype, into)
            merged = prompt_logits(AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32), ids)
            row[f"{into}/{dtype or 'stored'}"] = float((merged - trained).abs().max())
    row["base_vs_nf4_base"] = base_gap(config)
    return row


def check_prompt(model_cfg) -> torch.Tensor:
    return torch.tensor([PromptBuilder(load_tokenizer(model_cfg), 10**6).encode(CHECK_MESSAGES)])


def base_gap(config) -> float:
    """The release's logits against its NF4 rounding's, no adapter: what quantisation alone moves."""
    from ppo_affine.model_files import model_source

    model_cfg = config.train.model
    ids = check_prompt(model_cfg)
    rounded = prompt_logits(load_dequantised_base(model_cfg, pick_device("cpu")), ids)
    full = prompt_logits(AutoModelForCausalLM.from_pretrained(model_source(model_cfg), dtype=torch.float32), ids)
    return float((rounded - full).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(TINY + ("smollm2",)), help="tiny architectures and/or smollm2")
    parser.add_argument("--scales", default="0.001,0.01", help="std of the adapter's B entries")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            for scale in (float(s) for s in args.scales.split(",")):
                rows.append(gaps(name, scale, Path(work)))
                print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
