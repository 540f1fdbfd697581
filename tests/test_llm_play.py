"""ppo_affine/envs/llm_play.py: the game env's evaluate(), played against a scripted OpenAI-compatible chat endpoint.

The endpoint is an httpx MockTransport: no network, every request recorded. Leduc poker task
200000000 with the validators' seed 1580322239 seats the model as player 1 (seed % 2) and deals it J♥.
The opponent is the exact search, move for move the real env's.
"""
from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any, Callable

import httpx
import pytest

from ppo_affine.envs import llm_play
from ppo_affine.envs.llm_play import GameEvaluator, backoff_seconds
from ppo_affine.envs.openspiel_env import OpenSpielEnv

LEDUC, SEED = 200_000_000, 1_580_322_239
USAGE = {"prompt_tokens": 300, "completion_tokens": 2, "total_tokens": 302}


def streamed(content: str, usage: dict[str, Any] | None = None) -> httpx.Response:
    """A chat completion as vLLM streams it: content in deltas, then usage, then [DONE]."""
    half = len(content) // 2
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": content[:half]}}]},
              {"choices": [{"index": 0, "delta": {"content": content[half:]}, "finish_reason": "stop"}]}]
    if usage:
        chunks.append({"choices": [], "usage": usage})
    body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


class ScriptedLLM:
    """Answers each request with the next scripted reply: a string, or an httpx.Response to send as is."""

    def __init__(self, *replies: str | httpx.Response | Callable[[], Any]):
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request):
        self.requests.append(request)
        reply = self.replies.pop(0)
        if callable(reply):
            return reply()
        return reply if isinstance(reply, httpx.Response) else streamed(reply, USAGE)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(request.content) for request in self.requests]


def play(llm: ScriptedLLM, retries: int = 10, **kwargs: Any) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        evaluator = GameEvaluator(OpenSpielEnv("evaluate", opponent_search="exact"), llm_retries=retries, transport=httpx.MockTransport(llm))
        try:
            arguments = {"task_id": LEDUC, "seed": SEED, "model": "smol", "base_url": "http://llm:8000/v1",
                         "temperature": 0.0, "opponent": "random", "api_key": "key"} | kwargs
            return await evaluator.evaluate(**arguments)
        finally:
            await evaluator.close()

    return asyncio.run(run())


@pytest.fixture
def no_backoff(monkeypatch):
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(llm_play.asyncio, "sleep", sleep)
    return waits


def test_evaluate_takes_the_real_envs_arguments():
    parameters = inspect.signature(GameEvaluator.evaluate).parameters
    assert {name: p.default for name, p in parameters.items() if name != "self"} == {
        "task_id": None, "seed": None, "model": "deepseek-ai/DeepSeek-V3", "base_url": "https://llm.chutes.ai/v1",
        "timeout": 1800, "temperature": None, "api_key": None, "opponent": "mcts", "collect_logprobs": False}


def test_a_whole_game_is_played_and_scored_like_the_real_env():
    llm = ScriptedLLM("<think>calling is safe</think> 1", "1")
    result = play(llm)
    assert {k: v for k, v in result.items() if k not in ("extra", "time_taken")} == {
        "task_name": "openspiel:leduc_poker", "score": 6 / 26, "success": False}  # lost 7 chips: (-7 + 13) / 26
    assert "error" not in result
    extra = result["extra"]
    assert {k: v for k, v in extra.items() if k != "conversation"} == {
        "task_type": "leduc_poker", "game_name": "leduc_poker", "task_id": LEDUC, "seed": SEED,
        "opponent_type": "random", "llm_player_id": 1, "final_return": -7.0, "all_returns": [7.0, -7.0],
        "usage": USAGE}
    roles = [m["role"] for m in extra["conversation"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert extra["conversation"][0]["content"].startswith("You are playing leduc_poker.")
    assert extra["conversation"][1]["content"].startswith("Current State:\nYour card: J♥\n")
    assert extra["conversation"][2]["content"] == "1"  # stored as the client returns it: think tags stripped
    assert extra["conversation"][3]["content"].startswith("Current State:\nYour card: J♥\nPublic card: Q♥\n")


def test_each_request_is_the_validators_streamed_chat_call():
    llm = ScriptedLLM("1", "1")
    result = play(llm)
    first, second = llm.bodies()
    assert {k: v for k, v in first.items() if k != "messages"} == {
        "model": "smol", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
        "seed": SEED}  # no max_tokens: the server decides how long a reply may be
    assert str(llm.requests[0].url) == "http://llm:8000/v1/chat/completions"
    assert llm.requests[0].headers["authorization"] == "Bearer key"
    assert first["messages"] == result["extra"]["conversation"][:2]
    assert second["messages"] == result["extra"]["conversation"][:4]  # the whole conversation every time


def test_temperature_none_is_not_sent():
    llm = ScriptedLLM("1", "1")
    play(llm, temperature=None)
    assert "temperature" not in llm.bodies()[0]


def test_a_label_in_prose_is_an_action():
    result = play(ScriptedLLM("fold?"))
    assert (result["score"], result["extra"]["final_return"]) == (12 / 26, -1.0)  # folded: lost the ante


def test_three_unusable_replies_lose_the_game_without_an_error():
    result = play(ScriptedLLM("no idea", "still none", "pass"))
    assert (result["score"], result["success"], "error" in result) == (0.0, False, False)
    assert (result["extra"]["final_return"], result["extra"]["all_returns"]) == (None, None)
    conversation = result["extra"]["conversation"]
    assert [m["role"] for m in conversation[2:]] == ["assistant", "user"] * 3
    # the third unusable reply is answered with feedback too; the conversation then ends
    assert [m["content"][-15:] for m in conversation[3::2]] == ["attempt 1 of 3.", "attempt 2 of 3.",
                                                                 "attempt 3 of 3."]


def test_a_server_error_is_retried_with_the_validators_backoff(no_backoff):
    llm = ScriptedLLM(httpx.Response(503, json={"error": {"message": "busy"}}),
                      httpx.Response(502, text="bad gateway"), "1", "1")
    result = play(llm)
    assert result["score"] == 6 / 26 and len(llm.requests) == 4
    assert no_backoff == [1.0, 2.0]


def test_backoff_doubles_up_to_32_seconds():
    assert [backoff_seconds(k) for k in range(8)] == [1, 2, 4, 8, 16, 32, 32, 32]


def test_a_connection_failure_past_the_retries_is_an_api_error(no_backoff):
    def refuse():
        raise httpx.ConnectError("connection refused")

    result = play(ScriptedLLM(refuse, refuse, refuse), retries=2)
    assert (result["score"], result["success"]) == (0.0, False)
    assert result["error"].startswith("[API_ERROR] API call to http://llm:8000/v1/chat/completions failed after "
                                      "3 attempts: ConnectError: connection refused")
    assert [m["role"] for m in result["extra"]["conversation"]] == ["system", "user"]


def test_a_client_error_is_not_retried():
    llm = ScriptedLLM(httpx.Response(404, json={"error": {"message": "The model `smol` does not exist."}}))
    result = play(llm)
    assert len(llm.requests) == 1
    assert result["error"] == ("[API_ERROR] API error 404 from http://llm:8000/v1/chat/completions: "
                               "The model `smol` does not exist.")


def test_an_empty_reply_is_an_unusable_one():
    result = play(ScriptedLLM("<think>only thinking", "1", "1"))
    conversation = result["extra"]["conversation"]
    assert conversation[2] == {"role": "assistant", "content": ""}
    assert conversation[3]["content"].endswith("attempt 1 of 3.")
    assert result["score"] == 6 / 26


def test_the_game_deadline_ends_a_slow_game_with_an_error():
    async def never_answers():
        await asyncio.sleep(30)

    result = play(ScriptedLLM(never_answers), timeout=1.0)  # deadline max(1 - 20, 0.9 * 1) = 0.9 s
    assert result["score"] == 0.0
    assert result["error"].startswith("Game incomplete: timeout after 0.9") and result["error"].endswith(
        "(limit: 0.9s)")


def test_an_unplayable_task_is_an_error_result_without_a_call():
    llm = ScriptedLLM()
    result = play(llm, task_id=1_900_000_001)  # bridge variant 1: open_spiel has no parameter 'is_chicago'
    assert llm.requests == []
    assert (result["task_name"], result["score"], result["extra"]["game_name"]) == ("openspiel:unknown", 0.0,
                                                                                     "unknown")
    assert result["error"].startswith("[SpielError] task 1900000001 asks for bridge")
    assert result["extra"]["conversation"] == [] and result["extra"]["llm_player_id"] == SEED % 2


def test_an_unknown_opponent_is_an_error_result():
    result = play(ScriptedLLM(), opponent="alphazero")
    assert result["error"] == "[ValueError] opponent must be one of ('mcts', 'random'), got 'alphazero'"
    assert result["task_name"] == "openspiel:leduc_poker"
