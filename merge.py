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

Storing in bf16 rounds away most of a small update when rounded to nearest, so by default (`--rounding`) each merged
tensor is rounded by error feedback on the bf16 grid, weighted by its layer's input second moments on the run's own
recorded episodes (samples.jsonl of the checkpoint's run folder, or --episodes): half of them calibrate, the other
half judge, and merge.py prints the share of each layer's update it keeps on the judged episodes' inputs (the
layers keeping least named) and warns below 90 %. Collecting the moments runs the adapter on its base, loaded in
bf16 on run.device, over at most --calibration-tokens tokens of each half, and holds one [in, in] float32 sum per
distinct adapted input (per routed expert with lora.adapt_experts) for each half; it is refused before anything
loads where that would not fit in half the free memory.

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
from ppo_affine.calibration import CALIBRATION_TOKENS
from ppo_affine.config import ConfigError
from ppo_affine.file_writes import WriteFailed, apply_umask, probe_writable, writing
from ppo_affine.release_files import MergeCheckFailed, MergeReport, Storing
from ppo_affine.rounding import ROUNDINGS
from ppo_affine.run_log import console, report_failure, setup_logging
from utils import add_config_arguments, config_for_adapter, program_parser

log = logging.getLogger("merge")

DTYPES = ("bfloat16", "float16", "float32")
INTO = ("auto", "full-precision", "nf4")


def merge(config, adapter_dir: Path, output: Path, dtype: str | None, into: str,
          storing: Storing | None = None) -> MergeReport:
    """Stream the base's release files into a temporary folder with the adapter's updates merged shard by shard
    (each tensor checked as it is merged and as written, rounded to its stored dtype as `storing` says), then
    rename it into place. The base model is never loaded: its skeleton on the meta device gives peft the adapter's
    layers."""
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
                                          rounding, storing)
            apply_umask(staging)  # safetensors writes the weights 0600
        with writing("the merged model", output):
            replace_folder(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report


KEPT_GOAL = 0.9  # the share of each update the stored weights should keep
WORST_NAMED = 3  # the layers keeping least, named


def storing_for(args, config, adapter_dir: Path) -> Storing:
    """How to round: `--rounding`, by default error feedback on the run's recorded episodes where there are some
    (--episodes, else the checkpoint's run folder), else round-to-nearest; the calibration moments computed here
    (error feedback needs them; every method is then judged on the held-out episodes' inputs)."""
    from ppo_affine.calibration import calibrate, episodes_file
    from ppo_affine.model_files import pick_device

    episodes = args.episodes
    if episodes is None and args.checkpoint is not None:
        episodes = args.checkpoint.parent.parent  # <run>/checkpoints/checkpoint-N
    method = args.rounding
    if method is None:
        method = "error-feedback" if episodes is not None and episodes_file(episodes).is_file() else "nearest"
        if method == "nearest":
            console.print("rounding to nearest: no recorded episodes to calibrate error feedback with (pass "
                          "--episodes RUN_FOLDER; a run records them with logging.log_samples_every=N)",
                          highlight=False, soft_wrap=True)
    if method != "error-feedback" and args.episodes is None:
        return Storing(method)
    if episodes is None:
        raise ConfigError("--rounding error-feedback needs the run's recorded episodes: pass --episodes RUN_FOLDER "
                          "(or its samples.jsonl).")
    found = calibrate(config.train.model, adapter_dir, episodes, pick_device(config.train.run.device),
                      args.calibration_tokens)
    console.print(f"calibration: {found.calibration_tokens} tokens of {found.episodes[0]} recorded episodes; judged "
                  f"on {found.held_out_tokens} tokens of {found.episodes[1]} others ({episodes_file(episodes)})",
                  highlight=False, soft_wrap=True)
    return Storing(method, found.moments, found.held_out)


def report_kept(report: MergeReport, stored: str, storing: Storing) -> None:
    """How much of each update survived rounding to the stored dtype (a small update under half a bf16 step is
    rounded away by rounding to nearest), on the held-out episodes' inputs where there are some, else over
    uncorrelated inputs; the layers keeping least named, and a warning when one keeps under KEPT_GOAL of it."""
    if not report.kept:
        return
    shares = sorted(report.kept.values())
    median = shares[len(shares) // 2]
    judged = "on the held-out episodes' inputs" if storing.held_out else "over uncorrelated inputs"
    worst = sorted(report.kept, key=report.kept.get)[:WORST_NAMED]
    console.print(f"stored in {stored} ({storing.method}), the layers keep a median {median:.1%} (least "
                  f"{shares[0]:.1%}) of their update's effect on their outputs, {judged}; least: "
                  + ", ".join(f"{name} {report.kept[name]:.1%}" for name in worst), highlight=False, soft_wrap=True)
    below = [name for name, share in report.kept.items() if share < KEPT_GOAL]
    if below:
        log.warning("%d of %d merged tensors keep under %.0f%% of their update in %s (%s; e.g. %s: %.1f%%): rounding "
                    "to the stored dtype loses a small update; docs/architectures.md has the measurement", len(below),
                    len(shares), 100 * KEPT_GOAL, stored, storing.method, worst[0], 100 * report.kept[worst[0]])


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
    parser.add_argument("--rounding", choices=ROUNDINGS,
                        help="how each merged tensor is rounded to its stored 16-bit dtype (default: error-feedback "
                             "when the run's recorded episodes are found, else nearest). error-feedback: each column's "
                             "rounding error pushed onto the next ones, weighted by the layer's input second moments "
                             "on the run's recorded episodes (measured best: bench/merge_rounding.py, "
                             "docs/architectures.md); stochastic: seeded, unbiased; nearest: the plain cast")
    parser.add_argument("--episodes", type=Path,
                        help="the run folder (or its samples.jsonl) whose recorded episodes calibrate error feedback "
                             "and judge every rounding, split in two that never overlap (default: the checkpoint's "
                             "run folder)")
    parser.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS,
                        help=f"tokens of recorded episodes run through the adapted model for each of calibration and "
                             f"judging, at most (default {CALIBRATION_TOKENS})")
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
        storing = storing_for(args, config, adapter_dir)
        report = merge(config, adapter_dir, args.output, args.dtype, into, storing)
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
    report_kept(report, stored, storing)
    admitted, reasons = folder_admission(args.output)
    console.print(f"validators' admission check: {'admitted as ' + admitted if admitted else 'not admitted: ' + '; '.join(reasons)}",
                  highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
