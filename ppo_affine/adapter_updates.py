"""A trained adapter's weight updates one tensor at a time, without the base model's weights.

The merge streams a release far larger than memory, so it can hold neither the base model nor every update at once
(with `lora.adapt_experts` Qwen3.6's dense updates alone are ~129 GB in float32). peft's own layers still define
what an update is (scaling, the fused experts' factor layout): the adapter is attached to the base model built on
the meta device (shapes only, no memory), its low-rank factors are loaded from the adapter file, and each update is
computed when the merge reaches its tensor: scale·B·A for a linear layer, expert by expert for a fused expert
weight. Each update can also be checked against the adapter's own low-rank path on random inputs.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ppo_affine.config import ConfigError

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
