"""ppo_affine/envs/trace_play.py: the trace env's evaluate(), against a scripted OpenAI-compatible chat endpoint."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from ppo_affine.envs.trace_play import TraceEvaluator
from test_llm_play import USAGE, ScriptedLLM
from test_trace_env import env_for

ROWS = [{"program": "print(6 * 7)", "inputs": ""}]  # no assignment: no injected print, the output is 42


def evaluate(llm: ScriptedLLM, **kwargs: Any) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        # the program is ours and harmless: rlimits suffice, so the test runs where bubblewrap is missing too
        evaluator = TraceEvaluator(env_for(ROWS, unsafe_rlimit_only_sandbox=True), transport=httpx.MockTransport(llm))
        try:
            return await evaluator.evaluate(**({"task_id": 0, "seed": 9, "model": "m", "base_url": "http://llm/v1",
                                                "temperature": 0.0} | kwargs))
        finally:
            await evaluator.close()
    return asyncio.run(run())


def test_a_right_answer_scores_one_with_the_real_envs_result_fields():
    llm = ScriptedLLM("<think>six sevens</think>\n```\n42\n```\n")
    result = evaluate(llm)
    assert (result["task_name"], result["score"], result["success"]) == ("Trace", 1.0, True)
    assert result["extra"]["test_result"] == "1/1" and result["extra"]["usage"] == USAGE
    assert result["extra"]["seed"] == 9
    prompt, reply = result["extra"]["conversation"]
    assert prompt["role"] == "user" and "print(6 * 7)" in prompt["content"]
    assert reply == {"role": "assistant", "content": "<think>six sevens</think>\n```\n42\n```"}
    [body] = llm.bodies()
    assert (body["stream"], body["seed"], body["temperature"]) == (True, 9, 0.0)


def test_a_wrong_answer_scores_zero():
    result = evaluate(ScriptedLLM("41"))
    assert (result["score"], result["success"], result["extra"]["test_result"]) == (0.0, False, "0/1")


def test_an_empty_reply_is_not_scored():
    result = evaluate(ScriptedLLM("   "))
    assert result["score"] == 0.0 and result["extra"]["conversation"][-1]["content"] is None


def test_a_failed_model_call_is_an_llm_failure_with_score_zero_and_no_retry():
    llm = ScriptedLLM(httpx.Response(500, text=json.dumps({"error": {"message": "boom"}})))
    result = evaluate(llm)
    assert (result["score"], result["error_type"]) == (0.0, "llm_failure")
    assert "boom" in result["error"] and len(llm.requests) == 1


def test_the_trace_env_server_offers_evaluate():
    from ppo_affine.envs.server import build_env, create_app, parse_args

    env, evaluator = build_env(parse_args(["--env", "trace", "--unsafe-rlimit-only-sandbox"]))
    assert isinstance(evaluator, TraceEvaluator)
    app = create_app(env, "trace", evaluator=evaluator)
    assert "/evaluate" in {route.path for route in app.routes}
