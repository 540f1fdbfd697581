"""Merge a trained LoRA adapter into its base model and save a standard Hugging Face model folder.

The base is loaded from the config's model section in float32 and the merge is done there; only
the result is cast to `--dtype` (default: model.dtype). With model.use_4bit the base is quantised
to NF4 as the trainer quantised it and dequantised to float32: those are the weights the adapter
learned against (merging into the quantised weights would round the update away), so pass the
training run's config. Two checks must pass before anything is reported as merged: on a fixed
chat prompt the merged float32 logits match base + adapter (max |difference| <= 1e-4 x the
largest logit), and the saved folder, loaded back with `from_pretrained`, holds bit-identical
weights. How far rounding to a 16-bit dtype moves the logits is measured and printed, not judged:
it is a property of the dtype, not of the merge. The folder is written beside the target and
renamed into place only after both checks.

Run:  python merge.py --checkpoint runs/r/checkpoints/checkpoint-500 --output merged/r-500 --dtype bfloat16
      python merge.py --preset cpu --adapter path/to/adapter --output merged/smol
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from ppo_affine.model_files import load_adapter_model
from ppo_affine.run_log import console, report_failure, setup_logging
from ppo_affine.config import ConfigError
from ppo_affine.file_writes import WriteFailed, apply_umask, probe_writable, writing
from utils import add_config_arguments, config_for_adapter, program_parser

log = logging.getLogger("merge")

CHECK_MESSAGES = [
    {"role": "system", "content": "You are playing leduc_poker as Player 0."},
    {"role": "user", "content": "Legal actions:\n0 -> Fold\n1 -> Call\n2 -> Raise\nReply with the action ID."},
]
MERGE_TOLERANCE = 1e-4  # float32 merge vs base + adapter, relative to the largest logit (at least 1)
DTYPES = ("bfloat16", "float16", "float32")


class MergeCheckFailed(RuntimeError):
    """The merged model's logits differ from base + adapter (or the saved copy from the merged one)."""


@torch.no_grad()
def prompt_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[T, V] float32 logits of one prompt."""
    model.eval()
    return model(input_ids=input_ids.to(model.device)).logits[0].float().cpu()


def check_logits(reference: torch.Tensor, candidate: torch.Tensor, tolerance: float, what: str) -> float:
    """Max absolute logit difference; raises MergeCheckFailed past `tolerance` x max(1, max |logit|)."""
    difference = float((reference - candidate).abs().max())
    allowed = tolerance * max(1.0, float(reference.abs().max()))
    if not difference <= allowed:  # also catches NaN
        raise MergeCheckFailed(
            f"{what}: logits differ by up to {difference:.3g} (allowed {allowed:.3g}) on a fixed prompt. "
            "Nothing was saved. Check that the configured base model is the one the adapter was trained on."
        )
    return difference


def check_saved_weights(expected: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    """The folder loaded back must hold exactly the merged tensors (same names, bit-identical values)."""
    unmatched = sorted(set(expected) ^ set(saved))
    changed = [name for name in expected if name in saved and not torch.equal(expected[name].cpu(), saved[name].cpu())]
    if unmatched or changed:
        raise MergeCheckFailed(
            f"the saved folder, loaded back with from_pretrained, does not hold the merged weights (tensors "
            f"missing or extra: {unmatched[:5]}, changed: {changed[:5]}). Nothing was saved."
        )


def merge(config, adapter_dir: Path, output: Path, dtype: str) -> dict[str, float]:
    """Merge in float32 and check against base + adapter; cast to `dtype`, save to a temporary folder,
    load it back and check its weights; rename into place. Returns max logit differences to base + adapter."""
    from transformers import AutoModelForCausalLM

    from ppo_affine.model_files import load_dequantised_base, load_tokenizer, pick_device
    from ppo_affine.prompts import PromptBuilder

    # float32 for the merge itself: W + BA rounded to 16 bits would blur whether the merge is right
    model_cfg = config.train.model.model_copy(update={"dtype": "float32"})
    device = pick_device(config.train.run.device)
    tokenizer = load_tokenizer(model_cfg)
    input_ids = torch.tensor([PromptBuilder(tokenizer, 10**6, model_cfg.chat_template_kwargs).encode(CHECK_MESSAGES)])
    model = load_adapter_model(load_dequantised_base(model_cfg, device), adapter_dir, model_cfg.name_or_path)
    reference = prompt_logits(model, input_ids)
    merged = model.merge_and_unload()
    differences = {"merge": check_logits(reference, prompt_logits(merged, input_ids), MERGE_TOLERANCE,
                                         "merged model vs base + adapter")}
    merged = merged.to(getattr(torch, dtype))

    staging = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with writing("the merged model", staging):
            merged.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            apply_umask(staging)  # safetensors writes the weights 0600
        reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=getattr(torch, dtype)).to(device)
        check_saved_weights(merged.state_dict(), reloaded.state_dict())
        del merged, model
        # what rounding the weights to `dtype` costs, as the saved model will run
        saved_logits = prompt_logits(reloaded, input_ids)
        if not torch.isfinite(saved_logits).all():
            raise MergeCheckFailed(f"the saved model produces non-finite logits in {dtype}; merge in float32.")
        differences["saved"] = float((saved_logits - reference).abs().max())
        with writing("the merged model", output):
            if output.exists():
                output.rmdir()  # only an empty folder gets here (checked before loading anything)
            os.replace(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return differences


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = program_parser(__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="checkpoint folder (<run>/checkpoints/checkpoint-N) (this or "
                        "--adapter is required)")
    source.add_argument("--adapter", type=Path, help="a peft adapter folder (holds adapter_config.json) (this or "
                        "--checkpoint is required)")
    parser.add_argument("--output", type=Path, required=True, help="new folder for the merged model")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="weights dtype of the merged model (default: model.dtype, float32 when 'auto')")
    add_config_arguments(parser, set_example="model.name_or_path=...")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        # the adapter and the configuration are all merge reads of a checkpoint (a bad trainer state only warns)
        config, adapter_dir = config_for_adapter(args, args.checkpoint or args.adapter,
                                                 flags=["model.gradient_checkpointing=false"], adapter_only=True)
        dtype = args.dtype or (config.train.model.dtype if config.train.model.dtype != "auto" else "float32")
        if args.output.exists() and (not args.output.is_dir() or any(args.output.iterdir())):
            raise ConfigError(f"--output {args.output} already exists and is not an empty folder; "
                              "choose a new folder so no earlier model is overwritten.")
        probe_writable(args.output.parent, "--output's folder")  # before any model loads
        differences = merge(config, adapter_dir, args.output, dtype)
    except ConfigError as exc:
        return report_failure("Error", exc, 2)
    except WriteFailed as exc:
        return report_failure("Stopped", exc, 1)
    except MergeCheckFailed as exc:
        return report_failure("Merge check failed", exc, 1)
    console.print(f"merged {adapter_dir} into {config.train.model.name_or_path} -> {args.output} ({dtype}). "
                  f"Max logit difference to base + adapter on the check prompt: {differences['merge']:.1e} merged in "
                  f"float32, {differences['saved']:.1e} as saved in {dtype}; saved weights verified.",
                  highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
