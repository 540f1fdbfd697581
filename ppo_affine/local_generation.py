"""Replies from the training model itself: a decode loop that serves each request as soon as it comes.

One thread owns the model during a rollout and runs a loop of decode steps over a running batch.
A request (an episode's prompt for its next turn) joins at the next step: its new tokens are
prefilled, from its episode's kept keys/values where they match, and its row is appended to the
batch; a row leaves when it samples an end-of-sequence id or reaches `max_new_tokens`, and its
keys/values are kept for the episode's next turn. So an episode waiting on its opponent's search
holds up no other episode's reply (`generation.local_batching: continuous`). `wave` keeps the old
barrier for comparison: a batch starts only when every live episode has asked and runs until its
last row ends.

Rows sit right-aligned in one padded batch ([left padding | row's tokens], an attention mask hides
the padding; positions are each row's own). Draws come from `sampling.sample_tokens`, keyed by the
request's seed and the token's index, so a request gets the same tokens whatever it is batched
with: a seeded run repeats itself, except where two tokens' scores tie within the float noise that
a different batch width adds (~1e-6 on CPU). A rollout switches the model to eval mode once and,
unless the model is 4-bit, runs it with the LoRA adapter added into a copy of each adapted weight
(`generation.fold_adapter`): one matmul per adapted layer instead of three, which is most of the
kernel launches of a decode step; the trained weights are never touched.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ppo_affine import prefixes
from ppo_affine.config import GenerationConfig, derive_seed
from ppo_affine.generation import Generation, eos_token_ids
from ppo_affine.policy import kv_cache_keyword
from ppo_affine.sampling import sample_tokens

log = logging.getLogger(__name__)


def cache_reuse_supported(model) -> bool:
    """KV reuse across turns assumes every layer attends to the whole sequence (no sliding window)."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return False
    return not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))


@dataclass
class EpisodeCache:
    """The keys/values an episode's last turn left behind: `ids[i]` sits at position i."""
    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [heads, len(ids), dim]


@dataclass
class Request:
    key: int  # the episode's place in the step's batch
    prompt: list[int]
    seed: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    reply: list[int] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)

    def resolve(self, result: Generation | BaseException) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)
        self.loop.call_soon_threadsafe(settle)


@dataclass
class Running:
    """The decode batch: row r is requests[r]; its tokens sit right-aligned in the cache's columns."""
    requests: list[Request]
    cache: Any  # a transformers DynamicCache, [rows, heads, width, dim] per layer
    mask: torch.Tensor  # [rows, width] 1 where a column holds the row's token
    positions: torch.Tensor  # [rows] position of the token each row feeds next
    next_tokens: torch.Tensor  # [rows] the token each row feeds next (its last sampled one)

    @property
    def width(self) -> int:
        return self.mask.shape[1]


class FoldedAdapter:
    """The LoRA adapter added into a copy of each weight it adapts, for generation only: while held, every
    adapted layer's base weight is the merged copy and the adapter path is switched off, so a forward runs
    one matmul per layer. The original weight tensors are put back untouched on exit."""

    def __init__(self, model):
        self.model = model
        self.swapped: list[tuple[Any, torch.Tensor]] = []

    @staticmethod
    def foldable_layers(model) -> list | None:
        """The LoRA layers to fold, or None when folding would not give the same model (an adapter switched
        off or merged already, or a quantised base weight)."""
        from peft.tuners.lora import LoraLayer

        layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        if not layers:
            return None
        for layer in layers:
            base = layer.get_base_layer()
            if layer.disable_adapters or layer.merged or not isinstance(base, torch.nn.Linear):
                return None
        return layers

    def __enter__(self) -> "FoldedAdapter":
        layers = self.foldable_layers(self.model)
        if layers is None:
            raise ValueError("the adapter cannot be folded here")
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                merged = base.weight.detach().clone()
                for name in layer.active_adapters:
                    if name in layer.lora_A:
                        merged += layer.get_delta_weight(name).to(merged.dtype)
                self.swapped.append((base, base.weight.data))
                base.weight.data = merged
        self._adapter_off = self.model.disable_adapter()
        self._adapter_off.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._adapter_off.__exit__(*exc)
        for base, original in self.swapped:
            base.weight.data = original
        self.swapped.clear()


class LocalGenerator:
    """The training model's replies, one request per episode turn, served by a decode loop on its own thread."""

    def __init__(self, policy, gen_cfg: GenerationConfig, seed: int):
        self.policy = policy
        self.cfg = gen_cfg
        self.seed = seed
        self.tokenizer = policy.tokenizer
        self.eos_ids = eos_token_ids(self.tokenizer, policy.model.generation_config)
        self.reuse_cache = gen_cfg.reuse_kv_cache and cache_reuse_supported(policy.model)
        self.continuous = gen_cfg.local_batching == "continuous"
        self._cache_name = kv_cache_keyword()
        self.live_episodes = 0
        self._pending: list[Request] = []
        self._caches: dict[int, EpisodeCache] = {}
        self._running: Running | None = None
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._abandon = False  # set by _drain: drop the running batch
        self.generated_tokens = 0
        self.prefilled_tokens = 0  # prompt tokens run through the model (the rest came from caches)
        self.prompt_tokens = 0
        self.forward_calls = 0  # prefill and decode steps: what a GPU would run as kernels
        self._step_seconds = 0.005  # a moving average of a step's time

    # ------------------------------------------------------------------ the episodes' side (event loop)
    def episode_started(self) -> None:
        with self._changed:
            self.live_episodes += 1

    def episode_finished(self, order_key: int | None = None) -> None:
        with self._changed:
            self.live_episodes -= 1
            self._caches.pop(order_key, None)
            self._changed.notify_all()

    async def generate(self, prompt_ids: list[int], order_key: int, seed: int) -> Generation:
        loop = asyncio.get_running_loop()
        # the run's seed goes into every draw, beside the turn's own seed
        request = Request(order_key, list(prompt_ids), derive_seed(self.seed, seed), loop.create_future(), loop)
        with self._changed:
            self._start_thread()
            self._pending.append(request)
            self._changed.notify_all()
        return await request.future

    @contextlib.asynccontextmanager
    async def rollout(self, step: int):
        """One batch of episodes: the model in eval mode (and the adapter folded) from start to end, no kept
        cache outliving its episodes; on exit (also when cancelled) the loop is idle before the model goes back."""
        self._caches.clear()
        with contextlib.ExitStack() as held:
            held.enter_context(self.policy.evaluating())
            if self.cfg.fold_adapter and FoldedAdapter.foldable_layers(self.policy.model) is not None:
                held.enter_context(FoldedAdapter(self.policy.model))
            try:
                yield
            finally:
                await asyncio.to_thread(self._drain)
                self._caches.clear()

    async def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._closing = False
        self._caches.clear()

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name="local-generation", daemon=True)
            self._thread.start()

    def _drain(self) -> None:
        """Cancel whatever is queued or decoding and wait until the loop holds no batch."""
        with self._changed:
            for request in self._pending:
                request.resolve(asyncio.CancelledError())
            self._pending = []
            self._abandon = self._running is not None
            self._changed.notify_all()
            while self._running is not None:
                self._changed.wait()

    # ------------------------------------------------------------------ the decode loop (its own thread)
    def _wait_for_work(self) -> bool:
        """(Holding the lock) wait until a step is due; False when the loop should end. A running batch steps at
        once. An idle loop starts when every live episode has asked (always so for `wave`); under `continuous`
        also once its first request has waited half a step's time: episodes whose env steps end a moment
        apart start together, an episode away on a long search holds up nobody."""
        while True:
            if self._closing and self._running is None:
                return False
            if self._abandon or self._running is not None:
                return True
            if self._pending:
                if len(self._pending) >= self.live_episodes:
                    return True
                if self.continuous:
                    left = 0.5 * self._step_seconds - (time.monotonic() - self._pending[0].arrived)
                    if left <= 0:
                        return True
                    self._changed.wait(left)
                    continue
            self._changed.wait()

    def _joining(self) -> list[Request]:
        """(Holding the lock) the requests that join this step, in episode order."""
        if self.continuous or (self._running is None and len(self._pending) >= self.live_episodes):
            joining, self._pending = sorted(self._pending, key=lambda r: r.key), []
            return joining
        return []

    def _serve(self) -> None:
        while True:
            with self._changed:
                if not self._wait_for_work():
                    return
                if self._abandon:
                    abandoned, self._running, self._abandon = self._running, None, False
                    self._changed.notify_all()
                    for request in abandoned.requests if abandoned else []:
                        request.resolve(asyncio.CancelledError())
                    continue
                joining = self._joining()
            try:
                started = time.monotonic()
                with torch.no_grad():
                    self._step(joining)
                self._step_seconds = 0.8 * self._step_seconds + 0.2 * (time.monotonic() - started)
            except Exception as exc:  # the failure goes to every request in the loop; the loop goes on
                log.warning("local generation failed: %s", exc)
                for request in joining + (self._running.requests if self._running else []):
                    request.resolve(exc)
                with self._changed:
                    self._running = None
                    self._changed.notify_all()

    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The next token of each row (bench/ replaces this with a scripted player)."""
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.long, device=logits.device)
        counters = torch.tensor([len(r.reply) for r in requests], dtype=torch.long, device=logits.device)
        return sample_tokens(logits, seeds, counters, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)

    def _step(self, joining: list[Request]) -> None:
        """One forward call: every running row feeds its last sampled token, every joining row the prompt tokens
        its episode's kept cache lacks (right-aligned, so all rows end in the last column); then each row samples
        its next token and the rows that ended leave."""
        running, device = self._running, self.policy.device
        staying = running.requests if running else []
        reuse = self._reused_lengths(joining)
        fresh = [len(r.prompt) - n for r, n in zip(joining, reuse)]
        new_width = max(fresh + [1])
        cached_width = max([running.width if running else 0] + reuse)
        cache, cached_mask = self._cache_before_step(running, joining, reuse, cached_width)

        rows = len(staying) + len(joining)
        input_ids = torch.full((rows, new_width), self.tokenizer.pad_token_id, dtype=torch.long, device=device)
        positions = torch.zeros((rows, new_width), dtype=torch.long, device=device)
        new_mask = torch.zeros((rows, new_width), dtype=torch.long, device=device)
        if running:
            input_ids[: len(staying), -1] = running.next_tokens
            positions[: len(staying), -1] = running.positions
            new_mask[: len(staying), -1] = 1
        for row, (request, n, count) in enumerate(zip(joining, reuse, fresh), start=len(staying)):
            input_ids[row, new_width - count:] = torch.tensor(request.prompt[n:], dtype=torch.long)
            positions[row, new_width - count:] = torch.arange(n, len(request.prompt))
            new_mask[row, new_width - count:] = 1
        self.prompt_tokens += sum(len(r.prompt) for r in joining)
        self.prefilled_tokens += sum(fresh)

        mask = torch.cat([cached_mask, new_mask], dim=1)
        self.forward_calls += 1
        out = self.policy.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                cache_position=torch.arange(cached_width, cached_width + new_width, device=device),
                                use_cache=True, logits_to_keep=1, **{self._cache_name: cache})
        requests = staying + joining
        next_positions = [running.positions + 1] if running else []
        next_positions.append(torch.tensor([len(r.prompt) for r in joining], dtype=torch.long, device=device))
        tokens = self._choose(out.logits[:, -1], requests)
        for request, token in zip(requests, tokens.tolist()):
            request.reply.append(token)
        self.generated_tokens += len(requests)
        self._running = Running(requests, getattr(out, self._cache_name), mask, torch.cat(next_positions), tokens)
        self._retire_finished()

    def _cache_before_step(self, running: Running | None, joining: list[Request], reuse: list[int], width: int):
        """(the keys/values the step's rows start from, their mask [rows, width]): the running rows' left-padded
        to `width`, then each joining row's reused prefix right-aligned; (None, an empty mask) when there are none."""
        from transformers import DynamicCache

        device = self.policy.device
        join_mask = torch.zeros((len(joining), width), dtype=torch.long, device=device)
        for row, n in enumerate(reuse):
            join_mask[row, width - n:] = 1
        if running and not joining and width == running.width:
            return running.cache, running.mask  # a plain decode step: the running cache as it is
        if not width:
            return None, join_mask
        with self._changed:
            kept = [self._caches[r.key] if n else None for r, n in zip(joining, reuse)]
        source = running.cache.layers[0].keys[0] if running else next(c for c in kept if c).layers[0][0]
        heads, dim = source.shape[-3], source.shape[-1]
        layers = []
        for layer in range(len(running.cache.layers) if running else len(next(c for c in kept if c).layers)):
            join_keys = source.new_zeros((len(joining), heads, width, dim))
            join_values = join_keys.clone()
            for row, (cache, n) in enumerate(zip(kept, reuse)):
                if n:
                    join_keys[row, :, width - n:] = cache.layers[layer][0][:, :n]
                    join_values[row, :, width - n:] = cache.layers[layer][1][:, :n]
            if running:
                old = running.cache.layers[layer]
                join_keys = torch.cat([_left_pad(old.keys, width), join_keys])
                join_values = torch.cat([_left_pad(old.values, width), join_values])
            layers.append((join_keys, join_values))
        mask = torch.cat([_left_pad(running.mask, width, dim=1), join_mask]) if running else join_mask
        return DynamicCache(ddp_cache_data=layers), mask

    def _finished(self, request: Request) -> bool:
        return request.reply[-1] in self.eos_ids or len(request.reply) >= self.cfg.max_new_tokens

    def _retire_finished(self) -> None:
        """Rows whose reply ended leave the batch: their keys/values are kept for their episode's next turn,
        their futures resolved; columns no remaining row uses are cut off."""
        running = self._running
        done = [row for row, request in enumerate(running.requests) if self._finished(request)]
        if not done:
            return
        for row in done:
            request = running.requests[row]
            if self.reuse_cache:
                self._keep_cache(running, row)
            request.resolve(Generation(list(request.reply)))
        keep = [row for row in range(len(running.requests)) if row not in set(done)]
        if not keep:
            with self._changed:
                self._running = None
                self._changed.notify_all()
            return
        index = torch.tensor(keep, device=running.mask.device)
        running.cache.batch_select_indices(index)
        running.requests = [running.requests[row] for row in keep]
        running.mask, running.positions = running.mask[index], running.positions[index]
        running.next_tokens = running.next_tokens[index]
        used = running.mask.any(dim=0)
        if int(used.sum()) < used.numel() // 2:  # mostly padding: keep only the columns some row uses
            columns = used.nonzero().squeeze(-1)
            running.mask = running.mask.index_select(1, columns)
            for layer in running.cache.layers:
                layer.keys, layer.values = layer.keys.index_select(2, columns), layer.values.index_select(2, columns)

    def _keep_cache(self, running: Running, row: int) -> None:
        """The row's keys/values of prompt + reply (all but the last reply token, which was never fed)."""
        request = running.requests[row]
        columns = running.mask[row].nonzero().squeeze(-1)
        layers = [(layer.keys[row].index_select(1, columns), layer.values[row].index_select(1, columns))
                  for layer in running.cache.layers]
        with self._changed:
            self._caches[request.key] = EpisodeCache(ids=request.prompt + request.reply[:-1], layers=layers)

    def _reused_lengths(self, requests: list[Request]) -> list[int]:
        """How many leading prompt tokens of each request its episode's kept cache already holds (each row keeps
        at least one token to feed); fresh rows that begin alike get their common prefix prefilled once."""
        reuse = []
        with self._changed:
            caches = [self._caches.get(r.key) if self.reuse_cache else None for r in requests]
        for request, cache in zip(requests, caches):
            reuse.append(min(prefixes.common_prefix(cache.ids, request.prompt), len(request.prompt) - 1)
                         if cache else 0)
        if self.reuse_cache:
            self._prefill_shared_prefixes(requests, reuse)
        return reuse

    def _prefill_shared_prefixes(self, requests: list[Request], reuse: list[int]) -> None:
        """Rows with no cache of their own whose prompts begin alike (a group's episodes of one task and seed,
        one game's rules) get their common prefix run once and handed to each of them as its cache; `reuse`
        is updated in place."""
        fresh = [row for row, n in enumerate(reuse) if n == 0]
        prompts = [requests[row].prompt for row in fresh]
        for members, shared in prefixes.partition(prompts, prefixes.padded_cost):
            shared = min([shared] + [len(prompts[m]) - 1 for m in members])  # each row keeps a token to feed
            if len(members) < 2 or shared < prefixes.MIN_SHARED_PREFIX:
                continue
            prefix = prompts[members[0]][:shared]
            device = self.policy.device
            self.forward_calls += 1
            out = self.policy.model(input_ids=torch.tensor([prefix], device=device), use_cache=True,
                                    logits_to_keep=1)
            layers = [(layer.keys[0], layer.values[0]) for layer in getattr(out, self._cache_name).layers]
            with self._changed:
                for member in members:
                    row = fresh[member]
                    self._caches[requests[row].key] = EpisodeCache(ids=list(prefix), layers=layers)
                    reuse[row] = shared
            self.prefilled_tokens += shared  # once; each row's rest is counted with its prefill


def _left_pad(tensor: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """`tensor` with zeros added before its columns along `dim` up to `width`."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

