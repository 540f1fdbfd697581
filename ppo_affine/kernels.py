"""Which implementation each layer kind of the loaded model runs, for the run's log.

transformers picks them when it imports a model's code: attention by `config._attn_implementation` (sdpa, eager,
flash_attention_2), routed experts by `config._experts_implementation`, and Gated DeltaNet's two kernels (Qwen3.5 /
Qwen3.6 linear attention) from the `flash-linear-attention` (`fla`) and `causal-conv1d` packages when they import,
else a PyTorch reference: a Python loop over 64-token chunks, correct but many times slower on a GPU. Those two
packages are the `[cuda]` extra (`pip install -e .[cuda]`; docs/architectures.md says where a wheel is needed).
"""
from __future__ import annotations

import sys

import torch

# the module-level functions of a Gated DeltaNet layer's code that transformers wraps with a package's kernel
GATED_DELTANET_KERNELS = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
TORCH_FALLBACK = "torch fallback"


def wrapped_kernel(function) -> str:
    """What one of transformers' kernel-or-fallback wrappers runs: the package's function, or TORCH_FALLBACK (with the
    package it would have used)."""
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    if "implementation" not in cells or "torch_function" not in cells:
        return "unknown (transformers' kernel wrapper changed)"
    chosen, fallback = cells["implementation"].cell_contents, cells["torch_function"].cell_contents
    package = cells["package"].cell_contents if "package" in cells else "its package"
    if chosen is fallback:
        return f"{TORCH_FALLBACK} ({package} not installed)"
    return f"{chosen.__module__}.{chosen.__name__}"


def layer_implementations(model: torch.nn.Module) -> dict[str, str]:
    """Layer kind -> the implementation it runs, for the kinds `model` has: full_attention, linear_attention's
    kernels, experts."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    found = {}
    if kinds & {"full_attention", "sliding_attention"}:
        found["full_attention"] = str(getattr(model.config, "_attn_implementation", "unknown"))
    linear = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if linear is not None:
        code = sys.modules[type(linear).__module__]
        for name in GATED_DELTANET_KERNELS:
            if hasattr(code, name):
                found[f"linear_attention {name.removeprefix('torch_')}"] = wrapped_kernel(getattr(code, name))
    if any(type(m).__name__.endswith("Experts") for m in model.modules()):
        found["experts"] = str(getattr(model.config, "_experts_implementation", "unknown"))
    return found


def slow_on_the_gpu(implementations: dict[str, str], device: torch.device) -> list[str]:
    """The layer kinds that run the PyTorch reference on a CUDA device, where the [cuda] extra's kernels belong."""
    return [kind for kind, chosen in implementations.items()
            if device.type == "cuda" and chosen.startswith(TORCH_FALLBACK)]
