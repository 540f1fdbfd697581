"""Qwen3.6-35B-A3B's own chat template (tests/fixtures/qwen3_6/chat_template.jinja) behind the endpoint: a reply goes
out parsed as the validators' server parses it, comes back in the harness's next request, and is rendered again by
the template. Where the template writes the reply back as the model wrote it, the calls pack into one training
sequence; where it cannot (a boolean or a number written another way, reasoning the harness or the template drops),
the next prompt does not extend the last one and the prefix break is counted."""
from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from ppo_affine.config import EndpointConfig, GenerationConfig
from ppo_affine.endpoint import ChatEndpoint, pack_calls, tools_for_template
from ppo_affine.generation import Generation
from ppo_affine.prompts import PromptBuilder
from ppo_affine.reply_parsers import REPLY_FORMATS

TEMPLATE = Path(__file__).parent / "fixtures" / "qwen3_6" / "chat_template.jinja"
TOOLS = [{"type": "function", "function": {"name": "run", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"},
                                     "force": {"type": "boolean"}, "ratio": {"type": "number"}},
    "required": ["cmd"]}}}]


def xml_call(**parameters: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function=run>\n{body}</function>\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer():
    from ppo_affine.testing.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


class Replies:
    """The model: each reply's ids + EOS, in order."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.eos_ids = {tokenizer.eos_token_id}

    async def generate(self, prompt_ids, order_key, seed):
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Generation(ids, [-0.5] * len(ids), adapter_step=1)


def harness(tokenizer, replies: list[str], observation_role: str = "tool", keep_reasoning: bool = True,
            template_kwargs: dict | None = None):
    """A harness's loop: ask, run every tool call it gets (its result as a `tool` or a `user` message), ask again,
    sending each reply back as the endpoint returned it (without its reasoning when `keep_reasoning` is off, as
    litellm-based clients do). Returns the endpoint's records of the calls."""
    cfg = GenerationConfig(max_new_tokens=256, max_prompt_tokens=4096)
    endpoint = ChatEndpoint(Replies(tokenizer, replies), PromptBuilder(tokenizer, cfg.max_prompt_tokens), cfg,
                            REPLY_FORMATS["qwen3_5_moe"], "qwen3.6", EndpointConfig())
    door = endpoint.open_episode(0, (1,))
    messages = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": "List the files."}]

    async def play():
        transport = httpx.ASGITransport(app=endpoint.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://endpoint") as client:
            for _ in replies:
                body = {"messages": messages, "tools": TOOLS, **({"chat_template_kwargs": template_kwargs}
                                                                  if template_kwargs else {})}
                response = await client.post(f"/episodes/{door.key}/v1/chat/completions", json=body)
                message = response.json()["choices"][0]["message"]
                if not keep_reasoning:
                    message.pop("reasoning_content")
                messages.append(message)
                for call in message.get("tool_calls") or []:
                    messages.append({"role": observation_role, "tool_call_id": call["id"], "content": "a.txt b.txt"}
                                    if observation_role == "tool" else
                                    {"role": "user", "content": "Output: a.txt b.txt"})

    asyncio.run(play())
    return endpoint.close_episode(door)


def test_the_fixture_is_the_released_template():
    assert hashlib.md5(TEMPLATE.read_bytes()).hexdigest() == "52b6d51ae5b203cb67e64b648494dad2"


def test_reasoning_content_and_several_calls_round_trip_and_the_calls_pack_into_one_sequence(tokenizer):
    first = ("The user wants files.\n</think>\n\nI will look.\n\n" + xml_call(cmd="ls -la", timeout="30") + "\n"
             + xml_call(cmd="pwd", ratio="0.5"))
    calls = harness(tokenizer, [first, "Two files.\n</think>\n\nThere are two files: a.txt and b.txt."])
    one, two = calls
    assert two.prompt_ids[:len(one.prompt_ids) + len(one.token_ids)] == one.prompt_ids + one.token_ids
    sequences, placements, breaks = pack_calls(calls)
    assert (len(sequences), breaks) == (1, 0)
    rendered = tokenizer.decode(two.prompt_ids)
    assert rendered.endswith("<tool_response>\na.txt b.txt\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                             "<think>\n")
    assert "<|im_start|>user\n<tool_response>\na.txt b.txt\n</tool_response>\n<tool_response>" in rendered


def test_a_reply_without_thinking_round_trips_when_thinking_is_switched_off(tokenizer):
    calls = harness(tokenizer, [xml_call(cmd="ls"), "Done."], template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(calls[0].prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert pack_calls(calls)[2] == 0


@pytest.mark.parametrize("written, reason", [
    (xml_call(cmd="ls", force="True"), "a boolean comes back as true"),
    (xml_call(cmd="ls", ratio="1e3"), "a number comes back as 1000.0"),
    (xml_call(cmd="ls", timeout=" 30"), "an integer comes back without its space"),
])
def test_a_value_the_template_writes_back_another_way_breaks_the_prefix_once(tokenizer, written, reason):
    calls = harness(tokenizer, ["Run it.\n</think>\n\n" + written, "Done.\n</think>\n\nDone."])
    assert pack_calls(calls)[2] == 1, reason


def test_reasoning_the_harness_drops_breaks_the_prefix(tokenizer):
    calls = harness(tokenizer, ["Run it.\n</think>\n\n" + xml_call(cmd="ls"), "Done.\n</think>\n\nDone."],
                    keep_reasoning=False)
    assert pack_calls(calls)[2] == 1
    assert "<think>\n\n</think>\n\n<tool_call>" in tokenizer.decode(calls[1].prompt_ids)


def test_an_observation_sent_as_a_user_message_makes_the_template_drop_the_earlier_reasoning(tokenizer):
    replies = ["Run it.\n</think>\n\n" + xml_call(cmd="ls"), "Again.\n</think>\n\n" + xml_call(cmd="pwd"),
               "Done.\n</think>\n\nDone."]
    calls = harness(tokenizer, replies, observation_role="user")
    assert pack_calls(calls)[2] == 2  # each new user message is the last query: the turns before it lose <think>
    assert "Run it." not in tokenizer.decode(calls[1].prompt_ids)
    assert pack_calls(harness(tokenizer, replies, observation_role="tool"))[2] == 0


def fifty_turns() -> list[dict]:
    """A 50-turn agent conversation: each turn reasoning, a call, and its result."""
    messages = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": "Fix the bug."}]
    for n in range(50):
        messages += [{"role": "assistant", "content": "", "reasoning_content": f"step {n}: look at file {n}",
                      "tool_calls": [{"id": f"c{n}", "type": "function", "function": {
                          "name": "run", "arguments": json.dumps({"cmd": f"cat src/module_{n}.py"})}}]},
                     {"role": "tool", "tool_call_id": f"c{n}", "content": f"def f{n}(x):\n    return x + {n}\n" * 8}]
    return messages


def test_a_50_turn_call_renders_off_the_event_loop_while_decode_steps_go_on(tokenizer, monkeypatch):
    """The render and the tokenisation of a 50-turn call are each held until the event loop has run 3 more decode
    steps: on the event loop they could never finish (no step could run), on their worker they finish with the
    decode steps going on between them."""
    import ppo_affine.endpoint as endpoint_module

    cfg = GenerationConfig(max_new_tokens=64, max_prompt_tokens=100_000)
    endpoint = ChatEndpoint(Replies(tokenizer, ["Done.\n</think>\n\nFixed."]),
                            PromptBuilder(tokenizer, cfg.max_prompt_tokens), cfg, REPLY_FORMATS["qwen3_5_moe"],
                            "qwen3.6", EndpointConfig())
    door = endpoint.open_episode(0, (1,))
    steps, phases, finished = [0], [], threading.Event()

    def held(name, work):
        def run(*args):
            begin = steps[0]
            deadline = time.monotonic() + 30  # a guard against a hang, not a timing
            while steps[0] < begin + 3:
                assert time.monotonic() < deadline, f"no decode step ran while the call's {name} was held"
                time.sleep(0.001)
            phases.append((name, begin, steps[0]))
            return work(*args)
        return run

    monkeypatch.setattr(endpoint_module, "render_request", held("render", endpoint_module.render_request))
    endpoint.worker_prompts.tokenize = held("tokenisation", endpoint.worker_prompts.tokenize)

    async def decode_steps():
        while not finished.is_set():
            steps[0] += 1
            await asyncio.sleep(0)

    async def both():
        body = {"messages": fifty_turns(), "tools": TOOLS}
        transport = httpx.ASGITransport(app=endpoint.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://endpoint") as client:
            async def call():
                try:
                    return await client.post(f"/episodes/{door.key}/v1/chat/completions", json=body)
                finally:
                    finished.set()

            response, _ = await asyncio.gather(call(), decode_steps())
        return response

    response = asyncio.run(both())
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "\n\nFixed."
    assert [(name, end - begin >= 3) for name, begin, end in phases] == [("render", True), ("tokenisation", True)]
    [call] = endpoint.close_episode(door)
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if "tool_calls" in m else m for m in fifty_turns()]
    render = tokenizer.apply_chat_template(messages, tools=tools_for_template({"tools": TOOLS}),
                                           add_generation_prompt=True, tokenize=False)
    assert call.prompt_ids == tokenizer(render, add_special_tokens=False)["input_ids"]  # as rendered on the loop
