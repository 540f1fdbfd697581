"""The policy: a causal LM with LoRA adapters and a scalar value head; reference = adapter disabled.

Token alignment used everywhere: for a sequence `ids[0..T)`, `logprobs[t]` is
log p(ids[t] | ids[:t]) and `values[t]` is the value of the state *before* token t is generated
(the hidden state at t-1). Both are 0 at t = 0. Only positions in `response_mask` are computed
through the LM head, a chunk of them at a time (recomputed in backward), so a full-vocabulary tensor is never
built for the whole sequence.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ppo_affine.ppo import logprobs_from_hidden
from ppo_affine import prefixes
from ppo_affine.architectures import (default_lora_targets, expert_lora_parameters, prefix_cache_with_gradients,
                                      repeat_cache_rows, switched_off, tree_masks)
from ppo_affine.kernels import layer_implementations, slow_on_the_gpu
from ppo_affine.token_trees import TreeRows
from ppo_affine.model_files import load_base_model, load_tokenizer
from ppo_affine.config import ConfigError, LoraConfig, ModelConfig

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # the only folder vLLM loads: LoRA weights + adapter_config.json
VALUE_HEAD_FILE = "value_head.pt"
REFERENCE_ADAPTER_DIR = "reference_adapter"  # the frozen KL anchor, when it is not the base model
_REFERENCE = "reference"  # its peft adapter name beside the trained "default"
PROBE_SHIFT = 2.0  # nats (RMS over the vocabulary) a probe adapter moves the next-token log-probs by


def _adapter_does_not_fit(adapter_dir: Path, exc: Exception) -> ConfigError:
    return ConfigError(f"The adapter in {adapter_dir} does not fit this model's LoRA (check lora.r and "
                       f"model.name_or_path): {str(exc).splitlines()[0][:200]}")


def resolve_lora_targets(model: nn.Module, wanted: list[str], explicit: bool = True) -> list[str]:
    """Keep the suffixes that name real linear layers; fail if none do. Missing ones are warned about when the user
    named them (`explicit`); an architecture's default lists some that only some of its models have (the dense MLP
    of an MoE model's dense layers)."""
    linear_suffixes = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) or type(module).__name__ in {"Linear4bit", "Linear8bitLt"}
    }
    linear_suffixes.discard("lm_head")
    matched = [target for target in wanted if target in linear_suffixes]
    if not matched:
        raise ConfigError(
            f"lora.target_modules {wanted} match no linear layer of {type(model).__name__}. "
            f"Its linear layers are named: {sorted(linear_suffixes)}."
        )
    missing = sorted(set(wanted) - set(matched))
    if missing and explicit:
        log.warning("LoRA targets %s do not exist in %s and are ignored", missing, type(model).__name__)
    return matched


def common_prefix_length(input_ids: torch.Tensor) -> int:
    """How many leading positions hold the same token in every row: [B, T] -> P."""
    same = (input_ids == input_ids[:1]).all(dim=0)  # [T]
    return int(same.long().cumprod(dim=0).sum())


@dataclass
class ScoredTokens:
    logprobs: torch.Tensor | None  # [B, T], 0 outside the response mask
    values: torch.Tensor | None  # [B, T]
    entropy: torch.Tensor | None  # [B, T], entropy of the next-token distribution at each response token


class Policy(nn.Module):
    """LoRA-adapted causal LM + value head; `reference()` turns the adapter off."""

    def __init__(self, model, tokenizer):
        super().__init__()
        self.model = model  # a peft PeftModel
        self.tokenizer = tokenizer
        hidden = model.get_base_model().config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)  # values start at 0: no spurious advantages at step 1
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(model.parameters()).device)

    @property
    def device(self) -> torch.device:
        return self.value_head.weight.device

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def has_reference_adapter(self) -> bool:
        return _REFERENCE in self.model.peft_config

    @contextlib.contextmanager
    def base(self):
        """The base model: same weights with the LoRA adapter disabled (no second copy)."""
        with self.model.disable_adapter():
            yield

    @contextlib.contextmanager
    def reference(self):
        """The KL anchor: the frozen reference adapter when one is set (the SFT adapter a run started
        from), else the base model."""
        if not self.has_reference_adapter:
            with self.base():
                yield
            return
        self.model.set_adapter(_REFERENCE, inference_mode=True)  # freezes both adapters meanwhile
        try:
            yield
        finally:
            self.model.set_adapter("default")  # trainable again; the reference stays frozen

    @contextlib.contextmanager
    def evaluating(self):
        """Eval mode (no dropout) for a pass without gradients, then back to the mode it was in."""
        was_training = self.training
        self.eval()
        try:
            yield
        finally:
            self.train(was_training)

    def set_reference_adapter(self, adapter_dir: Path) -> None:
        """Anchor the KL penalty to this peft adapter instead of the base model (a frozen copy)."""
        if self.has_reference_adapter:
            self.model.delete_adapter(_REFERENCE)
        was_training = self.model.training
        try:
            self.model.load_adapter(str(adapter_dir), adapter_name=_REFERENCE, is_trainable=False)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise _adapter_does_not_fit(adapter_dir, exc) from None
        self.model.set_adapter("default")
        self.model.train(was_training)

    def score(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None,  # [B, T]; None for right-padded rows (causal attention ignores the tail)
        response_mask: torch.Tensor,  # [B, T], 1 on generated tokens
        with_values: bool = True,
        with_logprobs: bool = True,
        with_entropy: bool = False,
        detach_trunk: bool = False,
        temperature: float = 1.0,
        tree: TreeRows | None = None,  # rows that are prefix trees (`token_trees.py`); attention_mask must be None
    ) -> ScoredTokens:
        """Per-token log-probs, values and entropies of the response tokens. `detach_trunk` runs the
        model without gradients, so only the value head can learn from the result (critic warm-up)."""
        with torch.no_grad() if detach_trunk else contextlib.nullcontext():
            hidden = self._hidden_states(input_ids, attention_mask, tree)  # [B, T, H]
        # the state that predicts token t is the hidden state of the token before it: t - 1, or its parent in a tree
        target = response_mask.bool().clone()
        target[:, 0] = False
        rows, columns = target.nonzero(as_tuple=True)  # row-major, the order of full[target] below
        before = columns - 1 if tree is None else tree.parents[rows, columns]
        predicting = hidden[rows, before]  # [N, H], N = response tokens

        def scatter(per_token: torch.Tensor) -> torch.Tensor:
            full = torch.zeros(response_mask.shape, dtype=torch.float32, device=hidden.device)
            full[target] = per_token
            return full

        logprobs = entropy = values = None
        if with_logprobs or with_entropy:  # the LM head runs per chunk of tokens: no [N, V] logits at once
            lm_head = self.model.get_base_model().get_output_embeddings()
            token_logprobs, token_entropy = logprobs_from_hidden(
                predicting, lm_head, input_ids[target], temperature=temperature, with_entropy=with_entropy)
            logprobs = scatter(token_logprobs)
            entropy = scatter(token_entropy) if with_entropy else None
        if with_values:
            values = scatter(self.value_head(predicting.float()).squeeze(-1))
        return ScoredTokens(logprobs=logprobs, values=values, entropy=entropy)

    def _hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       tree: TreeRows | None = None) -> torch.Tensor:
        """Last hidden states [B, T, H]. Rows that begin with the same tokens (one system prompt, or a group's
        episodes of one task and seed) run that prefix once: its hidden states are shared and its keys and
        values are attended to by every row's rest, which gives the same numbers as running each row whole.

        Tree rows (`token_trees.py`) begin with one plain chain (the sequence holding the whole history); up to
        where every row's chain ends they run causally as plain rows do, and the rest (the other sequences' own
        branches) attends along its branches by a 4D mask, at its positions in its own sequences."""
        if tree is not None and not tree_masks(self.model.config)[0]:  # scoring_sequences keeps trees off for it
            raise ValueError(f"{tree_masks(self.model.config)[1]} ({self.model.config.model_type})")
        decoder = self.model.get_base_model().get_decoder()
        batch, width = input_ids.shape
        can_cache = self.shares_prefixes_with_gradients() or not torch.is_grad_enabled()
        if tree is not None and not can_cache:  # gradient checkpointing: no KV cache, so one call with the whole mask
            return decoder(input_ids=input_ids, attention_mask=self._tree_attention(tree.attention),
                           position_ids=tree.positions).last_hidden_state
        can_share = batch > 1 and attention_mask is None and can_cache
        chain = tree.shared_prefix_limit() if tree is not None else width  # causal up to here in every row
        shared = min(common_prefix_length(input_ids), chain) if can_share else 0
        if shared < prefixes.MIN_SHARED_PREFIX:
            shared = 0
        if tree is None and shared == 0:
            return decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        keyword = kv_cache_keyword()
        parts, cache = [], None
        if shared:
            prefix = decoder(input_ids=input_ids[:1, :shared], use_cache=shared < width)
            parts.append(prefix.last_hidden_state.expand(batch, -1, -1))  # gradients of the rows add up in it
            if shared < width:  # the rows go on from the prefix's keys and values
                cache = getattr(prefix, keyword)
                repeat_cache_rows(cache, batch)
        if chain > shared:  # every row's own causal part
            causal = decoder(input_ids=input_ids[:, shared:chain], use_cache=True, **({keyword: cache} if cache
                                                                                      else {}))
            parts.append(causal.last_hidden_state)
            cache = getattr(causal, keyword)
        if width > chain:  # the branches: their queries against every key before them in the flat layout
            rest = decoder(input_ids=input_ids[:, chain:], use_cache=True, **({keyword: cache} if cache else {}),
                           attention_mask=self._tree_attention(tree.attention[:, :, chain:, :]),
                           position_ids=tree.positions[:, chain:])
            parts.append(rest.last_hidden_state)
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _tree_attention(self, allowed: torch.Tensor) -> torch.Tensor:
        """A bool mask as an additive one (0 where a token may attend, the dtype's minimum elsewhere), made once for
        every layer: given a bool mask, SDPA converts it in each layer, forward and backward, and eager attention
        adds a mask to its scores. In the hidden states' dtype (the embeddings'; a 4-bit model's packed weights are
        no guide), which SDPA requires of a float mask."""
        dtype = self.model.get_input_embeddings().weight.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)

    def shares_prefixes_with_gradients(self) -> bool:
        """Whether training passes can share prefixes: they need the KV cache, which gradient checkpointing
        turns off (passes without gradients always can)."""
        base = self.model.get_base_model()
        if switched_off(base.config, "sharing prefixes in passes with gradients",
                        prefix_cache_with_gradients(base.config)):
            return False
        # transformers 5.2x renamed is_gradient_checkpointing (the old name warns)
        name = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else \
            "is_gradient_checkpointing"
        return not getattr(base, name, False)

    # ------------------------------------------------------------------ the engine check
    @contextlib.contextmanager
    def probe_adapter(self, prompt_ids: list[int], seed: int = 0):
        """Meanwhile the adapter is a probe that must move any engine that applies it: its B matrices drawn at random
        (seeded; a fresh adapter's B is zero and moves nothing), scaled up until the next-token log-probs after
        `prompt_ids` move by PROBE_SHIFT nats (RMS over the vocabulary). Its own B matrices are restored exactly
        after."""
        weights = [p for name, p in self.model.named_parameters() if ".lora_B.default." in name]
        kept = [p.detach().clone() for p in weights]
        generator = torch.Generator().manual_seed(seed)
        noise = [torch.randn(p.shape, generator=generator) for p in weights]
        try:
            with torch.no_grad():
                with self.base():
                    base = self.token_logprobs(prompt_ids, [])
                for scale in (1e-3 * 2.0**k for k in range(20)):
                    for p, drawn in zip(weights, noise):
                        p.copy_(drawn.to(p.device, p.dtype) * scale)
                    if (self.token_logprobs(prompt_ids, []) - base).pow(2).mean().sqrt() >= PROBE_SHIFT:
                        break
            yield
        finally:
            with torch.no_grad():
                for p, own in zip(weights, kept):
                    p.copy_(own)

    @torch.no_grad()
    def token_logprobs(self, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
        """log p(token | prompt, earlier tokens) of each of `tokens` ([len(tokens)], float32, on the CPU); with no
        tokens, the next-token log-probs after the prompt over the vocabulary."""
        with self.evaluating():
            ids = torch.tensor([prompt_ids + tokens], device=self.device)
            logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1:].float().cpu()
        logprobs = torch.log_softmax(logits, dim=-1)
        if not tokens:
            return logprobs[0]
        return logprobs[:-1].gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)

    # ------------------------------------------------------------------ persistence
    def save(self, folder: Path) -> None:
        """`folder/adapter/` in standard peft format (what vLLM loads), the value head beside it and the
        KL reference adapter in `folder/reference_adapter/` when there is one."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        folder = Path(folder)
        self.model.save_pretrained(folder / ADAPTER_DIR, selected_adapters=["default"])
        torch.save(self.value_head.state_dict(), folder / VALUE_HEAD_FILE)
        if self.has_reference_adapter:  # resuming must anchor to the same reference
            reference = folder / REFERENCE_ADAPTER_DIR
            reference.mkdir()
            weights = get_peft_model_state_dict(self.model, adapter_name=_REFERENCE)
            save_file({k: v.contiguous() for k, v in weights.items()}, str(reference / "adapter_model.safetensors"))
            self.model.peft_config[_REFERENCE].save_pretrained(str(reference))

    def load(self, folder: Path) -> None:
        """A checkpoint folder's adapter and value head (and its KL reference adapter, if it has one)."""
        folder = Path(folder)
        self.load_adapter(folder / ADAPTER_DIR)
        self.value_head.load_state_dict(torch.load(folder / VALUE_HEAD_FILE, map_location=self.device))
        if (folder / REFERENCE_ADAPTER_DIR).is_dir():
            self.set_reference_adapter(folder / REFERENCE_ADAPTER_DIR)

    def load_adapter(self, adapter_dir: Path) -> None:
        """LoRA weights from a peft adapter folder; a ConfigError when they do not fit this model's LoRA."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"), device=str(self.device))
        try:
            result = set_peft_model_state_dict(self.model, weights)
        except RuntimeError as exc:  # size mismatch: another rank or another base model
            raise _adapter_does_not_fit(adapter_dir, exc) from None
        if getattr(result, "unexpected_keys", None):
            raise ConfigError(f"The adapter in {adapter_dir} does not fit this model: unexpected keys "
                              f"{result.unexpected_keys[:3]}")


@functools.cache
def kv_cache_keyword() -> str:
    """The name a model's forward and generate() take the KV cache under and return it as: transformers 5.2x
    renamed `past_key_values` to `cache` (the old name still works there but warns, and goes in 6.0), and
    5.1x outputs have no `cache` at all."""
    from dataclasses import fields

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return "cache" if "cache" in {f.name for f in fields(GenerateDecoderOnlyOutput)} else "past_key_values"


def adapter_folder(path: Path) -> Path:
    """The peft adapter folder of a checkpoint (`<ckpt>/adapter/`) or a bare adapter folder."""
    for candidate in (Path(path) / ADAPTER_DIR, Path(path)):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise ConfigError(f"{path} is neither a checkpoint folder (expected {path}/{ADAPTER_DIR}/adapter_config.json) "
                      "nor a LoRA adapter folder (expected adapter_config.json in it).")


def adapter_weights_digest(path: Path) -> str:
    """A hex digest of the LoRA weights at `path` (a checkpoint or adapter folder): the same adapter gives the same
    digest wherever it is copied, unlike its path (peft's README and config may name the base model's path)."""
    folder = adapter_folder(path)
    files = sorted(folder.glob("adapter_model.*"))
    if not files:  # else every such folder would share one digest, and one seed
        raise ConfigError(f"{folder} has no LoRA weights (expected adapter_model.safetensors or adapter_model.bin).")
    digest = hashlib.sha256()
    for weights in files:
        digest.update(weights.name.encode())
        with open(weights, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def load_policy(model_cfg: ModelConfig, lora_cfg: LoraConfig, device: torch.device) -> Policy:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    tokenizer = load_tokenizer(model_cfg)
    base = load_base_model(model_cfg, device)
    targets = resolve_lora_targets(base, lora_cfg.target_modules or default_lora_targets(base.config),
                                   explicit=lora_cfg.target_modules is not None)
    experts = expert_lora_parameters(base) if lora_cfg.adapt_experts else []
    if lora_cfg.adapt_experts and not experts:
        raise ConfigError(f"lora.adapt_experts: {type(base).__name__} has no fused routed-expert weights to adapt.")
    peft_config = PeftLoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=targets,
        target_parameters=experts or None,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, peft_config)
    policy = Policy(model, tokenizer)
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in policy.parameters())
    log.info("policy: %s, LoRA on %s, %s trainable of %s parameters", type(base).__name__, targets + experts,
             f"{trainable:,}", f"{total:,}")
    implementations = layer_implementations(base)
    log.info("layer implementations: %s", ", ".join(f"{kind}: {chosen}" for kind, chosen in implementations.items()))
    slow = slow_on_the_gpu(implementations, device)
    if slow:
        log.warning("%s run the PyTorch reference on the GPU (a Python loop, many times slower): "
                    "pip install -e .[cuda] (docs/architectures.md)", ", ".join(slow))
    return policy.eval()  # the update switches to train mode itself
