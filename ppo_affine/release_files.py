"""A base model's own release files with an adapter merged into the tensors it touches, and nothing else changed.

The validators judge the folder a miner submits by its `config.json` (model type, sizes, no quantisation) and
serve it as the release is served. A folder written by `save_pretrained` of the model the trainer loaded is
another model: transformers loads Qwen3.5/3.6-MoE's multimodal release as its text-only model (its
`save_pretrained` writes `model_type` `qwen3_5_moe_text`, no vision tower), drops the multi-token-prediction
weights (`mtp.*`) and fuses the routed experts. So the merge copies the release's files and rewrites, under the
release's own names, layout and dtype, only the tensors the adapter changes (`architectures.py` says how the
loaded model's names map onto the release's).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ppo_affine.adapter_updates import Update
from ppo_affine.architectures import architecture_of
from ppo_affine.config import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MERGE_TOLERANCE = 1e-4  # a tensor's W + update vs its adapter, relative to its largest output (at least 1)


class MergeCheckFailed(RuntimeError):
    """A merged tensor's outputs differ from base + adapter, or a written shard from what was merged."""


def release_tensor_files(folder: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file in `folder` that holds it."""
    from safetensors import safe_open

    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        return dict(json.loads((folder / INDEX_FILE).read_text())["weight_map"])
    if (folder / SINGLE_FILE).is_file():
        with safe_open(str(folder / SINGLE_FILE), "pt") as handle:
            return {name: SINGLE_FILE for name in handle.keys()}
    raise ConfigError(f"{folder} holds no safetensors weights ({INDEX_FILE} or {SINGLE_FILE}): the merge rewrites "
                      "the base's own safetensors files, so the base must be a Hugging Face folder of them.")


def release_updates(config, layers: dict[str, object], names: set[str]) -> dict[str, Update]:
    """Each adapted weight's update (`layers`: loaded name -> peft layer) under the release files' names (`names`),
    split per expert where the release stores experts one tensor each; a ConfigError naming the tensor where no
    release tensor fits."""
    row = architecture_of(config)
    mapped: dict[str, Update] = {}
    for loaded, layer in layers.items():
        candidates = [loaded] + [release + loaded.removeprefix(mine)
                                 for mine, release in row.release_prefixes if loaded.startswith(mine)]
        found = next((name for name in candidates if name in names), None)
        if found is not None:
            mapped[found] = Update(layer)
            continue
        split = _per_expert(candidates, layer, names)
        if split is None:
            raise ConfigError(f"the adapter changes {loaded}, which no tensor of the base's release files holds "
                              f"(tried {candidates}); is model.name_or_path the adapter's base?")
        mapped.update(split)
    return mapped


def _per_expert(candidates: list[str], layer, names: set[str]) -> dict[str, Update] | None:
    """A fused expert weight's update ([experts, 2·width, hidden] for gate_up_proj, [experts, hidden, width] for
    down_proj) as the release's experts.{e}.gate_proj / up_proj / down_proj weights."""
    experts = getattr(layer, "num_experts", 1)
    for fused in candidates:
        stem, _, kind = fused.rpartition(".")
        if kind == "gate_up_proj":
            lhs, rhs, _ = layer.get_delta_factors("default")
            width = (lhs.shape[1] if layer._did_swap_in_out_features else rhs.shape[2]) // 2
            # transformers concatenates gate before up when it fuses them
            parts = {f"{stem}.{e}.gate_proj.weight": Update(layer, e, slice(0, width)) for e in range(experts)}
            parts.update({f"{stem}.{e}.up_proj.weight": Update(layer, e, slice(width, 2 * width))
                          for e in range(experts)})
        elif kind == "down_proj" and experts > 1:
            parts = {f"{stem}.{e}.down_proj.weight": Update(layer, e) for e in range(experts)}
        else:
            continue
        if set(parts) <= names:
            return parts
    return None


@dataclass
class MergeReport:
    """What the streaming merge wrote: the rewritten files, how many tensors it changed, and the largest relative
    output difference of a changed tensor (in float32, before the store's rounding) to base + adapter."""

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    worst: float = 0.0


def write_merged_release(base: Path, updates: dict[str, Update], staging: Path, dtype: torch.dtype | None = None,
                         rounding: Callable[[torch.Tensor], torch.Tensor] | None = None) -> MergeReport:
    """Copy `base` to `staging` byte for byte, except the safetensors files holding a tensor in `updates`, which are
    written again shard by shard: read, each adapted tensor W + update (added in float32, checked against the
    adapter's low-rank path, stored in W's own dtype), write, free, then the written shard read back and compared
    tensor by tensor with what was meant to be written. `rounding` replaces a linear layer's W by the NF4-rounded
    weights a 4-bit run trained against; `dtype` casts every floating tensor instead (and the config's dtype says
    so). A MergeCheckFailed as soon as one tensor fails its check."""
    base, files = Path(base), release_tensor_files(base)
    touched = sorted({files[name] for name in updates}) if dtype is None else sorted(set(files.values()))
    staging.mkdir(parents=True)
    for entry in base.iterdir():
        if entry.name in touched or entry.name.startswith("."):
            continue
        (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, staging / entry.name)
    report = MergeReport(files=touched)
    generator = torch.Generator().manual_seed(0)
    for file_name in touched:
        digests = _merge_shard(base / file_name, staging / file_name, updates, dtype, rounding, generator, report)
        _check_written(staging / file_name, digests)
    if dtype is not None:
        _set_config_dtype(staging / "config.json", str(dtype).removeprefix("torch."))
    return report


def _merge_shard(source: Path, target: Path, updates: dict[str, Update], dtype: torch.dtype | None,
                 rounding, generator: torch.Generator, report: MergeReport) -> dict[str, str]:
    """One shard merged and written; the digest of each tensor it changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors, digests = {}, {}
    with safe_open(str(source), "pt") as handle:
        metadata = handle.metadata()
        for name in handle.keys():
            weight = handle.get_tensor(name)
            stored = dtype if dtype is not None and weight.is_floating_point() else weight.dtype
            if name in updates:
                update = updates[name]
                start = rounding(weight) if rounding is not None and not update.is_expert else weight.float()
                merged = start + update.delta()
                report.worst = max(report.worst, _checked(name, update.mismatch(start, merged, generator)))
                weight = merged.to(stored)
                digests[name] = tensor_digest(weight)
                report.tensors += 1
                del start, merged
            tensors[name] = weight.to(stored).contiguous()
    save_file(tensors, str(target), metadata=metadata or {"format": "pt"})
    return digests


def _checked(name: str, mismatch: float) -> float:
    if not mismatch <= MERGE_TOLERANCE:  # also catches NaN
        raise MergeCheckFailed(f"base + the adapter's updates vs base + adapter: a layer's outputs differ by up to "
                               f"{mismatch:.3g} of their size at {name} (allowed {MERGE_TOLERANCE:g}). Nothing was "
                               "saved. Check that the configured base model is the one the adapter was trained on.")
    return mismatch


def _check_written(file: Path, digests: dict[str, str]) -> None:
    """The shard as written, read back: each changed tensor holds exactly the merged values, all finite."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as handle:
        for name, digest in digests.items():
            written = handle.get_tensor(name)
            if tensor_digest(written) != digest or not torch.isfinite(written).all():
                raise MergeCheckFailed(f"{file.name}: {name} as written differs from the merged tensor or is not "
                                       "finite; nothing was saved.")


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (any dtype) with its dtype and shape."""
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.numel():
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())  # hashed in place, no copy
    return digest.hexdigest()


def nf4_rounding(compute_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """W -> the float32 of its NF4 rounding as model.use_4bit loads it (the weight in the compute dtype, quantised
    in 64-wide blocks with double-quantised scales, dequantised): the weights a 4-bit run's adapter trained against.
    bitsandbytes quantises nn.Linear weights only, so fused expert weights are never rounded."""
    import bitsandbytes.functional as bnb

    def rounded(weight: torch.Tensor) -> torch.Tensor:
        packed, state = bnb.quantize_4bit(weight.to(compute_dtype), blocksize=64, compress_statistics=True,
                                          quant_type="nf4")
        return bnb.dequantize_4bit(packed, state).to(compute_dtype).float()

    return rounded


def _set_config_dtype(config_file: Path, dtype: str) -> None:
    config = json.loads(config_file.read_text())
    for section in [config] + [value for value in config.values() if isinstance(value, dict)]:
        for key in ("dtype", "torch_dtype"):
            if key in section:
                section[key] = dtype
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def local_release_folder(name_or_path: str) -> Path:
    """The folder of the base's release files: the configured folder, or the Hub snapshot the trainer loaded."""
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    from huggingface_hub import snapshot_download

    try:  # the files the training run downloaded, else what is missing of them
        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:  # noqa: BLE001 - huggingface_hub raises several kinds for "not cached"
        return Path(snapshot_download(name_or_path))


def replace_folder(staging: Path, output: Path) -> None:
    if output.exists():
        output.rmdir()  # only an empty folder gets here (checked before loading anything)
    os.replace(staging, output)
