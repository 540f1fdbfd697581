"""Replies from the training model itself: a decode loop that serves each request as soon as it comes.

A coroutine on the rollout's event loop runs decode steps over a running batch: on an accelerator it launches
each step's kernels itself and waits for the device in a thread (the loop steps envs meanwhile, and no second
Python thread contends for the GIL); on CPU the whole step runs in a thread. A step copies everything it needs
from the host (new tokens, masks, positions, the draws' keys) before its first kernel: a copy from the host
after a launch would wait for the launched work. A request (an episode's prompt for its next turn) joins at the
next step: its new tokens are prefilled (in forward calls of at most `generation.prefill_chunk_tokens` columns),
from its episode's kept keys/values where they match, and its row is appended to the batch; a row leaves when it
samples an end-of-sequence id, reaches `max_new_tokens` or (with `stop_at_closing_fence`) closes a fenced block,
and its keys/values are kept for the episode's next turn. A linear-attention model keeps each row's states
instead, at the turn's end and at its prompt's last message boundary (the prefill is cut there), and a row that
continues one is prefilled alone: no padding may sit between a state and its new tokens.
`generation.kv_cache_budget` bounds the keys/values a rollout holds, in tokens (the caches are `decode_caches`'s
job): a request joins only while the running batch it joins fits (its rows × (the longest row + max_new_tokens),
the padded cache it may grow to; a batch of one row always runs), and kept caches get what the running batch
leaves, the least recently used dropped first. Out of memory in a step puts its rows back with their replies
so far and halves the rows a step may run (and the budget); each doubles back after
`generation.caps_grow_back_steps` steps that did not run out of memory. Continuous batching
(`generation.local_batching: continuous`) means an episode waiting on its opponent's search holds up no other
episode's reply; `wave` keeps the old barrier for comparison: a batch starts only when every live episode has
asked and runs until its last row ends.

Rows sit right-aligned in one padded batch ([left padding | row's tokens], an attention mask hides
the padding; positions are each row's own). Draws come from `sampling.sample_tokens`, keyed by the
request's seed and the token's index, so a request gets the same tokens whatever it is batched
with, in float32 on CPU: a seeded run repeats itself, except where two tokens' scores tie within the
float noise that a different batch width adds (~1e-6). In bf16 on a GPU batch width, padding, kernel
choice and the timing of joins move logits by ~1e-2, so near-ties flip: the draws are the same in
distribution, not token for token. A rollout switches the model to eval mode once and,
unless the model is 4-bit, runs it with the LoRA adapter added into a copy of each adapted weight
(`generation.fold_adapter`): one matmul per adapted layer instead of three, which is most of the
kernel launches of a decode step; the trained weights are never touched. Only float32 weights are folded: in
bfloat16 W + ΔW rounds to W's 8-bit mantissa and a small ΔW is mostly lost (bench/fold_gap.py measured the
sampler's log-prob gap several times larger folded), so there the adapter path runs. Each reply token comes with
its log-prob under the distribution it was drawn from, which the trainer compares with its own scores.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ppo_affine.architectures import (append_cache_rows, keep_cache_columns, kv_reuse_across_turns,
                                      one_mask_serves_every_layer, select_cache_rows, switched_off)
from ppo_affine.config import GenerationConfig
from ppo_affine.decode_caches import DecodeCaches, EpisodeCache, free_memory_bytes, last_index, message_start_id
from ppo_affine.seeds import derive_seed
from ppo_affine.generation import Generation, closes_fence, eos_token_ids
from ppo_affine.memory_plan import kv_bytes_per_token
from ppo_affine.phase_costs import GenerationTime
from ppo_affine.policy import kv_cache_keyword
from ppo_affine.sampling import draw_keys, sample_tokens

log = logging.getLogger(__name__)

# Joining a running batch costs a forward call of its own (a prefill), as much as a decode step when kernel
# launches bound the model. So while rows decode, requests join once they are at least as many as the running
# rows (the call advances as many replies as a decode step does) or the oldest has waited this many steps.
JOIN_WAIT_STEPS = 4.0


def decode_bias_dtype(model) -> torch.dtype | None:
    """The dtype of the additive mask a decode step can hand the model ready-made, or None where it cannot.

    Given a 2D padding mask, transformers builds a boolean 4D mask at every forward call (~15 operations) and
    SDPA turns it into an additive one in every layer (3 operations a layer: 90 of SmolLM2's 2 360 per decode
    step, each a kernel launch on a GPU). A 4D mask is used as it comes, so a decode step passes the additive
    mask itself, kept from step to step by appending a column. Only where one mask serves every layer (no
    sliding window) and the attention takes a tensor mask (SDPA, eager): not flash-attention's kernels."""
    config = model.config.get_text_config()
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager") or not one_mask_serves_every_layer(
            model.config):
        return None
    return model.get_input_embeddings().weight.dtype  # the hidden states', so the queries' dtype


@dataclass
class Request:
    key: int  # the episode's place in the step's batch
    prompt: list[int]
    seed: int
    future: asyncio.Future
    reply: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each reply token's, from the distribution it was drawn from
    arrived: float = field(default_factory=time.monotonic)
    # (length, linear-attention states after prompt[:length]) kept at the prompt's last message boundary
    boundary: tuple[int, dict] | None = None

    @property
    def fed(self) -> list[int]:
        """The tokens a prefill feeds: the prompt, and the reply so far of a row that rejoins after running out
        of memory (its last token sampled, not yet fed)."""
        return self.prompt + self.reply

    def resolve(self, result: Generation | BaseException) -> None:
        if self.future.done():
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)


@dataclass
class Running:
    """The decode batch: row r is requests[r]; its tokens sit right-aligned in the cache's columns."""
    requests: list[Request]
    cache: Any  # a transformers DynamicCache, [rows, heads, width, dim] per layer
    mask: torch.Tensor  # [rows, width] 1 where a column holds the row's token
    positions: torch.Tensor  # [rows] position of the token each row feeds next
    next_tokens: torch.Tensor  # [rows] the token each row feeds next (its last sampled one)
    next_logprobs: torch.Tensor  # [rows] float64: that token's log-prob where it was sampled
    # [rows, 1, 1, width]: the mask as the attention adds it (0 on the row's columns, -inf on padding); kept from
    # one decode step to the next, None after the batch's rows or columns changed (see decode_bias_dtype)
    bias: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.mask.shape[1]


@dataclass
class StagedDecode:
    """What a decode step needs from the host, on the device before the step's first kernel."""
    ones: torch.Tensor  # [rows, 1] the mask's new column
    cache_position: torch.Tensor  # [1]
    keys: torch.Tensor  # [rows] the draws' keys


@dataclass
class StagedPrefill:
    """What the joining rows' prefill needs from the host, on the device before the step's first kernel: their
    padded new tokens, positions and mask ([left padding | kept prefix | left padding | new tokens]), and the
    prefixes shared by fresh rows, each run once before the prefill (`shared`: the rows, the prefix's ids, and
    those ids on the device [1, n])."""
    requests: list[Request]
    reuse: list[int]  # leading prompt tokens each row takes from a kept or shared cache
    kept: list[EpisodeCache | None]  # each row's kept cache, held here so that no eviction takes it mid-step
    input_ids: torch.Tensor  # [rows, new width]
    positions: torch.Tensor  # [rows, new width]
    mask: torch.Tensor  # [rows, cached width + new width]
    cache_position: torch.Tensor  # [new width]
    next_positions: torch.Tensor  # [rows]
    keys: torch.Tensor  # [rows]
    shared: list[tuple[list[int], list[int], torch.Tensor]]
    # a linear-attention model's rows whose states are kept at their prompt's last message boundary, which sits at
    # this column of the new tokens in each of them (None: no row)
    boundary_column: int | None = None
    boundary_rows: list[int] = field(default_factory=list)

    @property
    def cached_width(self) -> int:
        return max(self.reuse)


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
            quantised = hasattr(base.weight, "quant_state") or not base.weight.is_floating_point()  # bnb 4/8-bit
            if layer.disable_adapters or layer.merged or not isinstance(base, torch.nn.Linear) or quantised:
                return None
        return layers

    @staticmethod
    def keeps_the_delta(layers: list) -> bool:
        """Whether W + ΔW held in the weights' dtype keeps ΔW: float32 does (to float noise); bfloat16 rounds away
        most of a small delta (a LoRA B of 1e-4 keeps ~26 % of it), float16 a good part."""
        return all(layer.get_base_layer().weight.dtype == torch.float32 for layer in layers)

    def __enter__(self) -> "FoldedAdapter":
        layers = self.foldable_layers(self.model)
        if layers is None:
            raise ValueError("the adapter cannot be folded here")
        try:
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
        except BaseException:  # a half-folded model would add the delta twice once the adapter path is back on
            self._restore_weights()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._adapter_off.__exit__(*exc)
        finally:
            self._restore_weights()

    def _restore_weights(self) -> None:
        for base, original in self.swapped:
            base.weight.data = original
        self.swapped.clear()


class LocalGenerator:
    """The training model's replies, one request per episode turn, served by a decode loop on the event loop."""

    def __init__(self, policy, gen_cfg: GenerationConfig, seed: int):
        self.policy = policy
        self.cfg = gen_cfg
        self.seed = seed
        self.tokenizer = policy.tokenizer
        self.eos_ids = eos_token_ids(self.tokenizer, policy.model.generation_config)
        # the tokens that can complete a fence: only a reply that just sampled one is decoded to count its fences
        self.fence_ids = ({i for token, i in self.tokenizer.get_vocab().items() if "`" in token}
                          if gen_cfg.stop_at_closing_fence else set())
        self.reuse_cache = gen_cfg.reuse_kv_cache and not switched_off(
            policy.model.config, "generation.reuse_kv_cache", kv_reuse_across_turns(policy.model.config))
        self.continuous = gen_cfg.local_batching == "continuous"
        self._cache_name = kv_cache_keyword()
        self._bias_dtype = decode_bias_dtype(policy.model)
        self._vocab = policy.model.config.get_text_config().vocab_size  # the logits' width
        self.live_episodes = 0
        self._pending: list[Request] = []
        # what a token of this model's cache takes, and a row's fixed share (a linear-attention state)
        per_token, per_row = kv_bytes_per_token(policy.model.config, self._cache_element_bytes(policy.model))
        self.caches = DecodeCaches(gen_cfg.kv_cache_budget, per_token, per_row, self.reuse_cache, policy.model.config)
        if self.caches.exact_prefix_only:  # states are kept where the prompt's last message ends
            self.caches.message_start = message_start_id(self.tokenizer)
        self._prefilled_before_rollout = 0
        self.row_cap: int | None = None  # the most rows a step runs, set after running out of memory
        self._uncapped_rows = 0  # the rows a step ran out of memory with before any cap: the cap lifts there
        self.clean_steps = 0  # steps in a row without running out of memory, since the caps last changed
        self.out_of_memory_retries = 0
        self._running: Running | None = None
        self._work: asyncio.Event | None = None  # set when something may let a step start
        self._engine: asyncio.Task | None = None
        self._in_flight: asyncio.Future | None = None  # the step the device (or a thread) is working on
        self.generated_tokens = 0
        self._generated_before_rollout = 0
        self.time = GenerationTime()  # this rollout's prefill, decode and step seconds
        self.prefilled_tokens = 0  # prompt tokens run through the model (the rest came from caches)
        self.prompt_tokens = 0
        self.forward_calls = 0  # prefill and decode steps: what a GPU would run as kernels
        self._step_seconds = 0.005  # a moving average of a step's time
        self._said_why_unfolded = False

    # ------------------------------------------------------------------ the episodes' side
    def episode_started(self) -> None:
        self.live_episodes += 1

    def episode_finished(self, order_key: int | None = None) -> None:
        self.live_episodes -= 1
        self.caches.forget(order_key)
        self._wake()

    async def generate(self, prompt_ids: list[int], order_key: int, seed: int) -> Generation:
        loop = asyncio.get_running_loop()
        if self._engine is None or self._engine.done() or self._engine.get_loop() is not loop:
            # a new event loop (e.g. a second asyncio.run) needs its own event and engine task
            self._work, self._running = asyncio.Event(), None
            self._engine = loop.create_task(self._serve())
        # the run's seed goes into every draw, beside the turn's own seed
        request = Request(order_key, list(prompt_ids), derive_seed(self.seed, seed), loop.create_future())
        self._pending.append(request)
        self._wake()
        return await request.future

    @staticmethod
    def _cache_element_bytes(model) -> int:
        """Bytes of one cached key or value: the hidden states' dtype, the input embeddings' (float32 under 4-bit,
        where the k-bit preparation keeps activations in float32)."""
        return model.get_input_embeddings().weight.element_size()

    def budget(self) -> int:
        """`generation.kv_cache_budget` in tokens; by default half of the device's free memory when first asked."""
        return self.caches.budget(lambda: free_memory_bytes(self.policy.device))

    # the caches' readings, under the names the loop's callers and tests know
    @property
    def cache_budget(self) -> int | None:
        return self.caches.budget_tokens

    @property
    def cache_bytes_per_token(self) -> float:
        return self.caches.bytes_per_token

    @property
    def evicted_caches(self) -> int:
        return self.caches.evicted

    @property
    def steps_held_back(self) -> int:
        return self.caches.steps_held_back

    @property
    def cache_tokens(self) -> int:
        return self.caches.held_tokens

    @property
    def peak_cache_tokens(self) -> int:
        return self.caches.peak_tokens

    @property
    def _caches(self):
        return self.caches.kept

    def memory_metrics(self) -> dict[str, float]:
        """The budget's readings over the last rollout, for the step's metrics: under perf/, as they depend on the
        device's free memory (the default budget), not on what was learned."""
        return {"perf/kv_budget_tokens": float(self.budget()), "perf/kv_peak_tokens": float(self.peak_cache_tokens),
                "perf/kv_evicted_caches": float(self.evicted_caches),
                "perf/kv_steps_held_back": float(self.steps_held_back),
                "perf/out_of_memory_retries": float(self.out_of_memory_retries),
                "perf/prefill_tokens": float(self.prefilled_tokens - self._prefilled_before_rollout),
                "perf/generated_tokens": float(self.generated_tokens - self._generated_before_rollout),
                **self.time.metrics(),
                **({"perf/prefix_break_rate": self.prefix_break_rate()} if self.caches.exact_prefix_only else {})}

    def prefix_break_rate(self) -> float:
        """Of this rollout's turns that had a kept linear-attention state, the share whose prompt did not begin with
        the tokens it folded in (prefilled whole)."""
        asked = self.caches.continued + self.caches.broken
        return self.caches.broken / asked if asked else 0.0

    def _running_tokens(self, rows: int, width: int) -> int:
        return self.caches.running_tokens(rows, width)

    @contextlib.asynccontextmanager
    async def rollout(self, step: int):
        """One batch of episodes: the model in eval mode (and the adapter folded) from start to end, no kept
        cache outliving its episodes; on exit (also when cancelled) no step is left running on the model."""
        self.caches.start_rollout()
        self.out_of_memory_retries = 0
        self._prefilled_before_rollout = self.prefilled_tokens
        self._generated_before_rollout = self.generated_tokens
        self.time = GenerationTime()
        with contextlib.ExitStack() as held:
            held.enter_context(self.policy.evaluating())
            if self.folds_adapter():
                held.enter_context(FoldedAdapter(self.policy.model))
            try:
                yield
            finally:
                await self._stop_engine()
                self.caches.clear()

    def folds_adapter(self) -> bool:
        """Whether rollouts fold the adapter: asked for, foldable, and in weights that keep the delta."""
        layers = FoldedAdapter.foldable_layers(self.policy.model)
        if not self.cfg.fold_adapter or layers is None:
            return False
        if not FoldedAdapter.keeps_the_delta(layers):
            if not self._said_why_unfolded:
                self._said_why_unfolded = True
                log.info("generation.fold_adapter: the adapter path runs (the weights are %s, in which W + ΔW loses "
                         "most of a small ΔW)", layers[0].get_base_layer().weight.dtype)
            return False
        return True

    def folded_copy_bytes(self) -> int:
        """What a rollout holds beside the weights for a folded adapter: a copy of each weight it adapts (0: no fold)."""
        if not self.folds_adapter():
            return 0
        weights = [layer.get_base_layer().weight for layer in FoldedAdapter.foldable_layers(self.policy.model)]
        return sum(weight.numel() * weight.element_size() for weight in weights)

    async def close(self) -> None:
        await self._stop_engine()
        self.caches.clear()

    async def _stop_engine(self) -> None:
        """Cancel what is queued or decoding; a step in flight finishes on the device first."""
        engine, self._engine = self._engine, None
        if engine is not None and engine.get_loop() is asyncio.get_running_loop():
            engine.cancel()
            await asyncio.gather(engine, return_exceptions=True)
        if self._in_flight is not None:  # a thread still computing on the model: it must end before the model changes
            await asyncio.gather(self._in_flight, return_exceptions=True)
            self._in_flight = None
        for request in self._pending + (self._running.requests if self._running else []):
            request.resolve(asyncio.CancelledError())
        self._pending, self._running = [], None

    def _wake(self) -> None:
        if self._work is not None:
            self._work.set()

    # ------------------------------------------------------------------ the decode loop
    async def _wait_for_work(self) -> None:
        """Wait until a step is due. A running batch steps at once. An idle loop starts when every live episode
        has asked (always so for `wave`); under `continuous` also once its first request has waited half a
        step's time: episodes whose env steps end a moment apart start together, an episode away on a long
        search holds up nobody."""
        while True:
            if self._running is not None:
                return
            if self._pending and self._running is None:
                if len(self._pending) >= self.live_episodes:
                    return
                if self.continuous:
                    left = 0.5 * self._step_seconds - (time.monotonic() - self._pending[0].arrived)
                    if left <= 0:
                        return
                    self._work.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._work.wait(), left)
                    continue
            self._work.clear()
            await self._work.wait()

    def _joining(self) -> list[Request]:
        """The requests that join this step, in episode order (see JOIN_WAIT_STEPS), as many as `row_cap` and the
        budget let in (the earliest first)."""
        if not self._pending:
            return []
        running_rows = len(self._running.requests) if self._running is not None else 0
        if self._running is None:
            due = self.continuous or len(self._pending) >= self.live_episodes
        else:
            waited = time.monotonic() - self._pending[0].arrived
            due = self.continuous and (len(self._pending) >= len(self._running.requests)
                                       or waited >= JOIN_WAIT_STEPS * self._step_seconds)
        if not due:
            return []
        room = len(self._pending) if self.row_cap is None else self.row_cap - running_rows
        room = min(room, self._room_in_budget())
        if room <= 0:
            return []
        joining, self._pending = self._pending[:room], self._pending[room:]
        return sorted(joining, key=lambda r: r.key)

    def _room_in_budget(self) -> int:
        """How many of the waiting requests (the earliest first) can join: while the running batch with them, at
        its padded width + max_new_tokens (the cache it may grow to), fits the budget. A batch with no row takes
        one whatever its size: it must run."""
        rows = len(self._running.requests) if self._running is not None else 0
        budget, room = self.budget(), 0
        for joined in self._widths_as_they_join(self._pending):
            if rows + room and self._running_tokens(rows + room + 1, joined + self.cfg.max_new_tokens) > budget:
                self.caches.steps_held_back += 1
                break
            room += 1
        return room

    def _width_with(self, joining: list[Request]) -> int:
        """The running batch's width once `joining` joins it."""
        running = self._running.width if self._running is not None else 0
        return max([running, *self._widths_as_they_join(joining)])

    def _widths_as_they_join(self, requests: list[Request]):
        """The running batch's width after each of `requests` in turn joins it (see DecodeCaches)."""
        return self.caches.widths_as_they_join(self._running.width if self._running is not None else 0, requests)

    async def _serve(self) -> None:
        while True:
            # Let every episode that is ready to run (its reply just came, its env step needs no wait) take its
            # turn and ask first: they then join together, one prefill call rather than one each.
            await asyncio.sleep(0)
            await self._wait_for_work()
            joining = self._joining()
            self._fit_kept_caches(joining)  # here, on the loop: a CPU step runs in a thread
            started = time.monotonic()
            try:
                if self.launches_inline():  # launch on the loop; the one wait for the device goes to a thread
                    with torch.no_grad():
                        tokens = self._launch_step(joining)
                    self._in_flight = asyncio.ensure_future(asyncio.to_thread(self._device_values, tokens))
                else:  # a CPU model computes while it "launches": all of it off the loop, so the episodes go on
                    self._in_flight = asyncio.ensure_future(asyncio.to_thread(self._compute_step, joining))
                values = await asyncio.shield(self._in_flight)
                self._in_flight = None
                self._finish_step(values)
                self._grow_caps_back()
            except asyncio.CancelledError:
                raise
            except torch.OutOfMemoryError as exc:
                self._in_flight = None
                self._recover_from_running_out_of_memory(joining, exc)
            except Exception as exc:  # the failure goes to every request in the step; the loop goes on
                log.warning("local generation failed: %s", exc)
                for request in joining + (self._running.requests if self._running else []):
                    request.resolve(exc)
                self._running = None
            took = time.monotonic() - started
            self.time.step_seconds += took
            self._step_seconds = 0.8 * self._step_seconds + 0.2 * took

    def _recover_from_running_out_of_memory(self, joining: list[Request], exc: BaseException) -> None:
        """Out of memory in a step: the kept caches are dropped, the budget halved to half of what the step held
        (running batch and kept caches), the step's rows go back to waiting with their replies so far, and at most
        half of them decode at once from now on (each rejoins with a prefill of its prompt and reply, drawing the
        tokens it would have drawn). A step of one row that runs out of memory fails that row's request."""
        running = self._running
        rows = (running.requests if running is not None else []) + joining
        held = self.caches.kept_tokens() + (self._running_tokens(len(running.requests), running.width) if running
                                            else 0)
        self._running = None
        self.budget()  # the default budget is set before it is halved
        self.caches.halve_budget(held)
        self.clean_steps = 0
        if len(rows) <= 1:
            log.warning("local generation ran out of memory on a single row: %s", exc)
            for request in rows:
                request.resolve(exc)
            return
        self._uncapped_rows = self._uncapped_rows if self.row_cap is not None else len(rows)
        self.row_cap = len(rows) // 2
        self.out_of_memory_retries += 1
        log.warning("local generation ran out of memory with %d rows: the kept caches are dropped (budget %s "
                    "tokens) and at most %d rows decode at once from now on", len(rows), self.cache_budget,
                    self.row_cap)
        self._pending = sorted(rows, key=lambda r: r.key) + self._pending

    def _grow_caps_back(self) -> None:
        """After `caps_grow_back_steps` steps in a row that did not run out of memory, the row cap and the budget
        each double back, up to where they were (the row cap lifts at the rows that ran out uncapped)."""
        if self.row_cap is None and self.caches.full_budget is None:
            return
        self.clean_steps += 1
        if self.clean_steps < self.cfg.caps_grow_back_steps:
            return
        self.clean_steps = 0
        if self.row_cap is not None:
            self.row_cap = 2 * self.row_cap if 2 * self.row_cap < self._uncapped_rows else None
        self.caches.grow_budget_back()
        log.info("local generation: %d steps without running out of memory, the caps grow back: at most %s rows a "
                 "step, budget %d tokens", self.cfg.caps_grow_back_steps,
                 self.row_cap if self.row_cap is not None else "any", self.budget())

    def launches_inline(self) -> bool:
        """Whether a step's forward call only launches work on an accelerator (it then runs on the event loop,
        which needs no lock), or computes on this machine's cores (it then runs in a thread)."""
        return self.policy.device.type != "cpu"

    def _compute_step(self, joining: list[Request]) -> list[int]:
        with torch.no_grad():
            return self._device_values(self._launch_step(joining))

    def _device_values(self, sampled: torch.Tensor) -> list[list[float]]:
        """The sampled ids and their log-probs on the host, [[ids], [log-probs]]: waits for the device to finish the
        step (bench/ stands in its time here)."""
        return sampled.tolist()

    def _choose(self, logits: torch.Tensor, requests: list[Request], keys: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token of each row and its log-prob, drawn with the staged `keys` (bench/ replaces this with a
        scripted player)."""
        return sample_tokens(logits, keys, self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)

    def _draw_keys(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """Each row's draw is keyed by its request's seed and the index of the token it samples next."""
        return draw_keys([r.seed for r in requests], [len(r.reply) for r in requests], self._vocab, device)

    def _launch_step(self, joining: list[Request]) -> torch.Tensor:
        """A decode step of the running rows (each feeds its last sampled token), and a prefill of the joining
        rows (the prompt tokens their episode's kept cache lacks), which then join the running batch; returns
        the next token of every running row and its log-prob, [2, rows] float64 (one copy to the host, ids exact
        below 2**53), still on the device. Joining rows get a forward call of their own: in one padded batch
        their new columns would be padding for every other row until it ends.

        Everything both calls need from the host is staged first: a copy from the host waits for the kernels
        queued before it (PyTorch synchronises the stream), so one made after the first launch would hold the
        event loop until the device had run the forward (tests/test_generation.py records the order on CPU)."""
        decode = self._stage_decode() if self._running is not None else None
        prefills = self._stage_prefills(joining) if joining else []
        started = time.perf_counter()
        if decode is not None:
            self._decode_step(decode)
            self.time.decode_tokens += len(self._running.requests)
        decoded = time.perf_counter()
        for prefill in prefills:
            self._merge(self._prefill(prefill))
            self.time.prefill_rows += len(prefill.requests)
        self.time.decode_seconds += decoded - started
        self.time.prefill_seconds += time.perf_counter() - decoded
        return torch.stack([self._running.next_tokens.double(), self._running.next_logprobs])

    def _forward_in_chunks(self, input_ids, mask, positions, cache, cache_position, split: int | None = None,
                           at_split=None):
        """A prefill of `input_ids` [rows, new width] as forward calls of at most `prefill_chunk_tokens` columns,
        each continuing the cache the last one left (a chunk's 2D mask covers the cached columns and the chunk's own):
        transformers builds a [rows, 1, chunk, columns so far] mask, never [rows, 1, new, new]. The chunks are views of
        the staged tensors: no copy from the host. `mask`, `positions` and `cache_position` may be None (a shared
        prefix of one row with no padding: transformers counts positions from the cache). A call also ends at column
        `split`, after which `at_split(cache)` runs (states kept at a message boundary)."""
        chunk, width = self.cfg.prefill_chunk_tokens, input_ids.shape[1]
        cached = mask.shape[1] - width if mask is not None else 0
        ends = sorted(set(range(chunk, width, chunk)) | {width} | ({split} if split else set()))
        start = 0
        for end in ends:
            logits, cache = self._forward(input_ids[:, start:end], None if mask is None else mask[:, :cached + end],
                                          None if positions is None else positions[:, start:end], cache,
                                          None if cache_position is None else cache_position[start:end])
            if end == split:
                at_split(cache)
            start = end
        return logits, cache

    def _forward(self, input_ids, mask, positions, cache, cache_position: torch.Tensor | None):
        self.forward_calls += 1
        out = self.policy.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                cache_position=cache_position, use_cache=True, logits_to_keep=1,
                                **{self._cache_name: cache})
        return out.logits[:, -1], getattr(out, self._cache_name)

    def _stage_decode(self) -> StagedDecode:
        running = self._running
        device = running.mask.device
        return StagedDecode(ones=torch.ones((len(running.requests), 1), dtype=torch.long, device=device),
                            cache_position=torch.arange(running.width, running.width + 1, device=device),
                            keys=self._draw_keys(running.requests, device))

    def _decode_step(self, staged: StagedDecode) -> None:
        running = self._running
        mask = torch.cat([running.mask, staged.ones], dim=1)
        attention = mask
        if self._bias_dtype is not None:
            if running.bias is None:  # -inf, as SDPA's own conversion of a boolean mask, so the scores are the same
                running.bias = running.mask.new_zeros(running.mask.shape, dtype=self._bias_dtype)
                running.bias.masked_fill_(running.mask == 0, float("-inf"))
                running.bias = running.bias[:, None, None, :]
            running.bias = attention = torch.cat([running.bias, running.bias.new_zeros(staged.ones.shape)[:, None, None]],
                                                 dim=-1)
        logits, running.cache = self._forward(running.next_tokens[:, None], attention, running.positions[:, None],
                                              running.cache, staged.cache_position)
        running.mask, running.positions = mask, running.positions + 1
        running.next_tokens, running.next_logprobs = self._choose(logits, running.requests, staged.keys)

    def _stage_prefills(self, joining: list[Request]) -> list[StagedPrefill]:
        """The joining rows' inputs: one padded prefill, or for a linear-attention model one of the fresh rows and
        one for each row that continues a kept state (no padding may sit between a state and its new tokens)."""
        reuse, kept, shared = self.caches.reused_lengths(joining)
        if not self.caches.exact_prefix_only:
            return [self._stage_prefill(joining, reuse, kept, shared)]
        fresh = [row for row, n in enumerate(reuse) if n == 0]
        groups = ([fresh] if fresh else []) + [[row] for row, n in enumerate(reuse) if n]
        return [self._stage_prefill([joining[r] for r in group], [reuse[r] for r in group], [kept[r] for r in group],
                                    []) for group in groups]

    def _stage_prefill(self, joining: list[Request], reuse: list[int], kept: list[EpisodeCache | None],
                       shared: list[tuple[list[int], list[int]]]) -> StagedPrefill:
        """The joining rows' inputs, built on the host and copied to the device in one go each."""
        device = self.policy.device
        cached_width = max(reuse)
        new_width = max(len(r.fed) - n for r, n in zip(joining, reuse))
        width = cached_width + new_width
        input_ids = torch.full((len(joining), new_width), self.tokenizer.pad_token_id, dtype=torch.long)
        positions = torch.zeros((len(joining), new_width), dtype=torch.long)
        mask = torch.zeros((len(joining), width), dtype=torch.long)
        for row, (request, n) in enumerate(zip(joining, reuse)):
            fed = request.fed
            fresh = len(fed) - n
            input_ids[row, new_width - fresh:] = torch.tensor(fed[n:], dtype=torch.long)
            positions[row, new_width - fresh:] = torch.arange(n, len(fed))
            mask[row, cached_width - n: cached_width] = 1
            mask[row, width - fresh:] = 1
        return StagedPrefill(
            list(joining), reuse, kept, input_ids.to(device), positions.to(device), mask.to(device),
            cache_position=torch.arange(cached_width, width, device=device),
            next_positions=torch.tensor([len(r.fed) for r in joining], dtype=torch.long, device=device),
            keys=self._draw_keys(joining, device),
            shared=[(rows, prefix, torch.tensor([prefix], device=device)) for rows, prefix in shared],
            **self.caches.boundary_rows(joining, reuse, new_width))

    def _prefill(self, staged: StagedPrefill) -> Running:
        """The joining rows' forward call, after the prefixes fresh rows share have run once."""
        joining, reuse, caches = staged.requests, staged.reuse, list(staged.kept)
        for rows, prefix, prefix_ids in staged.shared:
            shared = self._run_shared_prefix(prefix, prefix_ids)
            for row in rows:
                caches[row] = shared
        self.prompt_tokens += sum(len(r.prompt) for r in joining)
        self.prefilled_tokens += sum(len(r.fed) - n for r, n in zip(joining, reuse))
        if not staged.cached_width:
            cache = None
        elif self.caches.exact_prefix_only:  # a row of its own, continuing its kept state
            cache = self.caches.continuing_cache(caches[0], reuse[0])
        else:
            cache = self.caches.joining_cache(caches, reuse, staged.cached_width)

        def keep_boundary_states(cache) -> None:
            for row in staged.boundary_rows:
                request = joining[row]
                length = last_index(request.prompt, self.caches.message_start)
                request.boundary = (length, self.caches.states_of_row(cache, row))

        logits, cache = self._forward_in_chunks(staged.input_ids, staged.mask, staged.positions, cache,
                                                staged.cache_position, staged.boundary_column, keep_boundary_states)
        return Running(list(joining), cache, staged.mask, staged.next_positions,
                       *self._choose(logits, joining, staged.keys))

    def _merge(self, joining: Running) -> None:
        """Append the joining rows to the running batch, both right-aligned to the wider of the two."""
        running = self._running
        if running is None:
            self._running = joining
            return
        width = max(running.width, joining.width)
        append_cache_rows(running.cache, joining.cache, width, _left_pad)
        running.requests, running.bias = running.requests + joining.requests, None
        running.mask = torch.cat([_left_pad(running.mask, width, dim=1), _left_pad(joining.mask, width, dim=1)])
        running.positions = torch.cat([running.positions, joining.positions])
        running.next_tokens = torch.cat([running.next_tokens, joining.next_tokens])
        running.next_logprobs = torch.cat([running.next_logprobs, joining.next_logprobs])

    def _finish_step(self, sampled: list[list[float]]) -> None:
        running = self._running
        for request in running.requests:  # the batch holds these keys/values now; a new cache is kept at the end
            self.caches.forget(request.key)
        self.caches.note_held(self._running_tokens(len(running.requests), running.width))
        tokens, logprobs = sampled
        for request, token, logprob in zip(self._running.requests, tokens, logprobs):
            request.reply.append(int(token))
            request.logprobs.append(logprob)
        self.generated_tokens += len(tokens)
        self._retire_finished()

    def _finished(self, request: Request) -> bool:
        last = request.reply[-1]
        if last in self.eos_ids or len(request.reply) >= self.cfg.max_new_tokens:
            return True
        return last in self.fence_ids and closes_fence(self.tokenizer.decode(request.reply, skip_special_tokens=True))

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
            request.resolve(Generation(list(request.reply), list(request.logprobs)))
        keep = [row for row in range(len(running.requests)) if row not in set(done)]
        if not keep:
            self._running = None
            return
        index = torch.tensor(keep, device=running.mask.device)
        select_cache_rows(running.cache, index)
        running.requests, running.bias = [running.requests[row] for row in keep], None
        running.mask, running.positions = running.mask[index], running.positions[index]
        running.next_tokens, running.next_logprobs = running.next_tokens[index], running.next_logprobs[index]
        used = running.mask.any(dim=0)
        if int(used.sum()) < used.numel() // 2:  # mostly padding: keep only the columns some row uses
            columns = used.nonzero().squeeze(-1)
            running.mask = running.mask.index_select(1, columns)
            keep_cache_columns(running.cache, columns)

    def _keep_cache(self, running: Running, row: int) -> None:
        """The row's keys/values of prompt + reply (all but the last reply token, which was never fed)."""
        request = running.requests[row]
        self._remember(request.key, self.caches.kept_from(running.cache, running.mask, row,
                                                          request.prompt + request.reply[:-1], request.boundary))

    def _remember(self, key: int, cache: EpisodeCache) -> None:
        """Keep an episode's cache as the most recently used, then drop the least recently used ones past what
        the running batch leaves of the budget; a dropped episode's next turn is prefilled from its tokens."""
        self.caches.remember(key, cache)
        self._fit_kept_caches()

    def _fit_kept_caches(self, joining: list[Request] = ()) -> None:
        """Fit the kept caches in what the running batch, with `joining` in it, leaves of the budget (never
        dropping a joining row's own)."""
        rows = (len(self._running.requests) if self._running is not None else 0) + len(joining)
        room = self.budget() - (self._running_tokens(rows, self._width_with(joining)) if rows else 0)
        self.caches.fit(room, {request.key for request in joining})

    def _run_shared_prefix(self, prefix: list[int], prefix_ids: torch.Tensor) -> EpisodeCache:
        """One forward call over a prefix some joining rows share (`prefix_ids`: its ids on the device, [1, n]); its
        keys/values are each one's cache for this prefill."""
        _, cache = self._forward_in_chunks(prefix_ids, None, None, None, None)
        self.prefilled_tokens += len(prefix)  # once; each row's rest is counted with its prefill
        return self.caches.of_prefix(cache, prefix)


def _left_pad(tensor: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """`tensor` with zeros added before its columns along `dim` up to `width`."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
