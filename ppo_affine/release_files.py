"""A base model's own release files with an adapter merged into the tensors it touches, and nothing else changed.

The validators judge the folder a miner submits by its `config.json` (model type, sizes, no quantisation) and
serve it as the release is served. A folder written by `save_pretrained` of the model the trainer loaded is
another model: transformers loads Qwen3.5/3.6-MoE's multimodal release as its text-only model (its
`save_pretrained` writes `model_type` `qwen3_5_moe_text`, no vision tower), drops the multi-token-prediction
weights (`mtp.*`) and fuses the routed experts. So the merge copies the release's files and rewrites, under the
release's own names, layout and dtype, only the tensors the adapter changes (`architectures.py` says how the
loaded model's names map onto the release's).

The merge streams a release far larger than memory, so it can hold neither the base model nor every update at once
(with `lora.adapt_experts` Qwen3.6's dense updates alone are ~129 GB in float32). peft's own layers still define
what an update is (scaling, the fused experts' factor layout): the adapter is attached to the base model built on
the meta device (shapes only, no memory), its low-rank factors are loaded from the adapter file, and each update is
computed when the merge reaches its tensor: scale·B·A for a linear layer, expert by expert for a fused expert
weight. Each update can also be checked against the adapter's own low-rank path on random inputs.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ppo_affine.architectures import architecture_of
from ppo_affine.config import ConfigError
from ppo_affine.rounding import output_kept_share, store

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


ADAPTER = "default"
_PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_on_skeleton(source: str, adapter_dir: Path, base_name: str, trust_remote_code: bool = False):
    """The adapter in `adapter_dir` attached to the base model `source` built on the meta device, its factors real
    float32 tensors; a ConfigError when they do not fit the base."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from ppo_affine.model_files import load_adapter_model

    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    with warnings.catch_warnings():  # peft copies the factors into meta tensors, a no-op: they are assigned below
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
        model = load_adapter_model(skeleton, Path(adapter_dir), base_name)
    expected = {name.replace(f".{ADAPTER}.", "."): parameter for name, parameter in model.named_parameters()
                if ".lora_" in name}
    with safe_open(str(Path(adapter_dir) / ADAPTER_WEIGHTS), "pt") as handle:
        stored = set(handle.keys())
        misfits = sorted(stored ^ set(expected))[:3] + [
            f"{name} {tuple(handle.get_slice(name).get_shape())} vs {tuple(expected[name].shape)}"
            for name in sorted(stored & set(expected))
            if tuple(handle.get_slice(name).get_shape()) != tuple(expected[name].shape)][:3]
        if misfits:
            raise ConfigError(f"The adapter in {adapter_dir} does not fit the configured base model {base_name!r}: "
                              f"{'; '.join(misfits)}. Pass the training run's config (--config/--preset, or --set "
                              "model.name_or_path=...).")
        for name in expected:
            _assign(model, name, handle.get_tensor(name).float())
    return model


def _assign(model, stored_name: str, value: torch.Tensor) -> None:
    module_name, _, kind = stored_name.removesuffix(".weight").rpartition(".")  # <layer>.lora_A
    layer = model.get_submodule(module_name)
    getattr(layer, kind)[ADAPTER].weight = torch.nn.Parameter(value, requires_grad=False)


def adapted_layers(peft_model) -> dict[str, object]:
    """The loaded model's name of each adapted weight (`model.layers.0.self_attn.q_proj.weight`, or
    `model.layers.0.mlp.experts.gate_up_proj` for a fused expert parameter) -> its peft layer."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for module_name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        if getattr(module, "fan_in_fan_out", False):
            raise ConfigError(f"{module_name}: an adapter with fan_in_fan_out is not supported by the merge.")
        name = module_name.removeprefix(_PEFT_PREFIX)
        parameter = getattr(module, "parameter_name", None)  # a fused expert weight adapted by parameter
        # peft nests one ParamWrapper per adapted parameter of a module: the inner one is `<...>.experts.base_layer`
        layers[(f"{name}.{parameter}" if parameter else f"{name}.weight").replace(".base_layer", "")] = module
    return layers


@dataclass(frozen=True)
class Update:
    """One release tensor's update: a linear layer's whole weight, one expert of a fused expert weight (`expert`,
    as nn.Linear stores it: [out, in]) and of it the output rows `rows` (gate or up of a fused gate_up), or a whole
    fused expert weight in the loaded model's layout (`expert` None on an expert layer)."""

    layer: object
    expert: int | None = None
    rows: slice | None = None
    loaded: str = ""  # the loaded model's name of the adapted weight (calibration moments are kept under it)

    @property
    def as_linear(self) -> bool:
        """Whether the release tensor (each expert's, for a fused one) is [out, in], as nn.Linear stores it."""
        return not (self.is_expert and self.expert is None) or bool(self.layer._did_swap_in_out_features)

    def moment(self, moments: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """This tensor's input second moment in `moments` (loaded name -> [in, in], or [experts, in, in])."""
        moment = moments.get(self.loaded)
        return moment[self.expert] if moment is not None and self.expert is not None else moment

    @property
    def is_expert(self) -> bool:
        return getattr(self.layer, "num_experts", 1) > 1

    def delta(self) -> torch.Tensor:
        """The float32 change of the release tensor."""
        if not self.is_expert:
            return self.layer.get_delta_weight(ADAPTER).float()
        if self.expert is None:
            return torch.stack([self._expert_delta(e) for e in range(self.layer.num_experts)])
        delta = self._expert_delta(self.expert)
        if not self.layer._did_swap_in_out_features:  # stored [in, out]: the release's per-expert weight is [out, in]
            delta = delta.T
        return delta[self.rows or slice(None)]

    def _expert_delta(self, expert: int) -> torch.Tensor:
        lhs, rhs, scaling = self.layer.get_delta_factors(ADAPTER)
        return scaling * lhs[expert].float() @ rhs[expert].float()

    def mismatch(self, base: torch.Tensor, merged: torch.Tensor, generator: torch.Generator) -> float:
        """How far `merged` (the float32 release tensor with its update added to `base`) is from base + adapter,
        the adapter applied through its low-rank factors, on 4 random inputs: the largest output difference
        relative to the largest output (at least 1)."""
        if self.is_expert and self.expert is None:
            return max(self._expert_mismatch(base[e], merged[e], e, generator)
                       for e in range(self.layer.num_experts))
        if self.is_expert:
            return self._expert_mismatch(base, merged, self.expert, generator, per_expert_release=True)
        inputs = torch.randn(4, base.shape[1], generator=generator)
        low_rank = self.layer.lora_B[ADAPTER](self.layer.lora_A[ADAPTER](inputs)) * self.layer.scaling[ADAPTER]
        return _relative(inputs @ merged.T, inputs @ base.T + low_rank)

    def _expert_mismatch(self, base, merged, expert, generator, per_expert_release=False) -> float:
        lhs, rhs, scaling = self.layer.get_delta_factors(ADAPTER)
        lhs, rhs = lhs[expert].float(), rhs[expert].float()
        if self.layer._did_swap_in_out_features:  # update [out, in] = lhs @ rhs
            inputs = torch.randn(4, rhs.shape[1], generator=generator)
            low_rank = scaling * (inputs @ rhs.T) @ lhs.T
        else:  # update [in, out] = lhs @ rhs
            inputs = torch.randn(4, lhs.shape[0], generator=generator)
            low_rank = scaling * (inputs @ lhs) @ rhs
        as_linear = per_expert_release or self.layer._did_swap_in_out_features
        got, start = (inputs @ merged.T, inputs @ base.T) if as_linear else (inputs @ merged, inputs @ base)
        return _relative(got, start + low_rank[:, self.rows or slice(None)])


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max()) / max(1.0, float(expected.abs().max()))


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
            mapped[found] = Update(layer, loaded=loaded)
            continue
        split = _per_expert(candidates, layer, names, loaded)
        if split is None:
            raise ConfigError(f"the adapter changes {loaded}, which no tensor of the base's release files holds "
                              f"(tried {candidates}); is model.name_or_path the adapter's base?")
        mapped.update(split)
    return mapped


def _per_expert(candidates: list[str], layer, names: set[str], loaded: str) -> dict[str, Update] | None:
    """A fused expert weight's update ([experts, 2·width, hidden] for gate_up_proj, [experts, hidden, width] for
    down_proj) as the release's experts.{e}.gate_proj / up_proj / down_proj weights."""
    experts = getattr(layer, "num_experts", 1)
    for fused in candidates:
        stem, _, kind = fused.rpartition(".")
        if kind == "gate_up_proj":
            lhs, rhs, _ = layer.get_delta_factors("default")
            width = (lhs.shape[1] if layer._did_swap_in_out_features else rhs.shape[2]) // 2
            # transformers concatenates gate before up when it fuses them
            parts = {f"{stem}.{e}.gate_proj.weight": Update(layer, e, slice(0, width), loaded)
                     for e in range(experts)}
            parts.update({f"{stem}.{e}.up_proj.weight": Update(layer, e, slice(width, 2 * width), loaded)
                          for e in range(experts)})
        elif kind == "down_proj" and experts > 1:
            parts = {f"{stem}.{e}.down_proj.weight": Update(layer, e, None, loaded) for e in range(experts)}
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
    kept: dict[str, float] = field(default_factory=dict)  # tensor -> share of its update the stored weight keeps


@dataclass
class Storing:
    """How the merged tensors are rounded to their stored dtype (one of rounding.ROUNDINGS) and on which inputs the
    share of each update they keep is judged: `moments` (loaded name -> the layer's calibration input second moment)
    feed error feedback, `held_out` the same from other episodes judge it (none: uncorrelated inputs)."""

    method: str = "nearest"
    moments: dict[str, torch.Tensor] = field(default_factory=dict)
    held_out: dict[str, torch.Tensor] = field(default_factory=dict)
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))  # stochastic's


def write_merged_release(base: Path, updates: dict[str, Update], staging: Path, dtype: torch.dtype | None = None,
                         rounding: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         storing: Storing | None = None) -> MergeReport:
    """Copy `base` to `staging` byte for byte, except the safetensors files holding a tensor in `updates`, which are
    written again shard by shard: read, each adapted tensor W + update (added in float32, checked against the
    adapter's low-rank path, stored in W's own dtype), write, free, then the written shard read back and compared
    tensor by tensor with what was meant to be written. `rounding` replaces a linear layer's W by the NF4-rounded
    weights a 4-bit run trained against; `dtype` casts every floating tensor instead (and the config's dtype says
    so). `storing` says how a merged tensor is rounded to its stored dtype (default: to nearest) and judged. A
    MergeCheckFailed as soon as one tensor fails its check."""
    base, files = Path(base), release_tensor_files(base)
    touched = sorted({files[name] for name in updates}) if dtype is None else sorted(set(files.values()))
    staging.mkdir(parents=True)
    for entry in base.iterdir():
        if entry.name in touched or entry.name.startswith("."):
            continue
        (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, staging / entry.name)
    report = MergeReport(files=touched)
    generator, storing = torch.Generator().manual_seed(0), storing or Storing()
    for file_name in touched:
        digests = _merge_shard(base / file_name, staging / file_name, updates, dtype, rounding, generator, report,
                               storing)
        _check_written(staging / file_name, digests)
    if dtype is not None:
        _set_config_dtype(staging / "config.json", str(dtype).removeprefix("torch."))
    return report


def _merge_shard(source: Path, target: Path, updates: dict[str, Update], dtype: torch.dtype | None,
                 rounding, generator: torch.Generator, report: MergeReport, storing: Storing) -> dict[str, str]:
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
                delta = update.delta()
                merged = start + delta
                report.worst = max(report.worst, _checked(name, update.mismatch(start, merged, generator)))
                weight = store(storing.method, merged, stored, update.moment(storing.moments), storing.generator,
                               update.as_linear)
                error = weight.float() - merged
                if not update.as_linear:  # a fused weight stored [experts, in, out]: judged as [out, in], as its moments
                    delta, error = delta.transpose(-1, -2), error.transpose(-1, -2)
                report.kept[name] = output_kept_share(delta, error, update.moment(storing.held_out))
                digests[name] = tensor_digest(weight)
                report.tensors += 1
                del start, delta, merged, error
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
