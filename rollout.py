"""Rollouts: play many episodes concurrently, keeping the exact token ids the policy generated.

Each turn builds the chat messages under a context strategy, turns them into prompt token ids
with the model's own chat template, asks a generator for the reply and sends the reply text to
the env. Generators:
- `LocalGenerator`: the training model; requests from all live episodes are batched into one
  `generate` call per wave (a wave = every live episode waiting for its next reply), which also
  makes sampling independent of thread timing, so a seeded run is reproducible.
- `VLLMGenerator`: an OpenAI-compatible vLLM server with LoRA adapters hot-loaded after updates.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import torch

from curriculum import Task
from envs.base import Env, StepResult
from utils import GenerationConfig

log = logging.getLogger(__name__)

THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
THINKING_MARKER = "<think>[earlier reasoning omitted]</think>"


def derive_seed(*parts: Any) -> int:
    """A stable 32-bit seed from any printable parts (not Python's salted hash)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "big")


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float] | None = None  # the sampler's own log-probs (vLLM), for the gap metric


@dataclass
class Turn:
    prompt_ids: list[int]
    response_ids: list[int]
    response_text: str
    sampler_logprobs: list[float] | None
    reward: float = 0.0  # non-final env reward earned by this turn (the final score is the episode's)
    parse_error: bool = False


@dataclass
class Episode:
    task: Task
    env_kind: str
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    score: float = 0.0
    success: bool = False
    done: bool = False
    cut_off: bool = False  # hit generation.max_turns
    error: str | None = None
    game_name: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.turns)

    @property
    def illegal_moves(self) -> int:
        return sum(t.parse_error for t in self.turns)


# ---------------------------------------------------------------------- context strategies
def build_messages(
    messages: list[dict[str, str]], decision_start: int, strategy: str, turn_prompt: str | None
) -> list[dict[str, str]]:
    """The messages the model sees now. `decision_start` indexes the user message of the pending decision."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    if strategy == "last":
        current = list(messages[decision_start:])
        if turn_prompt:
            current[0] = {"role": "user", "content": turn_prompt}
        return system + current
    if strategy == "truncated":
        return [
            {"role": "assistant", "content": THINK_BLOCK.sub(THINKING_MARKER, m["content"])}
            if m["role"] == "assistant" and i < decision_start
            else m
            for i, m in enumerate(messages)
        ]
    return list(messages)


class PromptBuilder:
    """Chat messages -> prompt token ids with the model's chat template, within a token budget."""

    def __init__(self, tokenizer, max_prompt_tokens: int, chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.chat_template_kwargs = chat_template_kwargs or {}

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **self.chat_template_kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def fit(self, messages: list[dict[str, str]], keep_from: int) -> list[int] | None:
        """Drop the oldest turns (never the system message or the pending decision) until it fits."""
        ids = self.encode(messages)
        first = 1 if messages and messages[0]["role"] == "system" else 0
        while len(ids) > self.max_prompt_tokens and keep_from > first:
            drop = 2 if keep_from - first >= 2 else 1
            messages = messages[:first] + messages[first + drop :]
            keep_from -= drop
            ids = self.encode(messages)
        return ids if len(ids) <= self.max_prompt_tokens else None


# ---------------------------------------------------------------------- generators
def _cut_at_eos(token_ids: list[int], eos_ids: set[int]) -> list[int]:
    """Generated ids up to and including the first end-of-sequence token (the padding after it goes)."""
    for position, token in enumerate(token_ids):
        if token in eos_ids:
            return token_ids[: position + 1]
    return token_ids


class LocalGenerator:
    """Batched `generate` with the training model, one call per wave of pending turns."""

    def __init__(self, policy, gen_cfg: GenerationConfig, seed: int):
        self.policy = policy
        self.cfg = gen_cfg
        self.seed = seed
        self.tokenizer = policy.tokenizer
        eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        gen_eos = getattr(policy.model.generation_config, "eos_token_id", None)
        if gen_eos is not None:
            self.eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.seed_base = derive_seed(seed, "generate", 0)
        self.live_episodes = 0
        self._pending: list[tuple[int, list[int], asyncio.Future]] = []
        self._wave_ready = asyncio.Event()
        self._waves = 0
        self._worker: asyncio.Task | None = None
        self.generated_tokens = 0

    def episode_started(self) -> None:
        self.live_episodes += 1

    def episode_finished(self) -> None:
        self.live_episodes -= 1
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self._pending and len(self._pending) >= self.live_episodes:
            self._wave_ready.set()

    async def generate(self, prompt_ids: list[int], order_key: int, seed: int) -> Generation:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            # a new event loop (e.g. a second asyncio.run) needs its own event and worker
            self._wave_ready = asyncio.Event()
            self._worker = loop.create_task(self._run_waves())
        future = asyncio.get_running_loop().create_future()
        self._pending.append((order_key, prompt_ids, future))
        self._maybe_release()
        return await future

    async def _run_waves(self) -> None:
        while True:
            await self._wave_ready.wait()
            self._wave_ready.clear()
            wave, self._pending = sorted(self._pending, key=lambda p: p[0]), []
            self._waves += 1
            try:
                outputs = await asyncio.to_thread(self._generate_batch, [p[1] for p in wave], self._waves)
            except Exception as exc:  # hand the failure to every waiting episode
                for _, _, future in wave:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, _, future), tokens in zip(wave, outputs):
                if not future.done():
                    future.set_result(Generation(tokens))

    def reset_waves(self, step: int) -> None:
        self.seed_base = derive_seed(self.seed, "generate", step)
        self._waves = 0

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], wave: int) -> list[list[int]]:
        pad_id = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        device = self.policy.device
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every row ends where generation starts
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention[row, width - len(prompt) :] = 1
        torch.manual_seed(derive_seed(self.seed_base, wave))
        sample = self.cfg.temperature > 0
        kwargs: dict[str, Any] = {"do_sample": sample}
        if sample:
            kwargs.update(temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k or None)
        was_training = self.policy.training
        self.policy.eval()
        try:
            out = self.policy.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                max_new_tokens=self.cfg.max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=sorted(self.eos_ids),
                use_cache=True,
                **kwargs,
            )
        finally:
            self.policy.train(was_training)
        responses = [_cut_at_eos(row[width:].tolist(), self.eos_ids) for row in out.cpu()]
        self.generated_tokens += sum(len(r) for r in responses)
        return responses

    async def close(self) -> None:
        if self._worker is not None and self._worker.get_loop() is asyncio.get_running_loop():
            self._worker.cancel()


class VLLMError(RuntimeError):
    pass


class VLLMGenerator:
    """Requests to vLLM's OpenAI-compatible /v1/completions, prompts as token ids, LoRA hot-loaded."""

    SERVER_HELP = (
        "Start vLLM with runtime LoRA loading enabled, e.g.\n"
        "  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve {model} --enable-lora --max-loras 2 "
        "--max-lora-rank {rank}{logprobs_mode}\n"
        "(VLLM_ALLOW_RUNTIME_LORA_UPDATING must be set in the server's own environment)."
    )

    def __init__(self, base_url: str, base_model: str, tokenizer, gen_cfg: GenerationConfig, lora_rank: int,
                 api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.server_root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.base_model = base_model
        self.tokenizer = tokenizer
        self.cfg = gen_cfg
        self.lora_rank = lora_rank
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(gen_cfg.request_timeout, connect=10.0)
        )
        self.active_adapter: str | None = None
        self.loaded: list[str] = []
        self.in_flight: dict[str, int] = {}
        self.retries = 0
        self.generated_tokens = 0
        eos = tokenizer.eos_token_id
        self.eos_id = eos[0] if isinstance(eos, list) else eos

    def help_text(self) -> str:
        mode = " --logprobs-mode processed_logprobs" if self.cfg.temperature not in (0.0, 1.0) else ""
        return self.SERVER_HELP.format(model=self.base_model, rank=self.lora_rank, logprobs_mode=mode)

    async def check_server(self) -> None:
        try:
            response = await self.client.get(f"{self.base_url}/models", timeout=10.0)
            response.raise_for_status()
            served = [m.get("id") for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError) as exc:
            raise VLLMError(
                f"The vLLM server at {self.base_url} is not reachable ({type(exc).__name__}: {exc}). "
                + self.help_text() + " Or set env.vllm_url, or use generation.backend=local."
            ) from None
        log.info("vLLM at %s serves %s", self.base_url, served)

    async def _post(self, path: str, payload: dict[str, Any]) -> httpx.Response:
        """POST with retries on transient failures (connect errors, timeouts, 429, 5xx)."""
        for attempt in range(self.cfg.request_retries + 1):
            try:
                response = await self.client.post(f"{self.server_root}{path}", json=payload)
                if response.status_code != 429 and response.status_code < 500:
                    return response
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                failure = f"{type(exc).__name__}: {exc}"
            if attempt == self.cfg.request_retries:
                raise VLLMError(f"{path} failed after {attempt + 1} attempts: {failure}")
            self.retries += 1
            await asyncio.sleep(min(0.5 * 2**attempt, 8.0) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    async def load_adapter(self, adapter_dir: Path, name: str) -> None:
        """Load a new adapter under a fresh name (never in place), then retire unused older ones."""
        response = await self._post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(adapter_dir).resolve())}
        )
        if response.status_code == 404:
            raise VLLMError(
                f"The vLLM server at {self.base_url} has no /v1/load_lora_adapter endpoint: runtime LoRA "
                "updating is off. " + self.help_text()
            )
        if response.status_code >= 400:
            raise VLLMError(f"vLLM refused adapter {name} from {adapter_dir}: HTTP {response.status_code} "
                            f"{response.text[:300]}. " + self.help_text())
        self.loaded.append(name)
        self.active_adapter = name
        await self.unload_unused()

    async def unload_unused(self) -> None:
        for name in [n for n in self.loaded if n != self.active_adapter and not self.in_flight.get(n)]:
            response = await self._post("/v1/unload_lora_adapter", {"lora_name": name})
            if response.status_code >= 400:
                log.warning("could not unload adapter %s: HTTP %s", name, response.status_code)
            self.loaded.remove(name)

    async def generate(self, prompt_ids: list[int], order_key: int, seed: int) -> Generation:
        model = self.active_adapter or self.base_model
        payload: dict[str, Any] = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": self.cfg.max_new_tokens,
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "seed": seed,
        }
        if self.cfg.top_k:
            payload["top_k"] = self.cfg.top_k
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        try:
            response = await self._post("/v1/completions", payload)
        finally:
            self.in_flight[model] -= 1
        if response.status_code >= 400:
            raise VLLMError(f"/v1/completions with model {model!r}: HTTP {response.status_code} {response.text[:300]}")
        choice = response.json()["choices"][0]
        token_ids, logprobs = self._parse_logprobs(choice)
        if choice.get("finish_reason") == "stop" and (not token_ids or token_ids[-1] != self.eos_id):
            # vLLM may leave the EOS out of the returned tokens; training needs it to learn to stop
            token_ids.append(self.eos_id)
            logprobs.append(float("nan"))
        self.generated_tokens += len(token_ids)
        return Generation(token_ids, logprobs)

    @staticmethod
    def _parse_logprobs(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
        block = choice.get("logprobs") or {}
        tokens = block.get("tokens")
        if tokens is None:
            raise VLLMError("vLLM returned no logprobs.tokens; the trainer needs logprobs=1 and "
                            "return_tokens_as_token_ids support (vLLM >= 0.6).")
        ids = []
        for token in tokens:
            if not (isinstance(token, str) and token.startswith("token_id:")):
                raise VLLMError(f"expected 'token_id:<n>' tokens (return_tokens_as_token_ids), got {token!r}")
            ids.append(int(token.split(":", 1)[1]))
        logprobs = [float("nan") if lp is None else float(lp) for lp in block.get("token_logprobs", [])]
        return ids, logprobs

    async def close(self) -> None:
        await self.client.aclose()


# ---------------------------------------------------------------------- episodes
class RolloutRunner:
    """Plays a batch of tasks concurrently (at most `max_concurrent_episodes` at once)."""

    def __init__(self, envs: dict[str, tuple[str, Env]], generator, prompt_builder: PromptBuilder,
                 gen_cfg: GenerationConfig):
        self.envs = envs  # name -> (kind, env)
        self.generator = generator
        self.prompts = prompt_builder
        self.cfg = gen_cfg

    async def run(self, tasks: list[Task], step: int, on_episode_done: Callable[[Episode], None] | None = None
                  ) -> list[Episode]:
        """Play every task; at most `max_concurrent_episodes` live at once, results in task order."""
        if isinstance(self.generator, LocalGenerator):
            self.generator.reset_waves(step)
        episodes: list[Episode | None] = [None] * len(tasks)
        queue = iter(range(len(tasks)))
        started = getattr(self.generator, "episode_started", lambda: None)
        finished = getattr(self.generator, "episode_finished", lambda: None)

        async def worker() -> None:
            index = next(queue, None)
            if index is not None:
                started()
            while index is not None:
                episode = await self.play(index, tasks[index], step)
                episodes[index] = episode
                # admit the next episode before retiring this one, with no await in between, so the
                # set of live episodes at every generation wave depends only on what was generated
                index = next(queue, None)
                if index is not None:
                    started()
                finished()
                if on_episode_done:
                    on_episode_done(episode)

        workers = min(self.cfg.max_concurrent_episodes, len(tasks))
        await asyncio.gather(*(worker() for _ in range(workers)))
        return [e for e in episodes if e is not None]

    async def play(self, index: int, task: Task, step: int) -> Episode:
        kind, env = self.envs[task.env]
        episode = Episode(task=task, env_kind=kind)
        episode_id = None
        try:
            kwargs = {"opponent": task.opponent} if kind == "openspiel" and task.opponent else {}
            result = await env.reset(task_id=task.task_id, seed=task.seed, **kwargs)
            episode_id = result["episode_id"]
            self._absorb(episode, result)
            if result["done"]:
                self._finish(episode, result)
                return episode
            system = result["info"].get("system_prompt")
            if system:
                episode.messages.append({"role": "system", "content": system})
            episode.messages.append({"role": "user", "content": result["observation"]})
            decision_start = len(episode.messages) - 1
            while not result["done"]:
                if len(episode.turns) >= self.cfg.max_turns:
                    episode.cut_off = True
                    break
                shown = build_messages(episode.messages, decision_start, self.cfg.context_strategy,
                                       result["info"].get("turn_prompt"))
                # full/truncated may drop turns before the pending decision; `last` has nothing to drop
                keep_from = decision_start if self.cfg.context_strategy != "last" else int(bool(system))
                prompt_ids = self.prompts.fit(shown, keep_from)
                if prompt_ids is None:
                    episode.error = (f"prompt longer than generation.max_prompt_tokens="
                                     f"{self.prompts.max_prompt_tokens} even after dropping earlier turns")
                    break
                seed = derive_seed(task.seed, task.task_id, step, index, len(episode.turns))
                generation = await self.generator.generate(prompt_ids, order_key=index, seed=seed)
                text = self.prompts.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
                result = await env.step(text, episode_id)
                parse_error = bool(result["info"].get("parse_error"))
                episode.turns.append(Turn(
                    prompt_ids=prompt_ids, response_ids=generation.token_ids, response_text=text,
                    sampler_logprobs=generation.logprobs, parse_error=parse_error,
                    reward=0.0 if result["done"] else float(result["reward"]),
                ))
                episode.messages.append({"role": "assistant", "content": text})
                self._absorb(episode, result)
                if not result["done"]:
                    episode.messages.append({"role": "user", "content": result["observation"]})
                    if not parse_error:
                        decision_start = len(episode.messages) - 1
            if result["done"]:
                self._finish(episode, result)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an env or generator failure fails this episode, not the run
            episode.error = f"{type(exc).__name__}: {exc}"
            log.warning("episode %s (task %s) failed: %s", index, task.task_id, episode.error)
        finally:
            if episode_id is not None and not episode.done:
                try:
                    await env.stop(episode_id)
                except Exception as exc:
                    log.warning("stop(%s) failed: %s", episode_id, exc)
        return episode

    @staticmethod
    def _absorb(episode: Episode, result: StepResult) -> None:
        info = result["info"]
        episode.info = info
        episode.game_name = info.get("game_name") or episode.game_name or episode.env_kind
        if info.get("error") and result["done"] and result.get("truncated"):
            error = info["error"]
            episode.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)

    @staticmethod
    def _finish(episode: Episode, result: StepResult) -> None:
        info = result["info"]
        episode.done = True
        episode.score = float(info.get("score", result["reward"]))
        episode.success = bool(info.get("success", episode.score > 0.5))
