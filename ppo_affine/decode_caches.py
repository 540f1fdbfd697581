"""The caches the local decode loop keeps: each episode's keys/values from its last turn, the KV budget they and
the running batch share, which kept cache is dropped when they do not fit, and how a joining row continues from
what it kept.

`generation.kv_cache_budget` bounds the keys/values a rollout holds, in tokens: the running batch counts its rows ×
(its width + a row's fixed share, the linear-attention state a row keeps whatever its length), and kept caches get
what it leaves, the least recently used dropped first (that episode's next turn is prefilled from its tokens).
A linear-attention layer keeps a state instead of keys/values (a convolution window and a recurrent state), which
cannot be cut back to fewer tokens: such a model's turn continues only from exactly what a state folded in, the
last turn's end or the last message boundary before its generation prompt, where a state is kept mid-prefill.
The loop (`local_generation.LocalGenerator`) asks here how much of each prompt is already cached, what may join,
and hands back each finished row's cache; it owns the model calls.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ppo_affine import prefixes
from ppo_affine.architectures import kept_cache_cuts_back

log = logging.getLogger(__name__)


@dataclass
class EpisodeCache:
    """What an episode's last turn left behind: `ids[i]` sits at position i. Per layer, an attention layer's (keys,
    values), each [heads, len(ids), dim], or a linear-attention layer's state after `ids`: (convolution window
    [channels, kernel], recurrent state [heads, key dim, value dim]). A state cannot be cut back to fewer tokens, so
    a linear-attention model also keeps its states after `ids[:boundary]`, the end of the last message before the
    turn's generation prompt: where the next prompt still begins alike when the history comes back without the
    reply's reasoning."""
    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    boundary: int = 0  # 0: no states kept at a message boundary
    boundary_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> state

    def bytes_per_token(self) -> float:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers) / len(self.ids)


def free_memory_bytes(device: torch.device) -> int:
    """What the device can still allocate: CUDA's free memory and the blocks PyTorch holds unused (the last
    update's activations), or the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    import psutil

    return psutil.virtual_memory().available


class DecodeCaches:
    """Per-episode kept caches under one KV budget (in tokens of this model's cache), least recently used first.

    `requests` handed in have `.key` (the episode), `.prompt` and `.fed` (the tokens a prefill feeds)."""

    def __init__(self, budget: int | None, bytes_per_token: float, row_bytes: float, reuse: bool, config=None):
        self.reuse = reuse  # whether an episode's next turn may continue from its kept cache
        self.config = config  # the model's: a cache with linear-attention layers is built from it
        # a linear-attention state continues only from exactly the tokens it folded in: a row continues from its
        # kept cache's end or its message boundary, and its prefill has no padding after the state
        self.exact_prefix_only = config is not None and not kept_cache_cuts_back(config)
        self.continued = 0  # turns (of a linear-attention model) that continued from a kept state
        # the first token of the template's generation prompt (its last one in a prompt ends the last message); None:
        # no states kept at a message boundary
        self.message_start: int | None = None
        self.broken = 0  # turns whose kept state was no prefix of the prompt: prefilled whole
        self.budget_tokens = budget  # None until the first step sets the default
        self.full_budget: int | None = None  # the budget before running out of memory halved it; None: not halved
        self.bytes_per_token = max(bytes_per_token, 1.0)
        # a row's fixed share (linear-attention layers keep a state per row, not per token), in tokens
        self.row_tokens = int(row_bytes // self.bytes_per_token)
        self.kept: OrderedDict[int, EpisodeCache] = OrderedDict()  # least recently used first
        self.evicted = 0
        self.steps_held_back = 0  # steps that left a waiting request out for want of room in the budget
        self.held_tokens = 0  # the tokens the running batch and kept caches held at the last step
        self.peak_tokens = 0  # the most they held at once

    # ------------------------------------------------------------------ the budget
    def budget(self, free_bytes: Callable[[], int]) -> int:
        """The budget in tokens; by default half of `free_bytes()` when first asked (at a rollout's first step,
        when the update's activations are gone), for the running batch and the kept caches."""
        if self.budget_tokens is None:
            self.budget_tokens = int(free_bytes() / 2 / self.bytes_per_token)
            log.info("generation.kv_cache_budget: %d tokens of keys/values (half of the free memory, %.0f bytes a "
                     "token)", self.budget_tokens, self.bytes_per_token)
        return self.budget_tokens

    def halve_budget(self, held: int) -> None:
        """Out of memory while the batch and kept caches held `held` tokens: the budget drops to half of that, and
        every kept cache goes."""
        self.kept.clear()
        if held and self.budget_tokens is not None:
            self.full_budget = self.full_budget or self.budget_tokens
            self.budget_tokens = min(self.budget_tokens, held // 2)

    def grow_budget_back(self) -> None:
        """One step back towards the budget before running out of memory: doubled, at most to it."""
        if self.full_budget is None:
            return
        self.budget_tokens = min(self.full_budget, 2 * max(self.budget_tokens, 1))
        if self.budget_tokens == self.full_budget:
            self.full_budget = None

    def running_tokens(self, rows: int, width: int) -> int:
        return rows * (width + self.row_tokens)

    def kept_tokens(self) -> int:
        return sum(len(kept.ids) for kept in self.kept.values())

    def note_held(self, running_tokens: int) -> None:
        """What the running batch (`running_tokens`) and the kept caches hold at this step."""
        self.held_tokens = self.kept_tokens() + running_tokens
        self.peak_tokens = max(self.peak_tokens, self.held_tokens)

    def start_rollout(self) -> None:
        self.kept.clear()
        self.evicted = self.steps_held_back = self.peak_tokens = self.continued = self.broken = 0

    # ------------------------------------------------------------------ keeping and dropping
    def forget(self, key: int) -> None:
        self.kept.pop(key, None)

    def clear(self) -> None:
        self.kept.clear()

    def remember(self, key: int, cache: EpisodeCache) -> None:
        """Keep an episode's cache as the most recently used (the caller then fits the kept caches)."""
        self.kept[key] = cache
        self.kept.move_to_end(key)

    def fit(self, room: int, spared: set[int]) -> None:
        """Drop the least recently used kept caches until they fit in `room` tokens (never one of `spared`: a
        joining row's prefill starts from it, and it is dropped then)."""
        held = self.kept_tokens()
        for key in [key for key in self.kept if key not in spared]:  # least recently used first
            if held <= room:
                break
            held -= len(self.kept.pop(key).ids)
            self.evicted += 1

    # ------------------------------------------------------------------ what a joining row continues from
    def reuse_of(self, request) -> int:
        """How many leading tokens of the request's feed its episode's kept cache holds (at least one token is
        left to feed). A linear-attention model's: all of the kept ids or those up to its message boundary, where
        the feed begins with exactly those, else none."""
        kept = self.kept.get(request.key) if self.reuse else None
        if kept is None:
            return 0
        fed = request.fed
        if not self.exact_prefix_only:
            return min(prefixes.common_prefix(kept.ids, fed), len(fed) - 1)
        for length in (len(kept.ids), kept.boundary):
            if 0 < length < len(fed) and fed[:length] == kept.ids[:length]:
                return length
        return 0

    def reused_lengths(self, requests: Sequence) -> tuple[list[int], list[EpisodeCache | None],
                                                          list[tuple[list[int], list[int]]]]:
        """How many leading prompt tokens of each request its episode's kept cache already holds (each row keeps
        at least one token to feed), those caches, and the prefixes fresh rows that begin alike share: (rows,
        prefix ids), each to be run once and handed to its rows as their cache (counted in the lengths already)."""
        caches = [self.kept.get(r.key) if self.reuse else None for r in requests]
        for request, cache in zip(requests, caches):
            if cache is not None:
                self.kept.move_to_end(request.key)  # used: the last to be dropped
        reuse = [self.reuse_of(request) if cache else 0 for request, cache in zip(requests, caches)]
        if self.exact_prefix_only:
            self.continued += sum(1 for cache, n in zip(caches, reuse) if cache and n)
            self.broken += sum(1 for cache, n in zip(caches, reuse) if cache and not n)
        # fresh rows of a linear-attention model share no prefix: its state would be continued inside a padded batch
        shared = self._shared_prefixes(requests, reuse) if self.reuse and not self.exact_prefix_only else []
        return reuse, caches, shared

    @staticmethod
    def _shared_prefixes(requests: Sequence, reuse: list[int]) -> list[tuple[list[int], list[int]]]:
        """Rows with no cache of their own whose prompts begin alike (a group's episodes of one task and seed,
        one game's rules): their common prefixes, each with its rows; `reuse` is updated in place."""
        fresh = [row for row, n in enumerate(reuse) if n == 0]
        prompts = [requests[row].prompt for row in fresh]
        shared_prefixes = []
        for members, shared in prefixes.partition(prompts, prefixes.padded_cost):
            shared = min([shared] + [len(prompts[m]) - 1 for m in members])  # each row keeps a token to feed
            if len(members) < 2 or shared < prefixes.MIN_SHARED_PREFIX:
                continue
            rows = [fresh[member] for member in members]
            for row in rows:
                reuse[row] = shared
            shared_prefixes.append((rows, prompts[members[0]][:shared]))
        return shared_prefixes

    def widths_as_they_join(self, running_width: int, requests: Iterable):
        """The running batch's width after each of `requests` in turn joins it (one pass: each request's kept
        prefix is compared once): their prefill is [kept prefix | new tokens], each part as wide as its widest row
        (prefixes fresh rows share are not foreseen)."""
        widest_kept = widest_new = 0
        for request in requests:
            reuse = self.reuse_of(request)
            widest_kept, widest_new = max(widest_kept, reuse), max(widest_new, len(request.fed) - reuse)
            yield max(running_width, widest_kept + widest_new)

    def boundary_rows(self, joining: Sequence, reuse: list[int], new_width: int) -> dict:
        """Where a linear-attention model keeps its rows' states at their prompt's last message boundary, as
        StagedPrefill's fields: the rows asking for a new turn (no reply yet) whose boundary falls among their new
        tokens, at one column (rows are right-aligned: the same generation prompt puts it at the same column)."""
        if self.message_start is None:
            return {}
        column, rows = None, []
        for row, (request, n) in enumerate(zip(joining, reuse)):
            boundary = last_index(request.prompt, self.message_start)
            if request.reply or boundary is None or boundary <= n:
                continue
            at = new_width - (len(request.prompt) - boundary)
            if column is None:
                column = at
            if at == column:
                rows.append(row)
        return {"boundary_column": column, "boundary_rows": rows} if rows else {}

    # ------------------------------------------------------------------ caches per layer kind
    @staticmethod
    def kept_from(cache: Any, mask: torch.Tensor, row: int, ids: list[int],
                  boundary: tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] | None = None) -> EpisodeCache:
        """Row `row` of a running batch's DynamicCache as an episode's kept cache: its keys/values at the columns
        `mask[row]` marks, which hold `ids`, its linear-attention states after them, and the states `boundary`
        kept at its message boundary (length, states), if any."""
        columns = mask[row].nonzero().squeeze(-1)
        layers = [linear_state(layer, row) if is_linear(layer) else
                  (layer.keys[row].index_select(1, columns), layer.values[row].index_select(1, columns))
                  for layer in cache.layers]
        length, states = boundary or (0, {})
        return EpisodeCache(ids=ids, layers=layers, boundary=length, boundary_states=states)

    @staticmethod
    def states_of_row(cache: Any, row: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A copy of row `row`'s linear-attention states, by layer (kept at a message boundary mid-prefill)."""
        return {index: linear_state(layer, row) for index, layer in enumerate(cache.layers) if is_linear(layer)}

    @staticmethod
    def of_prefix(cache: Any, ids: list[int]) -> EpisodeCache:
        """The one row of a prefix's DynamicCache as a cache its rows continue from."""
        return EpisodeCache(ids=list(ids), layers=[(layer.keys[0], layer.values[0]) for layer in cache.layers])

    def continuing_cache(self, kept: EpisodeCache, length: int):
        """A DynamicCache of one row that continues `kept` after its first `length` ids (all of them, or its
        message boundary): keys/values cut to `length`, each linear-attention layer's state after them."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        states = dict(enumerate(kept.layers)) if length == len(kept.ids) else kept.boundary_states
        for index, (layer, entry) in enumerate(zip(cache.layers, kept.layers)):
            if is_linear(layer):
                conv, recurrent = states[index]
                layer.lazy_initialization(conv_states=conv[None], recurrent_states=recurrent[None],
                                          conv_kernel_size=conv.shape[-1])
                layer.conv_states[0].copy_(conv[None])
                layer.recurrent_states[0].copy_(recurrent[None])
                layer.has_previous_state[0] = True  # the next call continues the window instead of padding it
            else:
                layer.update(entry[0][None, :, :length], entry[1][None, :, :length])
        return cache

    @staticmethod
    def joining_cache(caches: list[EpisodeCache | None], reuse: list[int], width: int):
        """One DynamicCache holding each joining row's reused prefix (from `caches`), right-aligned to `width`."""
        from transformers import DynamicCache

        kept = [(row, cache, n) for row, (cache, n) in enumerate(zip(caches, reuse)) if n]
        sample = kept[0][1].layers[0][0]
        layers = []
        for layer in range(len(kept[0][1].layers)):
            keys = sample.new_zeros((len(caches), sample.shape[0], width, sample.shape[2]))
            values = keys.clone()
            for row, cache, n in kept:
                keys[row, :, width - n:] = cache.layers[layer][0][:, :n]
                values[row, :, width - n:] = cache.layers[layer][1][:, :n]
            layers.append((keys, values))
        return DynamicCache(ddp_cache_data=layers)


def is_linear(layer) -> bool:
    """Whether a DynamicCache layer is a linear-attention layer's (a state, no keys and values)."""
    return hasattr(layer, "recurrent_states")


def linear_state(layer, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of one row's (convolution window, recurrent state) in a linear-attention cache layer (transformers
    updates both in place at the next call)."""
    return layer.conv_states[0][row].clone(), layer.recurrent_states[0][row].clone()


def message_start_id(tokenizer) -> int | None:
    """The first token of the chat template's generation prompt (Qwen's `<|im_start|>`, which also opens every
    message), or None where the template renders none."""
    message = [{"role": "user", "content": "x"}]
    try:
        without = tokenizer.apply_chat_template(message, add_generation_prompt=False, tokenize=False)
        with_prompt = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    except Exception:  # no chat template: no boundaries kept
        return None
    if not with_prompt.startswith(without) or len(with_prompt) == len(without):
        return None
    ids = tokenizer.encode(with_prompt[len(without):], add_special_tokens=False)
    return ids[0] if ids else None


def last_index(ids: list[int], token: int) -> int | None:
    """Where `token` last occurs in `ids` (searched from the end: the generation prompt is a few tokens)."""
    for index in range(len(ids) - 1, -1, -1):
        if ids[index] == token:
            return index
    return None
