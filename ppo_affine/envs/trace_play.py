"""The trace env's `evaluate()`: one program's output asked of an OpenAI-compatible chat endpoint, scored, with the
real env's result dict (docs/protocols.md, 'The trace evaluate() call'). `python -m ppo_affine.envs.server --env
trace` offers it, so a model can be trained or scored through the trace env's own evaluate().

The task, its prompt and its scoring are our embedded trace env's (trace_env.py, through its reset and step). What
this module adds is the call's side: one user message, streamed with `seed` and (when given) `temperature`, no
retries; the reply's content whitespace-stripped (think blocks stay: the scoring removes them); an empty reply scores
0 without being scored (step() would score it, the real evaluate() does not); an LLM failure gives score 0 with
`error` and `error_type: "llm_failure"`. Not reproduced: `dataset_index` for embedded tasks (they have none).
"""
from __future__ import annotations

import os
import random
import time
from typing import TYPE_CHECKING, Any

import httpx

from ppo_affine.envs.llm_play import CHUNK_TIMEOUT_S, REQUEST_TIMEOUT_S, LLMError, chat

if TYPE_CHECKING:
    from ppo_affine.envs.trace_env import TraceEnv

SEED_SPACE = 2**32


class TraceEvaluator:
    """`evaluate()` of the Affine trace env over our embedded trace tasks."""

    def __init__(self, env: "TraceEnv", transport: httpx.AsyncBaseTransport | None = None):
        self.env = env
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, read=CHUNK_TIMEOUT_S),
                                        transport=transport)
        self._rng = random.Random()  # a missing seed is drawn at random, like the real env

    async def evaluate(self, task_id: int | None = None, seed: int | None = None,
                       model: str = "deepseek-ai/DeepSeek-V3", base_url: str = "https://llm.chutes.ai/v1",
                       timeout: float = 600, temperature: float | None = None,
                       api_key: str | None = None) -> dict[str, Any]:
        """The real env's signature and result; see the module docstring."""
        started = time.monotonic()
        seed = self._rng.randrange(SEED_SPACE) if seed is None else int(seed)
        step = await self.env.reset(task_id=task_id, seed=seed)
        if step["done"]:  # the task could not be built
            error = step["info"].get("error") or {}
            raise RuntimeError(f"trace task {task_id}: {error.get('message', step['observation'])}")
        conversation = [{"role": "user", "content": step["observation"]}]
        result: dict[str, Any] = {"task_name": "Trace", "score": 0.0, "success": False}
        extra: dict[str, Any] = {"conversation": conversation, "seed": seed, "test_result": "0/1", "usage": None,
                                 **{k: step["info"][k] for k in ("dataset_index",) if k in step["info"]}}
        try:
            reply = await chat(self.client, base_url, model, conversation, temperature, seed,
                               api_key or os.environ.get("CHUTES_API_KEY") or "EMPTY", retries=0,
                               strip_reasoning=False)
        except LLMError as exc:
            await self.env.stop(step["episode_id"])
            result.update(error=f"LLMError: {exc}", error_type="llm_failure")
        else:
            extra["usage"] = reply.usage
            conversation.append({"role": "assistant", "content": reply.content})
            if reply.content is None:
                await self.env.stop(step["episode_id"])
            else:
                scored = await self.env.step(reply.content, step["episode_id"])
                score = float(scored["reward"])
                result.update(score=score, success=score > 0)
                extra["test_result"] = f"{int(score)}/1"
        result["time_taken"] = time.monotonic() - started
        result["extra"] = extra
        return result

    async def close(self) -> None:
        await self.client.aclose()
        await self.env.close()
