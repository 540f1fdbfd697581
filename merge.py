"""Merge a trained LoRA adapter into its base model's own release files: the folder a validator admits.

The output is the base's folder copied byte for byte (config.json, tokenizer, chat template, every weight file
the adapter does not touch: a vision tower and multi-token-prediction weights stay), with only the tensors the
adapter changes rewritten, under the release's own names, layout (experts one tensor each where the release
stores them so) and dtype: W + scale·B·A added in float32, stored in W's dtype (`--dtype` casts every tensor
instead). Which W: after a 4-bit run the NF4-rounded weights the adapter trained against (`--into nf4`, the
default there), else the release's own (`--into full-precision`); --help gives the measurement that chose this.
Checks before the folder is renamed into place: each adapted layer gives with W + update (float32) what it gives with its adapter (max
|difference| <= 1e-4 of its outputs, on random inputs); the written folder, loaded back, produces finite logits.
How far the logits on a fixed chat prompt are from base + adapter is printed, with the updates in float32 and as
saved (rounding to a 16-bit dtype is a property of the dtype, not of the merge; an MoE model is run with the
experts base + adapter chose). The validators' admission check of its config.json is printed
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
from ppo_affine.architectures import RoutingRecord
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
MERGE_TOLERANCE = 1e-4  # a layer's W + update vs its adapter, relative to its largest output (at least 1)
DTYPES = ("bfloat16", "float16", "float32")
INTO = ("auto", "full-precision", "nf4")


class MergeCheckFailed(RuntimeError):
    """The merged model's logits differ from base + adapter (or the saved copy from the merged one)."""


@torch.no_grad()
def prompt_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[T, V] float32 logits of one prompt."""
    model.eval()
    return model(input_ids=input_ids.to(model.device)).logits[0].float().cpu()


def check_update(model, deltas: dict[str, torch.Tensor]) -> float:
    """Each adapted linear layer, fed random inputs, must give with W + delta what it gives with its adapter: checks
    the updates the folder will hold, by the names they were computed under, layer by layer (a whole model's logits
    would also measure how much it amplifies float rounding, which a small random or MoE model does a lot). A fused
    expert weight's update is peft's own W + delta parametrisation, checked by the logits below. Returns the
    largest relative difference."""
    from peft.tuners.lora import LoraLayer

    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or not isinstance(module.get_base_layer(), torch.nn.Linear):
                continue
            base = module.get_base_layer()
            delta = deltas[f"{module_name.removeprefix('base_model.model.')}.weight"].to(base.weight.device)
            inputs = torch.randn(4, base.in_features, generator=generator).to(base.weight.device)
            expected = module(inputs)
            got = torch.nn.functional.linear(inputs, base.weight + delta, base.bias)
            worst = max(worst, float((got - expected).abs().max()) / max(1.0, float(expected.abs().max())))
    if not worst <= MERGE_TOLERANCE:  # also catches NaN
        raise MergeCheckFailed(f"base + the adapter's updates vs base + adapter: a layer's outputs differ by up to "
                               f"{worst:.3g} of their size (allowed {MERGE_TOLERANCE:g}). Nothing was saved. Check that "
                               "the configured base model is the one the adapter was trained on.")
    return worst


def updated_logits(model, deltas: dict[str, torch.Tensor], input_ids: torch.Tensor, routing: RoutingRecord):
    """The base (adapter unloaded) with each delta added in float32, on the check prompt, routed as base + adapter
    was (an MoE router's tie within rounding would otherwise switch experts)."""
    base = model.unload()
    with torch.no_grad():
        for name, delta in deltas.items():
            base.get_parameter(name).add_(delta.to(base.get_parameter(name).device))
    routing.replay(base)
    try:
        return prompt_logits(base, input_ids)
    finally:
        routing.close()


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
    routing = RoutingRecord().record(model)
    reference = prompt_logits(model, input_ids)
    routing.close()
    base_config = model.get_base_model().config
    deltas = adapter_deltas(model)
    rounded_bases = None
    if into == "nf4" and model_cfg.use_4bit:  # the weights the adapter learned against, as the trainer held them
        rounded_bases = release_deltas(base_config, {n: model.get_base_model().get_parameter(
            _lora_base_name(model, n)).detach().float().cpu().clone() for n in deltas}, names)
    check_update(model, deltas)
    differences = {"merge": float((updated_logits(model, deltas, input_ids, routing) - reference).abs().max())}
    del model

    staging = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with writing("the merged model", staging):
            write_merged_release(release, release_deltas(base_config, deltas, names), staging,
                                 getattr(torch, dtype) if dtype else None, rounded_bases)
            apply_umask(staging)  # safetensors writes the weights 0600
        reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32).to(device)
        # what rounding the weights to the stored dtype costs, as the saved model will run
        routing.replay(reloaded)
        saved_logits = prompt_logits(reloaded, input_ids)
        routing.close()
        if not torch.isfinite(saved_logits).all():
            raise MergeCheckFailed("the saved model produces non-finite logits; merge with --dtype float32.")
        differences["saved"] = float((saved_logits - reference).abs().max())
        with writing("the merged model", output):
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
    source.add_argument("--checkpoint", type=Path, help="checkpoint folder (<run>/checkpoints/checkpoint-N) (this or "
                        "--adapter is required)")
    source.add_argument("--adapter", type=Path, help="a peft adapter folder (holds adapter_config.json) (this or "
                        "--checkpoint is required)")
    parser.add_argument("--output", type=Path, required=True, help="new folder for the merged model")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="cast every tensor to this dtype, rewriting every weight file (default: none: each tensor "
                             "keeps the base's own dtype and untouched files stay byte-equal, as validators expect)")
    parser.add_argument("--into", choices=INTO, default="auto",
                        help="which base weights the update is added to (default: auto = nf4 after a 4-bit run, else "
                             "full-precision). nf4: the NF4-rounded weights the adapter trained against; "
                             "full-precision: the release's own. Measured after 4-bit runs (bench/merge_gap.py, "
                             "docs/architectures.md): the merged logits' gap to the trained model is 9e-5 into nf4 and "
                             "17.6 into full precision on SmolLM2, as large as NF4's own rounding of the base (17.6): "
                             "into full precision the update lands on a model it never saw")
    add_config_arguments(parser, set_example="model.name_or_path=...")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        # the adapter and the configuration are all merge reads of a checkpoint (a bad trainer state only warns)
        config, adapter_dir = config_for_adapter(args, args.checkpoint or args.adapter,
                                                 flags=["model.gradient_checkpointing=false"], adapter_only=True)
        into = args.into if args.into != "auto" else ("nf4" if config.train.model.use_4bit else "full-precision")
        if into == "nf4" and not config.train.model.use_4bit:
            raise ConfigError("--into nf4: the adapter was trained on a 16/32-bit base (model.use_4bit false); "
                              "there is no NF4 rounding to merge into.")
        if args.output.exists() and (not args.output.is_dir() or any(args.output.iterdir())):
            raise ConfigError(f"--output {args.output} already exists and is not an empty folder; "
                              "choose a new folder so no earlier model is overwritten.")
        probe_writable(args.output.parent, "--output's folder")  # before any model loads
        differences = merge(config, adapter_dir, args.output, args.dtype, into)
    except ConfigError as exc:
        return report_failure("Error", exc, 2)
    except WriteFailed as exc:
        return report_failure("Stopped", exc, 1)
    except MergeCheckFailed as exc:
        return report_failure("Merge check failed", exc, 1)
    stored = args.dtype or "the base's dtypes"
    console.print(f"merged {adapter_dir} into {config.train.model.name_or_path} ({into}) -> {args.output} "
                  f"({stored}). Max logit difference to base + adapter on the check prompt: {differences['merge']:.1e} "
                  f"with the updates in float32, {differences['saved']:.1e} as saved.", highlight=False, soft_wrap=True)
    admitted, reasons = folder_admission(args.output)
    console.print(f"validators' admission check: {'admitted as ' + admitted if admitted else 'not admitted: ' + '; '.join(reasons)}",
                  highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
