"""The Affine game env's `evaluate()`: play one whole game against an OpenAI-compatible chat endpoint and
return the real env's result dict (docs/protocols.md, 'The evaluate() call and its result').
`python -m ppo_affine.envs.server --env openspiel` offers it, so evaluate.py can score a model through an
env's evaluate() without Docker.

The game, its prompts and its parser are our embedded env's `evaluate` format (ppo_affine/envs/openspiel_env.py),
the same the trainer plays. What this module adds is the validators' side of the call:
- The conversation: the system prompt once, one user message per decision, every reply stored as the
  client returns it (whitespace- and think-stripped), and a feedback message after every unusable reply,
  the third one included. It is never shortened.
- The request: streamed `/chat/completions` with `seed` and (when given) `temperature`, and no
  `max_tokens`, so replies are as long as the server lets them be.
- Timeouts and retries: 30 s without a chunk, 600 s per request, at most 32 000 chunks; timeouts,
  connection errors and HTTP >= 500 are retried (`llm_retries`, 10 as in the real env) after
  min(2^k, 32) s; other HTTP errors are not. The game must end within max(timeout - 20, 0.9 timeout).
- The result: task_name, score, success (score > 0.5), time_taken, `error` for an API failure, a
  timeout or an unplayable task (absent when the game is lost to three unusable replies), and `extra`
  with the conversation, seat, returns and the last call's usage. Not reproduced: action_history,
  observation, mcts_timing and collect_logprobs' second pass.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from ppo_affine.envs.openspiel_text import evaluate_feedback, strip_think
from ppo_affine.envs.tasks import game_name_of

if TYPE_CHECKING:
    from ppo_affine.envs.openspiel_env import OpenSpielEnv

CHUNK_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 600.0
MAX_CHUNKS = 32_000
MAX_BACKOFF_S = 32.0
VALIDATOR_LLM_RETRIES = 10
TASK_ID_SPACE = 10**11
SEED_SPACE = 2**32
NO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


class LLMError(Exception):
    """The endpoint gave no usable reply (after retries where they apply)."""


class _Retryable(Exception):
    """One failed attempt that the validators' client retries."""


@dataclass
class ChatReply:
    content: str | None  # stripped of whitespace and think tags; None when nothing is left
    usage: dict[str, Any] | None


async def chat(client: httpx.AsyncClient, base_url: str, model: str, messages: list[dict[str, str]],
               temperature: float | None, seed: int | None, api_key: str, retries: int,
               strip_reasoning: bool = True) -> ChatReply:
    """One streamed chat completion as the validators' client makes it, retried on transient failures.
    `strip_reasoning=False`: the content only whitespace-stripped (the trace env's client keeps think blocks,
    which its scoring removes)."""
    payload: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                               "stream_options": {"include_usage": True}}
    if temperature is not None:
        payload["temperature"] = temperature
    if seed is not None:
        payload["seed"] = seed
    url = f"{base_url.rstrip('/')}/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"}
    failure = ""
    for attempt in range(retries + 1):
        try:
            return await asyncio.wait_for(_stream(client, url, payload, headers, strip_reasoning), REQUEST_TIMEOUT_S)
        except (httpx.TransportError, asyncio.TimeoutError, _Retryable) as exc:
            failure = f"{type(exc).__name__}: {exc}" if not isinstance(exc, _Retryable) else str(exc)
        if attempt < retries:
            await asyncio.sleep(backoff_seconds(attempt))
    attempts = retries + 1
    raise LLMError(f"API call to {url} failed after {attempts} attempt{'s' * (attempts != 1)}: {failure}")


def backoff_seconds(attempt: int) -> float:
    """The validators' client waits min(2^k, 32) s before retry k + 1."""
    return float(min(2**attempt, MAX_BACKOFF_S))


async def _stream(client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str],
                  strip_reasoning: bool = True) -> ChatReply:
    async with client.stream("POST", url, json=payload, headers=headers) as response:
        if response.status_code >= 400:
            detail = _error_detail((await response.aread()).decode(errors="replace"))
            if response.status_code >= 500:
                raise _Retryable(f"HTTP {response.status_code}: {detail}")
            raise LLMError(f"API error {response.status_code} from {url}: {detail}")
        parts: list[str] = []
        usage = None
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                raise LLMError(f"{url} streamed a chunk that is not JSON: {data[:200]!r}") from None
            chunks += 1
            choices = chunk.get("choices") or []
            delta = (choices[0].get("delta") or {}) if choices else {}
            if delta.get("content"):
                parts.append(delta["content"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunks >= MAX_CHUNKS:
                break
    content = "".join(parts)
    return ChatReply((strip_think(content) if strip_reasoning else content.strip()) or None, usage)


def _error_detail(body: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message"}} or {"message"}), else the body."""
    try:
        document = json.loads(body)
    except ValueError:
        return body[:300]
    if isinstance(document, dict):
        inner = document.get("error")
        message = inner.get("message") if isinstance(inner, dict) else document.get("message")
        if message:
            return str(message)[:300]
    return body[:300]


class GameEvaluator:
    """`evaluate()` of the Affine game env over our embedded games (one episode per call, many concurrently)."""

    def __init__(self, env: "OpenSpielEnv", llm_retries: int = VALIDATOR_LLM_RETRIES,
                 transport: httpx.AsyncBaseTransport | None = None):
        if env.observation_format != "evaluate":
            raise ValueError(f"GameEvaluator plays the 'evaluate' format, got an env in {env.observation_format!r}")
        if llm_retries < 0:
            raise ValueError(f"llm_retries must be >= 0, got {llm_retries}")
        self.env = env
        self.llm_retries = llm_retries
        # read = the longest wait for the next chunk; the whole request is bounded in chat()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, read=CHUNK_TIMEOUT_S),
                                        transport=transport)
        self._rng = random.Random()  # missing task ids and seeds are drawn at random, like the real env

    async def evaluate(self, task_id: int | None = None, seed: int | None = None,
                       model: str = "deepseek-ai/DeepSeek-V3", base_url: str = "https://llm.chutes.ai/v1",
                       timeout: float = 1800, temperature: float | None = None, api_key: str | None = None,
                       opponent: str = "mcts", collect_logprobs: bool = False) -> dict[str, Any]:
        """The real env's signature and result (docs/protocols.md, 'The evaluate() call and its result');
        see the module docstring."""
        started = time.monotonic()
        task_id = self._rng.randrange(TASK_ID_SPACE) if task_id is None else int(task_id)
        seed = self._rng.randrange(SEED_SPACE) if seed is None else int(seed)
        game = _Game(task_id, seed, opponent)
        limit = max(timeout - 20, 0.9 * timeout)
        try:
            await asyncio.wait_for(self._play(game, model, base_url, temperature,
                                              api_key or os.environ.get("CHUTES_API_KEY") or "EMPTY"), limit)
        except asyncio.TimeoutError:
            game.error = f"Game incomplete: timeout after {time.monotonic() - started:.1f}s (limit: {limit:.1f}s)"
        except LLMError as exc:
            game.error = f"[API_ERROR] {exc}"
        except Exception as exc:  # an env bug answers this call with an error result, like the real env
            game.error = f"[{type(exc).__name__}] {exc}"
        finally:
            if game.episode_id is not None and not game.done:
                await self.env.stop(game.episode_id)
        result = game.result(time.monotonic() - started)
        if collect_logprobs and game.conversation:
            result["extra"]["logprobs_error"] = "collect_logprobs is not supported by this env server"
        return result

    async def _play(self, game: "_Game", model: str, base_url: str, temperature: float | None, api_key: str) -> None:
        step = await self.env.reset(task_id=game.task_id, seed=game.seed, opponent=game.opponent)
        game.absorb(step)
        if step["done"]:
            return
        game.episode_id = step["episode_id"]
        if step["info"].get("system_prompt"):
            game.conversation.append({"role": "system", "content": step["info"]["system_prompt"]})
        game.conversation.append({"role": "user", "content": step["observation"]})
        while not step["done"]:
            reply = await chat(self.client, base_url, model, game.conversation, temperature, game.seed, api_key,
                               self.llm_retries)
            game.usage = reply.usage or game.usage
            content = reply.content or ""
            game.conversation.append({"role": "assistant", "content": content})
            step = await self.env.step(content, game.episode_id)
            game.absorb(step)
            if not step["done"]:
                game.conversation.append({"role": "user", "content": step["observation"]})
            elif step["info"].get("parse_error"):
                # the validators' client tells the model about its third unusable reply too; the
                # game summary our env adds after it is not part of their conversation
                attempts = self.env.max_parse_attempts
                game.conversation.append({"role": "user", "content": evaluate_feedback(attempts, attempts)})

    async def close(self) -> None:
        await self.client.aclose()
        await self.env.close()


class _Game:
    """What one evaluate() call has gathered so far, and the result dict it makes."""

    def __init__(self, task_id: int, seed: int, opponent: str):
        self.task_id, self.seed, self.opponent = task_id, seed, opponent
        self.episode_id: str | None = None
        self.info: dict[str, Any] = {}
        self.done = False
        self.conversation: list[dict[str, str]] = []
        self.usage: dict[str, Any] = dict(NO_USAGE)
        self.error: str | None = None
        self.unplayable = False

    def absorb(self, step: dict[str, Any]) -> None:
        self.info = step["info"]
        self.done = step["done"]
        error = self.info.get("error")
        if step["done"] and isinstance(error, dict) and error.get("type") == "invalid_game":
            self.unplayable = True
            self.error = f"[SpielError] {error.get('message')}"

    def result(self, seconds: float) -> dict[str, Any]:
        info = self.info
        # the real env names the game "unknown" when open_spiel cannot load it
        game_name = "unknown" if self.unplayable else info.get("game_name") or game_name_of(self.task_id)
        finished = self.error is None and self.done
        score = float(info.get("score", 0.0)) if finished else 0.0
        returns = info.get("returns") if finished else None
        player = info.get("llm_player_id")
        if player is None:
            player = self.seed % 2
        result: dict[str, Any] = {
            "task_name": f"openspiel:{game_name}",
            "score": score,
            "success": score > 0.5,
            "time_taken": seconds,
            "extra": {
                "conversation": self.conversation,
                "task_type": game_name,
                "game_name": game_name,
                "task_id": self.task_id,
                "seed": self.seed,
                "opponent_type": self.opponent,
                "llm_player_id": player,
                "final_return": returns[player] if returns is not None else None,
                "all_returns": returns,
                "usage": self.usage,
            },
        }
        if self.error is not None:
            result["error"] = self.error
        return result
