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
import json
import logging
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

import train_ppo
from ppo_affine.endpoint import pack_calls
from ppo_affine.reply_parsers import REPLY_FORMATS
from test_endpoint import endpoint_of, tokenizer  # noqa: F401  (fixture)
from test_evaluate_env import tools_model_dir  # noqa: F401  (fixture)
from test_train import metrics, tiny_args

HARNESS_ENV = Path(__file__).parent / "harness_env"
MINISWE_PYTHON = os.environ.get("MINISWE_TEST_PYTHON")
CODEX_BIN = os.environ.get("CODEX_TEST_BIN")
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached"

needs_miniswe = pytest.mark.skipif(MINISWE_PYTHON is None, reason="set MINISWE_TEST_PYTHON to a Python with "
                                   "mini-swe-agent~=1.0 (.ci/run does)")
needs_codex = pytest.mark.skipif(CODEX_BIN is None, reason="set CODEX_TEST_BIN to codex 0.94.0 (.ci/run does)")


def harness_module(name: str):
    """tests/harness_env/<name>.py, imported to be called in process."""
    spec = importlib.util.spec_from_file_location(f"harness_{name}", HARNESS_ENV / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def harness_env():
    return harness_module("env")


def provider_context_overflow(message) -> bool:
    return harness_module("run_outcome").provider_context_overflow(message)


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


def tool_call(name: str, arguments: dict) -> str:
    """A Hermes tool call, as a Qwen3 model writes it (the endpoint parses it into `tool_calls`)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def shell(command: str) -> str:
    return tool_call("shell", {"command": ["bash", "-lc", command]})


def recording(endpoint):
    """The request bodies the endpoint is sent, in order."""
    bodies, chat = [], endpoint.chat

    async def chat_and_record(door, body):
        bodies.append(body)
        return await chat(door, body)

    endpoint.chat = chat_and_record
    return bodies


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
    assert "sent seed=" in caplog.text and "which this endpoint does not apply" in caplog.text


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
    # litellm reads the 400's message as a context overflow: a model failure, scored 0 (not dropped)
    assert result["extra"]["harness_error"].startswith("ContextWindowExceededError")
    assert (result["extra"]["outcome"], "error" in result) == ("model_failure", False)


# ---------------------------------------------------------------------- codex app-server
@needs_codex
def test_codex_is_the_pinned_0_94_0():
    command = ["node", CODEX_BIN, "--version"] if CODEX_BIN.endswith(".js") else [CODEX_BIN, "--version"]
    version = subprocess.run(command, capture_output=True, text=True)
    assert version.returncode == 0, f"CODEX_TEST_BIN={CODEX_BIN} does not run: {version.stderr}"
    assert version.stdout.split() == ["codex-cli", "0.94.0"]


CODEX_TOOLS = {"shell", "update_plan"}  # among what codex 0.94.0 offers over wire_api chat


@needs_codex
def test_codex_fixes_the_bug_with_streamed_tool_calls_through_a_malformed_call_and_a_long_output(tokenizer,
                                                                                                 monkeypatch):
    replies = [
        shell("cat calc.py"),
        tool_call("shell", {"cmd": "ls"}),  # no `command`: codex answers with its own error, as the tool's output
        shell("seq 1 40000"),  # codex cuts it itself before it is sent
        shell("sed -i 's/a - b/a + b/' calc.py"),
        "Fixed: add returns a + b.",  # no tool call: codex's final answer, the end of its turn
        "never asked for",
    ]
    endpoint = endpoint_of(tokenizer, replies, reply_format=REPLY_FORMATS["qwen3"], max_prompt_tokens=200_000)
    bodies = recording(endpoint)
    result, calls = play(endpoint, monkeypatch, task_id=0, agent="codex")

    assert result["score"] == 1.0, result
    assert (result["extra"]["exit_status"], result["extra"]["outcome"]) == ("completed", "completed")
    assert "-    return a - b\n+    return a + b" in result["extra"]["patch"]
    assert len(calls) == 5 and endpoint.generator.replies == ["never asked for"]
    # what codex sends: model, messages, stream and tools, and nothing else (no max_tokens, no tool_choice)
    assert all(set(body) == {"model", "messages", "stream", "tools"} and body["stream"] is True for body in bodies)
    assert CODEX_TOOLS <= {tool["function"]["name"] for tool in bodies[0]["tools"]}
    system, *first_turn = bodies[0]["messages"]
    assert system["role"] == "system" and len(system["content"]) > 10_000  # codex's own instructions
    assert [m["role"] for m in first_turn] == ["developer", "user", "user", "user"]
    # the tool calls came back as codex's history: content null + tool_calls, then the tool's JSON output
    call_turn, output_turn = bodies[1]["messages"][-2:]
    assert call_turn["content"] is None and call_turn["tool_calls"][0]["function"]["name"] == "shell"
    assert json.loads(output_turn["content"])["output"] == "def add(a, b):\n    return a - b\n"
    refusal = "failed to parse function arguments: missing field `command`"
    assert bodies[2]["messages"][-1]["content"].startswith(refusal)
    # codex cut the long output itself (in the middle of an escape: the "JSON" it sends is not valid JSON)
    assert bodies[3]["messages"][-1]["content"].startswith('{"output":"Total output lines: 40000\\n')
    assert len(bodies[3]["messages"][-1]["content"]) < len("".join(f"{n}\n" for n in range(1, 40_001)))
    assert [call.finish_reason for call in calls] == ["tool_calls"] * 4 + ["stop"]
    # codex re-sends its whole history each call, and it renders as an extension: one sequence, no break
    sequences, placements, breaks = pack_calls(calls)
    assert (len(sequences), breaks) == (1, 0)
    assert all(tokenizer.decode(call.prompt_ids) == call.render for call in calls)


@needs_codex
def test_codex_reads_a_reply_cut_at_the_cap_as_a_context_overflow_and_fails_the_turn(tokenizer, monkeypatch):
    """Why the agent preset's reply cap must be the room left in the model's context: codex sends no max_tokens,
    and `finish_reason: "length"` ends its run as "ran out of room in the model's context window" (scored 0)."""
    endpoint = endpoint_of(tokenizer, ["I will read the file and then " * 20], eos_at_end=False,
                           reply_format=REPLY_FORMATS["qwen3"], max_new_tokens=16, max_prompt_tokens=200_000)
    result, calls = play(endpoint, monkeypatch, task_id=0, agent="codex")
    assert [call.finish_reason for call in calls] == ["length"]
    extra = result["extra"]
    assert (result["score"], extra["exit_status"], extra["outcome"], "error" in result) == (
        0.0, "failed", "model_failure", False)
    assert json.loads(extra["harness_error"])["codexErrorInfo"] == "contextWindowExceeded"


@needs_codex
def test_a_prompt_over_the_limit_fails_the_codex_turn_with_the_endpoints_400_body(tokenizer, monkeypatch):
    """SWE-INFINITE scores it 0 (model failure) only when the 400's body reads as a context overflow (a
    `context_length_exceeded` code, or SGLang's own message); any other 400 is an infrastructure failure: no score."""
    endpoint = endpoint_of(tokenizer, [shell("seq 1 40000"), "done"], reply_format=REPLY_FORMATS["qwen3"],
                           max_prompt_tokens=20_000)
    result, calls = play(endpoint, monkeypatch, task_id=0, agent="codex")
    assert len(calls) == 1 and endpoint.generator.replies == ["done"]  # the second call was refused
    extra = result["extra"]
    reported = json.loads(extra["harness_error"])
    body = json.loads(reported["message"])  # the endpoint's 400 body (SGLang's ErrorResponse), as codex received it
    assert (body["object"], body["code"], extra["exit_status"]) == ("error", 400, "failed")
    assert "longer than the model's context length" in body["message"]
    overflow = provider_context_overflow(reported["message"])
    assert (extra["outcome"], "error" in result) == (("model_failure", False) if overflow else ("infra_failure", True))


def test_what_reads_as_a_context_overflow_to_swe_infinite():
    sglang = "Input length (40100 tokens) exceeds the maximum allowed length (32768 tokens). Use a shorter input " \
             "or enable --allow-auto-truncate."
    assert provider_context_overflow(json.dumps({"error": {"message": sglang, "type": "BadRequestError",
                                                           "code": 400}}))
    assert provider_context_overflow(json.dumps({"error": {"message": "too long", "code": "context_length_exceeded"}}))
    vllm = "This model's maximum context length is 4096 tokens."
    assert not provider_context_overflow(json.dumps({"error": {"message": vllm, "type": "BadRequestError",
                                                               "code": 400}}))
    assert not provider_context_overflow("stream disconnected before completion")


@pytest.mark.parametrize("model_preset", ["qwen3-32b", "qwen3.6-35b-a3b"])
def test_the_agent_presets_reply_cap_is_the_room_a_32k_context_leaves(model_preset):
    """Neither harness sends max_tokens and codex reads `length` as a context overflow: with `--preset agent` after
    the model's, a prompt of up to 28 672 tokens and its reply fill 32 768 tokens, and its own run folder."""
    from ppo_affine.config import load_config

    train = load_config(presets=[model_preset, "agent"]).train
    generation = train.generation
    assert (generation.max_prompt_tokens, generation.max_new_tokens) == (28_672, 4_096)
    assert generation.max_prompt_tokens + generation.max_new_tokens == 32_768
    assert (generation.max_turns, generation.request_timeout, train.run.name) == (100, 900.0, "agent")


def test_the_agent_preset_checkpoints_activations_even_after_the_cpu_preset():
    """An agent episode is one sequence as long as its context, alone in its pass: without gradient checkpointing
    SmolLM2 (the cpu preset's model, which turns it off) holds 11.0 GB of tensors over an 8 190-token one, 1.7 GB
    with it (docs/benchmarks.md, "An agent episode's cost on the CPU")."""
    from ppo_affine.config import load_config

    assert load_config(presets=["cpu", "agent"]).train.model.gradient_checkpointing
    assert not load_config(presets=["cpu"]).train.model.gradient_checkpointing


# ---------------------------------------------------------------------- tiny-model PPO runs through each harness
@contextmanager
def harness_server(log_path: Path):
    """tests/harness_env behind affinetes' template server on 127.0.0.1, told where the harnesses are."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MINISWE_PYTHON": MINISWE_PYTHON or "", "CODEX_BIN": CODEX_BIN or ""}
    with open(log_path, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "uvicorn", "serve:app", "--app-dir", str(HARNESS_ENV),
                                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                                   stdout=log_file, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"{url}/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the harness env server did not start:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def two_ppo_steps(model_dir: Path, out: Path, url: str, evaluate_kwargs: dict, *sets: str) -> list[dict]:
    env = {"swe": {"kind": "evaluate", "mode": "url", "url": url, "timeout": 600, "evaluate_kwargs": evaluate_kwargs}}
    stages = [{"name": "s", "min_episodes": 1000, "tasks": [{"env": "swe", "task_id_ranges": [[0, 2]]}]}]
    args = tiny_args(model_dir, out, "--max-steps", "2", "--set", f"env.envs={json.dumps(env)}",
                     "--set", f"curriculum.stages={json.dumps(stages)}", "--set", "generation.max_new_tokens=6",
                     "--set", "generation.max_turns=10", *[arg for s in sets for arg in ("--set", s)])
    assert train_ppo.main(args) == 0
    return metrics(out / "t")


@pytest.mark.slow
@needs_miniswe
def test_two_ppo_steps_of_a_tiny_model_through_mini_swe_agent(tools_model_dir, tmp_path):
    """The tiny model never writes one bash block: each episode is 5 calls (the step limit), a format error after
    each, never submitted, score 0; one sequence per episode, all of it trained on."""
    with harness_server(tmp_path / "server.log") as url:
        records = two_ppo_steps(tools_model_dir, tmp_path, url, {"agent": "miniswe", "max_iterations": 5})
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert (record["env/episodes"], record["env/episodes_failed"], record["env/episodes_cut_off"]) == (4, 0, 0)
        assert (record["evaluate/calls"], record["evaluate/prefix_breaks"], record["env/turns_mean"]) == (20, 0, 5)
        assert record["env/score_mean"] == 0.0
        assert "policy/loss" in record and record["update/epochs_run"] >= 1 and record["update/skipped_total"] == 0
        # where the rollout's time went (bench/agent_episode_cost.py's table): the harnesses' own time, and our
        # generation's prefill (one per call: the harness's whole conversation, less what the episode's cache holds)
        # and decode steps
        assert record["perf/env_seconds"] > 0 and record["perf/prefill_seconds"] > 0
        assert record["perf/prefill_seconds"] + record["perf/decode_seconds"] <= record["perf/generation_seconds"]
        assert record["perf/generation_seconds"] + record["perf/env_seconds"] == pytest.approx(
            record["perf/rollout_seconds"])
        assert record["perf/prefill_rows"] == 20
        assert record["perf/decode_tokens"] + 20 == record["perf/generated_tokens"] <= 20 * 6
        assert record["perf/update_peak_rss_bytes"] >= record["perf/update_rss_rise_bytes"] >= 0
        assert record["perf/update_planned_bytes"] > 0 and record["perf/rollout_planned_bytes"] > 0


@pytest.mark.slow
@needs_codex
def test_two_ppo_steps_of_a_tiny_model_through_codex(tools_model_dir, tmp_path):
    """The tiny model never writes a tool call: codex takes its first reply as the final answer, one call an
    episode, no change, score 0. The prompt limit is raised for codex's long instructions (15 234 tokens of the
    tiny tokenizer); one update epoch, as each sequence is that long."""
    with harness_server(tmp_path / "server.log") as url:
        records = two_ppo_steps(tools_model_dir, tmp_path, url, {"agent": "codex"},
                                "generation.max_prompt_tokens=24000", "ppo.ppo_epochs=1")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert (record["env/episodes"], record["env/episodes_failed"], record["env/episodes_cut_off"]) == (4, 0, 0)
        assert (record["evaluate/calls"], record["evaluate/prefix_breaks"], record["env/turns_mean"]) == (4, 0, 1)
        assert record["env/score_mean"] == 0.0
        assert "policy/loss" in record and record["update/epochs_run"] >= 1 and record["update/skipped_total"] == 0
