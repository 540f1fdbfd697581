"""merge.py's roundings judged on a run's own held-out episodes (`python -m bench.merge_rounding --episodes RUN`):
kept = 1 − mean KL(trained ‖ merged) / mean KL(trained ‖ base) over the sampled tokens of the held-out model
calls.

The release is the cpu preset's SmolLM2 cast to bf16 (written once in the work folder, config dtype bfloat16); the
trained model is that bf16 base with the adapter in float32; each merged folder is written by `merge.merge` itself
(streaming, `Storing` with the calibration moments `ppo_affine.calibration.calibrate` computes, as merge.py does) and
loaded in float32.
"""
from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import merge
from ppo_affine.calibration import calibrate, read_episodes, split_episodes
from ppo_affine.config import load_config
from ppo_affine.model_files import load_adapter_model, model_source
from ppo_affine.release_files import Storing
from ppo_affine import rounding
from ppo_affine.rounding import ROUNDINGS

ADAPTER_FILE = "adapter_model.safetensors"


def bf16_release(work: Path) -> Path:
    """The cpu preset's SmolLM2 folder with every weight cast to bf16 and the config saying so."""
    from safetensors.torch import load_file, save_file

    source = Path(model_source(load_config(presets=["cpu"]).train.model))
    folder = work / "smollm2-bf16"
    shutil.copytree(source, folder)
    weights = {name: tensor.bfloat16() for name, tensor in load_file(str(source / "model.safetensors")).items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def random_adapter(adapter: Path, release: Path, relative: float, work: Path) -> Path:
    """A copy of `adapter` whose factors are random, scaled so that each layer's update scale·B·A has `relative` of
    its weight's RMS (rank and targets as the checkpoint's)."""
    from safetensors.torch import load_file, save_file

    folder = work / f"random-{relative:g}"
    shutil.copytree(adapter, folder)
    settings = json.loads((adapter / "adapter_config.json").read_text())
    scale = settings["lora_alpha"] / settings["r"]
    factors, weights = load_file(str(adapter / ADAPTER_FILE)), load_file(str(release / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in factors if ".lora_A." in n]:
        b_name = name.replace(".lora_A.", ".lora_B.")
        a = torch.randn(factors[name].shape, generator=generator)
        b = torch.randn(factors[b_name].shape, generator=generator)
        weight = weights[name.removeprefix("base_model.model.").replace(".lora_A", "")].float()
        update_rms = (scale * b @ a).pow(2).mean().sqrt()
        factors[name], factors[b_name] = a, b * (relative * weight.pow(2).mean().sqrt() / update_rms)
    save_file(factors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    return folder


def update_rms(adapter: Path, release: Path) -> float:
    """The median over layers of the update's RMS relative to its weight's."""
    from safetensors.torch import load_file

    settings = json.loads((adapter / "adapter_config.json").read_text())
    scale = settings["lora_alpha"] / settings["r"]
    factors, weights = load_file(str(adapter / ADAPTER_FILE)), load_file(str(release / "model.safetensors"))
    ratios = []
    for name in [n for n in factors if ".lora_A." in n]:
        delta = scale * factors[name.replace(".lora_A.", ".lora_B.")].float() @ factors[name].float()
        weight = weights[name.removeprefix("base_model.model.").replace(".lora_A", "")].float()
        ratios.append(float(delta.pow(2).mean().sqrt() / weight.pow(2).mean().sqrt()))
    return statistics.median(ratios)


@torch.no_grad()
def response_logprobs(model, calls: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """Per held-out call (its ids, where its sampled ids start): log-probs over the vocabulary at each sampled
    token's position."""
    out = []
    for ids, start in calls:
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1:-1].float()
        out.append(torch.log_softmax(logits, dim=-1))
    return out


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """mean over tokens of KL(reference ‖ other)."""
    total = sum(float((r.exp() * (r - o)).sum()) for r, o in zip(reference, other))
    return total / sum(len(r) for r in reference)


def variant(name: str) -> tuple[str, bool]:
    """'error-feedback+act-order' -> ('error-feedback', True): a rounding and error feedback's column order."""
    method, _, order = name.partition("+")
    if method not in ROUNDINGS or order not in ("", "act-order"):
        raise SystemExit(f"unknown variant {name!r}: one of {ROUNDINGS}, error feedback with an optional +act-order")
    return method, order == "act-order"


def measure(episodes: Path, checkpoint: Path, relatives: list[float | None], calibration_tokens: int,
            variants: list[str]) -> None:
    """One row per adapter (`relatives`: None = the checkpoint's own, else a random one of that RMS) and variant."""
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        release = bf16_release(work)
        config = load_config(presets=["cpu"], overrides=[f"model.name_or_path={release}", "model.gguf_package=null",
                                                          "run.device=cpu"])
        _, held_out = split_episodes(read_episodes(episodes))
        calls = [(list(ids), start) for episode in held_out
                 for ids, start in zip(episode.sequences, episode.response_starts) if len(ids) > start]
        base = AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32).eval()
        base_logprobs = response_logprobs(base, calls)
        del base
        for relative in relatives:
            adapter = checkpoint / "adapter" if relative is None else random_adapter(checkpoint / "adapter", release,
                                                                                      relative, work)
            trained = load_adapter_model(AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32),
                                         adapter, str(release)).eval()
            trained_logprobs = response_logprobs(trained, calls)
            del trained
            kl_base = mean_kl(trained_logprobs, base_logprobs)
            started = time.perf_counter()
            found = calibrate(config.train.model, adapter, episodes, torch.device("cpu"), calibration_tokens)
            calibration_seconds = time.perf_counter() - started
            for name in variants:
                method, rounding.ACT_ORDER = variant(name)
                output = work / "merged"
                started = time.perf_counter()
                report = merge.merge(config, adapter, output, None, "full-precision",
                                     Storing(method, found.moments, found.held_out))
                merge_seconds = time.perf_counter() - started
                merged = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32).eval()
                kl_merged = mean_kl(trained_logprobs, response_logprobs(merged, calls))
                shares = sorted(report.kept.values())
                print(json.dumps({
                    "model": "smollm2 (bf16)", "adapter": "random" if relative is not None else str(checkpoint),
                    "update_rms_median": round(update_rms(adapter, release), 6), "variant": name,
                    "damping": rounding.DAMPING if method == "error-feedback" else None,
                    "calibration": {"episodes": found.episodes[0], "tokens": found.calibration_tokens},
                    "held_out": {"episodes": found.episodes[1], "calls": len(calls),
                                 "judged_tokens": sum(len(r) for r in trained_logprobs)},
                    "kept": round(1 - kl_merged / kl_base, 4), "kl_trained_merged": kl_merged,
                    "kl_trained_base": kl_base, "layer_kept_min": round(shares[0], 4),
                    "layer_kept_median": round(statistics.median(shares), 4),
                    "layers_below_90": sum(s < merge.KEPT_GOAL for s in shares), "layers": len(shares),
                    "calibration_seconds": round(calibration_seconds, 1), "merge_seconds": round(merge_seconds, 1)}),
                    flush=True)
                del merged
                shutil.rmtree(output)
