"""Merge a trained LoRA adapter into its base model's own release files: the folder a validator admits.

The output is the base's folder copied byte for byte (config.json, tokenizer, chat template, every weight file
the adapter does not touch: a vision tower and multi-token-prediction weights stay), with only the tensors the
adapter changes rewritten, under the release's own names, layout (experts one tensor each where the release
stores them so) and dtype: W + scale·B·A added in float32, stored in W's dtype (`--dtype` casts every tensor
instead). Which W: after a 4-bit run the NF4-rounded weights the adapter trained against (`--into nf4`, the
default there), else the release's own (`--into full-precision`); --help gives the measurement that chose this.
It streams, so it runs at the size it exists for (Qwen3.6's 69 GB on a host with a few GB free): the base model
is never loaded, each update is built from the adapter's factors when its tensor is reached, and the release is
rewritten one shard at a time (read, merge, write, free). Peak memory: the largest shard + the adapter + the
interpreter. Checks, before the folder is renamed into place: each merged tensor, in float32, gives on random
inputs what W with the adapter gives (max |difference| <= 1e-4 of its outputs), and each written shard, read
back, holds exactly the merged tensors, all finite. The validators' admission check of its config.json is
printed too.

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
from ppo_affine.config import ConfigError
from ppo_affine.file_writes import WriteFailed, apply_umask, probe_writable, writing
from ppo_affine.release_files import MergeCheckFailed, MergeReport
from ppo_affine.run_log import console, report_failure, setup_logging
from utils import add_config_arguments, config_for_adapter, program_parser

log = logging.getLogger("merge")

DTYPES = ("bfloat16", "float16", "float32")
INTO = ("auto", "full-precision", "nf4")


def merge(config, adapter_dir: Path, output: Path, dtype: str | None, into: str) -> MergeReport:
    """Stream the base's release files into a temporary folder with the adapter's updates merged shard by shard
    (each tensor checked as it is merged and as written), then rename it into place. The base model is never
    loaded: its skeleton on the meta device gives peft the adapter's layers."""
    from ppo_affine.model_files import model_source, pick_device, torch_dtype
    from ppo_affine.release_files import (adapted_layers, adapter_on_skeleton, local_release_folder, nf4_rounding,
                                          release_tensor_files, release_updates, replace_folder, write_merged_release)

    model_cfg = config.train.model
    source = model_source(model_cfg)
    release = local_release_folder(source)
    peft_model = adapter_on_skeleton(source, adapter_dir, model_cfg.name_or_path, model_cfg.trust_remote_code)
    updates = release_updates(peft_model.get_base_model().config, adapted_layers(peft_model),
                              set(release_tensor_files(release)))
    rounding = None
    if into == "nf4" and model_cfg.use_4bit:  # the weights the adapter learned against, as the trainer held them
        rounding = nf4_rounding(torch_dtype(model_cfg.dtype, pick_device(config.train.run.device)))

    staging = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with writing("the merged model", staging):
            report = write_merged_release(release, updates, staging, getattr(torch, dtype) if dtype else None,
                                          rounding)
            apply_umask(staging)  # safetensors writes the weights 0600
        with writing("the merged model", output):
            replace_folder(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report


KEPT_GOAL = 0.9  # the share of each update the stored weights should keep


def report_kept(report: MergeReport, stored: str) -> None:
    """How much of each update survived rounding to the stored dtype (a small update under half a bf16 step is
    rounded away), weighed over uncorrelated inputs; a warning when a tensor keeps under KEPT_GOAL of it."""
    if not report.kept:
        return
    shares = sorted(report.kept.values())
    median = shares[len(shares) // 2]
    console.print(f"stored in {stored}, the tensors keep a median {median:.1%} (least {shares[0]:.1%}) of their "
                  "update (rounded to nearest; over uncorrelated inputs)", highlight=False, soft_wrap=True)
    below = [name for name, share in report.kept.items() if share < KEPT_GOAL]
    if below:
        log.warning("%d of %d merged tensors keep under %.0f%% of their update in %s (e.g. %s: %.1f%%): rounding to "
                    "the stored dtype loses a small update; docs/architectures.md has the measurement", len(below),
                    len(shares), 100 * KEPT_GOAL, stored, below[0], 100 * report.kept[below[0]])


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
        report = merge(config, adapter_dir, args.output, args.dtype, into)
    except ConfigError as exc:
        return report_failure("Error", exc, 2)
    except WriteFailed as exc:
        return report_failure("Stopped", exc, 1)
    except MergeCheckFailed as exc:
        return report_failure("Merge check failed", exc, 1)
    stored = args.dtype or "the base's dtypes"
    console.print(f"merged {adapter_dir} into {config.train.model.name_or_path} ({into}) -> {args.output} "
                  f"({stored}): {report.tensors} tensors in {len(report.files)} files rewritten; each within "
                  f"{report.worst:.1e} of base + adapter (float32, largest output difference relative to the largest "
                  "output), and written as merged.", highlight=False, soft_wrap=True)
    report_kept(report, stored)
    admitted, reasons = folder_admission(args.output)
    console.print(f"validators' admission check: {'admitted as ' + admitted if admitted else 'not admitted: ' + '; '.join(reasons)}",
                  highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
