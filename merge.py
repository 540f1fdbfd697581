"""Merge a trained LoRA adapter into its base model's own release files: the folder a validator admits.

The output is the base's folder copied byte for byte (config.json, tokenizer, chat template, every weight file
the adapter does not touch: a vision tower and multi-token-prediction weights stay), with only the tensors the
adapter changes rewritten, under the release's own names, layout (experts one tensor each where the release
stores them so) and dtype: W + scale·B·A added in float32, stored in W's dtype (`--dtype` casts every tensor
instead). Which W: `--into full-precision` (default) adds the update to the release's weights; `--into nf4` to
the NF4-rounded weights a 4-bit run trained against (see --help for what each costs). Checks before the folder is
renamed into place: the update computed from the adapter, added to the loaded base in float32, gives base +
adapter's logits on a fixed chat prompt (max |difference| <= 1e-4 x the largest logit); the written folder,
loaded back, produces finite logits, and how far they are from base + adapter is printed (rounding to a 16-bit
dtype is a property of the dtype, not of the merge). The validators' admission check of its config.json is printed
too.

Run:  python merge.py --checkpoint runs/r/checkpoints/checkpoint-500 --output merged/r-500
      python merge.py --preset cpu --adapter path/to/adapter --output merged/smol --dtype bfloat16
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from ppo_affine.admission import folder_admission
from ppo_affine.model_files import load_adapter_model
from ppo_affine.run_log import console, report_failure, setup_logging
from ppo_affine.config import ConfigError
from utils import add_config_arguments, config_for_adapter, program_parser

log = logging.getLogger("merge")

CHECK_MESSAGES = [
    {"role": "system", "content": "You are playing leduc_poker as Player 0."},
    {"role": "user", "content": "Legal actions:\n0 -> Fold\n1 -> Call\n2 -> Raise\nReply with the action ID."},
]
MERGE_TOLERANCE = 1e-4  # float32 merge vs base + adapter, relative to the largest logit (at least 1)
DTYPES = ("bfloat16", "float16", "float32")
INTO = ("full-precision", "nf4")


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


def check_update(model, deltas: dict[str, torch.Tensor], reference: torch.Tensor, input_ids: torch.Tensor) -> float:
    """The base (adapter unloaded) with each delta added to its weight in float32 must give base + adapter's logits:
    checks the updates the folder will hold, by the names they were computed under."""
    base = model.unload()
    with torch.no_grad():
        for name, delta in deltas.items():
            base.get_parameter(name).add_(delta.to(base.get_parameter(name).device))
    return check_logits(reference, prompt_logits(base, input_ids), MERGE_TOLERANCE,
                        "base + the adapter's updates vs base + adapter")


def merge(config, adapter_dir: Path, output: Path, dtype: str | None, into: str) -> dict[str, float]:
    """Check the adapter's updates in float32, write the base's release files with them into a temporary folder,
    load it back and measure its logits; rename into place. Returns max logit differences to base + adapter."""
    from transformers import AutoModelForCausalLM

    from ppo_affine.model_files import load_dequantised_base, load_tokenizer, model_source, pick_device
    from ppo_affine.prompts import PromptBuilder
    from ppo_affine.release_files import (adapter_deltas, local_release_folder, release_deltas, release_tensor_files,
                                          replace_folder, write_merged_release)

    # float32 for the update itself: W + BA rounded to 16 bits would blur whether the merge is right
    model_cfg = config.train.model.model_copy(update={"dtype": "float32"})
    device = pick_device(config.train.run.device)
    tokenizer = load_tokenizer(model_cfg)
    input_ids = torch.tensor([PromptBuilder(tokenizer, 10**6, model_cfg.chat_template_kwargs).encode(CHECK_MESSAGES)])
    release = local_release_folder(model_source(model_cfg))
    names = set(release_tensor_files(release))
    model = load_adapter_model(load_dequantised_base(model_cfg, device), adapter_dir, model_cfg.name_or_path)
    reference = prompt_logits(model, input_ids)
    base_config = model.get_base_model().config
    deltas = adapter_deltas(model)
    rounded_bases = None
    if into == "nf4" and model_cfg.use_4bit:  # the weights the adapter learned against, as the trainer held them
        rounded_bases = release_deltas(base_config, {n: model.get_base_model().get_parameter(
            _lora_base_name(model, n)).detach().float().cpu() for n in deltas}, names)
    differences = {"merge": check_update(model, deltas, reference, input_ids)}
    del model

    staging = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_merged_release(release, release_deltas(base_config, deltas, names), staging,
                             getattr(torch, dtype) if dtype else None, rounded_bases)
        reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32).to(device)
        # what rounding the weights to the stored dtype costs, as the saved model will run
        saved_logits = prompt_logits(reloaded, input_ids)
        if not torch.isfinite(saved_logits).all():
            raise MergeCheckFailed("the saved model produces non-finite logits; merge with --dtype float32.")
        differences["saved"] = float((saved_logits - reference).abs().max())
        replace_folder(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return differences


def _lora_base_name(model, weight_name: str) -> str:
    """The name, inside the peft-wrapped base, of the frozen weight an adapter delta applies to."""
    module_name, _, parameter = weight_name.rpartition(".")
    module = model.get_base_model().get_submodule(module_name)
    while hasattr(module, "base_layer"):
        module_name, module = f"{module_name}.base_layer", module.base_layer
    return f"{module_name}.{parameter}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = program_parser(__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="checkpoint folder (<run>/checkpoints/checkpoint-N)")
    source.add_argument("--adapter", type=Path, help="a peft adapter folder (holds adapter_config.json)")
    parser.add_argument("--output", type=Path, required=True, help="new folder for the merged model")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="cast every tensor to this dtype (rewrites every weight file; default: none, each tensor "
                             "keeps the base's own dtype and untouched files stay byte-equal, as validators expect)")
    parser.add_argument("--into", choices=INTO, default="full-precision",
                        help="which base weights the update is added to (default: full-precision, the release's own "
                             "weights). nf4 (4-bit runs only): the NF4-rounded weights the adapter trained against, "
                             "which gives the trained model's exact logits in float32 but keeps NF4's rounding in the "
                             "adapted tensors; see docs/evaluate.md for the measured logit gaps of both")
    add_config_arguments(parser, set_example="model.name_or_path=...")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        config, adapter_dir = config_for_adapter(args, args.checkpoint or args.adapter,
                                                 flags=["model.gradient_checkpointing=false"])
        if args.into == "nf4" and not config.train.model.use_4bit:
            raise ConfigError("--into nf4: the adapter was trained on a 16/32-bit base (model.use_4bit false); "
                              "there is no NF4 rounding to merge into.")
        if args.output.exists() and (not args.output.is_dir() or any(args.output.iterdir())):
            raise ConfigError(f"--output {args.output} already exists and is not an empty folder; "
                              "choose a new folder so no earlier model is overwritten.")
        args.output.parent.mkdir(parents=True, exist_ok=True)
        differences = merge(config, adapter_dir, args.output, args.dtype, args.into)
    except ConfigError as exc:
        return report_failure("Error", exc, 2)
    except MergeCheckFailed as exc:
        return report_failure("Merge check failed", exc, 1)
    stored = args.dtype or "the base's dtypes"
    console.print(f"merged {adapter_dir} into {config.train.model.name_or_path} ({args.into}) -> {args.output} "
                  f"({stored}). Max logit difference to base + adapter on the check prompt: {differences['merge']:.1e} "
                  f"with the updates in float32, {differences['saved']:.1e} as saved.", highlight=False, soft_wrap=True)
    admitted, reasons = folder_admission(args.output)
    console.print(f"validators' admission check: {'admitted as ' + admitted if admitted else 'not admitted: ' + '; '.join(reasons)}",
                  highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
