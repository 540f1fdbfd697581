"""SWE-INFINITE's own harnesses as the endpoint's clients: mini-swe-agent 1.x and `codex app-server` 0.94.0, set up
as SWE-INFINITE sets them up (tests/harness_env), drive a scripted generator behind the real endpoint on small
local repository tasks (a bug and its test), commands in bubblewrap; reward 1 when the tests pass.

Where the harnesses are: MINISWE_TEST_PYTHON (a virtual environment's Python with mini-swe-agent~=1.0) and
CODEX_TEST_BIN (codex 0.94.0: the binary, or the npm package's bin/codex.js); .ci/run installs both and sets them.
Unset, a harness's tests are skipped; set to something that does not run, they fail (CI never skips them).
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_affine.endpoint import pack_calls
from test_endpoint import endpoint_of, tokenizer  # noqa: F401  (fixture)

HARNESS_ENV = Path(__file__).parent / "harness_env"
MINISWE_PYTHON = os.environ.get("MINISWE_TEST_PYTHON")
CODEX_BIN = os.environ.get("CODEX_TEST_BIN")
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached"

needs_miniswe = pytest.mark.skipif(MINISWE_PYTHON is None, reason="set MINISWE_TEST_PYTHON to a Python with "
                                   "mini-swe-agent~=1.0 (.ci/run does)")
needs_codex = pytest.mark.skipif(CODEX_BIN is None, reason="set CODEX_TEST_BIN to codex 0.94.0 (.ci/run does)")


def harness_env():
    """tests/harness_env/env.py, imported to be called in process."""
    spec = importlib.util.spec_from_file_location("harness_env", HARNESS_ENV / "env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def play(endpoint, monkeypatch, **evaluate_kwargs):
    """One evaluate() of the harness env against `endpoint`: (its result, the episode's recorded calls)."""
    if MINISWE_PYTHON:
        monkeypatch.setenv("MINISWE_PYTHON", MINISWE_PYTHON)
    if CODEX_BIN:
        monkeypatch.setenv("CODEX_BIN", CODEX_BIN)
    actor = harness_env().Actor()

    async def run():
        await endpoint.start()
        try:
            door = endpoint.open_episode(0, (1, 2, 0, 0))
            result = await actor.evaluate(base_url=door.url, model="tiny", seed=5, timeout=300, **evaluate_kwargs)
            return result, endpoint.close_episode(door)
        finally:
            await endpoint.close()

    return asyncio.run(run())


def bash(command: str, thought: str = "THOUGHT: next step.") -> str:
    return f"{thought}\n\n```bash\n{command}\n```"


# ---------------------------------------------------------------------- installed as pinned
@needs_miniswe
def test_mini_swe_agent_is_the_pinned_1_x():
    version = subprocess.run([MINISWE_PYTHON, "-c", "import minisweagent; print(minisweagent.__version__)"],
                             capture_output=True, text=True, env={**os.environ, "MSWEA_SILENT_STARTUP": "1"})
    assert version.returncode == 0, f"MINISWE_TEST_PYTHON={MINISWE_PYTHON} has no mini-swe-agent: {version.stderr}"
    assert version.stdout.split()[-1].startswith("1.")


# ---------------------------------------------------------------------- mini-swe-agent
@needs_miniswe
def test_mini_swe_agent_fixes_the_bug_through_format_errors_and_a_long_output_then_submits(tokenizer, monkeypatch,
                                                                                           caplog):
    replies = [
        bash("cat calc.py", "THOUGHT: read the source first."),
        "The bug must be the minus sign.",  # no block
        bash("cat calc.py") + "\n\nand then\n\n" + bash("cat test_calc.py"),  # two blocks
        bash("seq 1 3000"),  # 13 893 characters of output: its first and last 5 000 kept
        bash("sed -i 's/a - b/a + b/' calc.py && python3 -m unittest -q 2>&1 | tail -n 1"),
        bash(SUBMIT, "THOUGHT: the test passes; submit."),
        bash("echo never asked for"),
    ]
    endpoint = endpoint_of(tokenizer, replies, max_prompt_tokens=60_000)
    with caplog.at_level(logging.WARNING, logger="ppo_affine.endpoint"):
        result, calls = play(endpoint, monkeypatch, task_id=0, agent="miniswe", max_iterations=50)

    assert result["score"] == 1.0, result
    extra = result["extra"]
    assert (extra["exit_status"], extra["model_calls"], extra["harness_error"]) == ("Submitted", 6, None)
    assert "-    return a - b\n+    return a + b" in extra["patch"]
    assert len(calls) == 6 and endpoint.generator.replies == [bash("echo never asked for")]  # submit ended it
    # the harness's own format errors went back to the model, and stayed in the episode
    prompts = [tokenizer.decode(call.prompt_ids) for call in calls]
    assert "found 0 actions" in prompts[2] and "found 2 actions" in prompts[3]
    assert "<output_head>\n1\n2\n3\n" in prompts[4] and "3893 characters elided" in prompts[4]
    assert "<returncode>0</returncode>" in prompts[5] and "OK" in prompts[5]
    # one conversation the harness only appends to: one training sequence, no prefix break
    sequences, placements, breaks = pack_calls(calls)
    assert (len(sequences), breaks) == (1, 0)
    assert all(call.finish_reason == "stop" for call in calls)
    # the recorded ids re-render: each prompt decodes to the chat template's text of the harness's messages
    assert all(tokenizer.decode(call.prompt_ids) == call.render for call in calls)
    # what litellm sends besides the messages: the temperature (0, SWE-INFINITE's) and seed, no max_tokens
    assert "an evaluate() harness asked for temperature=0.0" in caplog.text


@needs_miniswe
def test_a_mini_swe_agent_run_that_never_submits_scores_0_at_the_step_limit(tokenizer, monkeypatch):
    fix = bash("sed -i 's/a - b/a + b/' calc.py")
    endpoint = endpoint_of(tokenizer, [fix, bash("python3 -m unittest -q"), bash("ls")], max_prompt_tokens=60_000)
    result, calls = play(endpoint, monkeypatch, task_id=0, agent="miniswe", max_iterations=2)
    assert (result["score"], result["extra"]["exit_status"], len(calls)) == (0.0, "LimitsExceeded", 2)


@needs_miniswe
def test_a_prompt_over_the_limit_ends_the_mini_swe_agent_run_at_once_with_the_400(tokenizer, monkeypatch):
    endpoint = endpoint_of(tokenizer, [bash("seq 1 3000"), bash("ls")], max_prompt_tokens=2_500)
    result, calls = play(endpoint, monkeypatch, task_id=0, agent="miniswe", max_iterations=50)
    assert (result["score"], result["extra"]["exit_status"], len(calls)) == (0.0, None, 1)
    assert "maximum context length" in result["extra"]["harness_error"]
