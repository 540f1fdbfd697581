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

import json
import os
import shutil
from pathlib import Path

import torch

from ppo_affine.architectures import architecture_of
from ppo_affine.config import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PEFT_PREFIX = "base_model.model."


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


def adapter_deltas(peft_model) -> dict[str, torch.Tensor]:
    """Each adapted weight's change, in float32, under its name in the loaded base model (`model.layers.0...`):
    scale · B·A for a linear layer, one such product per expert for a fused expert weight [experts, out, in]."""
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, torch.Tensor] = {}
    for module_name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        name = module_name.removeprefix(_PEFT_PREFIX)
        parameter = getattr(module, "parameter_name", None)  # a fused expert weight adapted by parameter
        weight_name = f"{name}.{parameter}" if parameter else f"{name}.weight"
        with torch.no_grad():
            delta = module.get_delta_weight("default").float()
        # peft nests one ParamWrapper per adapted parameter of a module: the inner one is `<...>.experts.base_layer`
        deltas[weight_name.replace(".base_layer", "")] = delta
    return deltas


def release_deltas(config, deltas: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """The deltas under the release files' names (`names`), split per expert where the release stores experts one
    tensor each; a ConfigError naming the tensor where no release tensor fits."""
    row = architecture_of(config)
    mapped: dict[str, torch.Tensor] = {}
    for loaded, delta in deltas.items():
        candidates = [loaded] + [release + loaded.removeprefix(mine)
                                 for mine, release in row.release_prefixes if loaded.startswith(mine)]
        found = next((name for name in candidates if name in names), None)
        if found is not None:
            mapped[found] = delta
            continue
        split = _per_expert(candidates, delta, names)
        if split is None:
            raise ConfigError(f"the adapter changes {loaded} {tuple(delta.shape)}, which no tensor of the base's "
                              f"release files holds (tried {candidates}); is model.name_or_path the adapter's base?")
        mapped.update(split)
    return mapped


def _per_expert(candidates: list[str], delta: torch.Tensor, names: set[str]) -> dict[str, torch.Tensor] | None:
    """A fused expert delta ([experts, 2·width, hidden] for gate_up_proj, [experts, hidden, width] for down_proj)
    as the release's experts.{e}.gate_proj / up_proj / down_proj weights."""
    for fused in candidates:
        stem, _, kind = fused.rpartition(".")
        if kind == "gate_up_proj":
            gate, up = delta.chunk(2, dim=1)  # transformers concatenates gate before up when it fuses them
            parts = {f"{stem}.{e}.gate_proj.weight": gate[e] for e in range(delta.shape[0])}
            parts.update({f"{stem}.{e}.up_proj.weight": up[e] for e in range(delta.shape[0])})
        elif kind == "down_proj" and delta.dim() == 3:
            parts = {f"{stem}.{e}.down_proj.weight": delta[e] for e in range(delta.shape[0])}
        else:
            continue
        if set(parts) <= names:
            return parts
    return None


def write_merged_release(base: Path, deltas: dict[str, torch.Tensor], staging: Path,
                         dtype: torch.dtype | None = None, rounded_bases: dict[str, torch.Tensor] | None = None
                         ) -> list[str]:
    """Copy `base` to `staging` byte for byte, except the safetensors files holding a tensor in `deltas`, which are
    written again with W + delta (added in float32, stored in W's own dtype) and every other tensor as it was.
    `rounded_bases` replaces W for the tensors it names (the NF4-rounded weights a 4-bit run trained against);
    `dtype` casts every floating tensor instead (and the config's dtype says so). Returns the rewritten files."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    base, files = Path(base), release_tensor_files(base)
    touched = sorted({files[name] for name in deltas}) if dtype is None else sorted(set(files.values()))
    staging.mkdir(parents=True)
    for entry in base.iterdir():
        if entry.name in touched or entry.name.startswith("."):
            continue
        (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, staging / entry.name)
    for file_name in touched:
        tensors, metadata = {}, None
        with safe_open(str(base / file_name), "pt") as handle:
            metadata = handle.metadata()
            for name in handle.keys():
                weight = handle.get_tensor(name)
                target = dtype if dtype is not None and weight.is_floating_point() else weight.dtype
                if name in deltas:
                    start = (rounded_bases or {}).get(name, weight)
                    weight = start.to("cpu", torch.float32) + deltas[name].to("cpu", torch.float32)
                tensors[name] = weight.to(target).contiguous()
        save_file(tensors, str(staging / file_name), metadata=metadata or {"format": "pt"})
    if dtype is not None:
        _set_config_dtype(staging / "config.json", str(dtype).removeprefix("torch."))
    return touched


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
