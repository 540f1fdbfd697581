"""The endpoint kind-`evaluate` envs call: OpenAI chat/completions from the trainer's generator, recorded call by call."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
from pathlib import Path

import httpx
import pytest

from ppo_affine.config import EndpointConfig, GenerationConfig
from ppo_affine.endpoint import CallRecord, ChatEndpoint, pack_calls, tools_for_template
from ppo_affine.generation import Generation
from ppo_affine.prompts import PromptBuilder
from ppo_affine.reply_parsers import REPLY_FORMATS

FOREIGN_ENV = Path(__file__).parent / "foreign_env"


def _foreign_env():
    """tests/foreign_env/env.py, the foreign env, imported to be called in process."""
    spec = importlib.util.spec_from_file_location("foreign_env", FOREIGN_ENV / "env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOLS, Actor = _foreign_env().TOOLS, _foreign_env().Actor

# A ChatML template that renders tools, tool calls (Hermes JSON) and tool results, as Qwen3's does in short.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{%- elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HERMES = REPLY_FORMATS["qwen3"]


@pytest.fixture(scope="module")
def tokenizer():
    from ppo_affine.testing.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


class ScriptedGenerator:
    """Replies from a list, each its text's ids + EOS, with made-up log-probs and adapter step 7."""

    def __init__(self, tokenizer, replies: list[str], eos_at_end: bool = True):
        self.tokenizer, self.replies, self.eos_at_end = tokenizer, list(replies), eos_at_end
        self.eos_ids = {tokenizer.eos_token_id}
        self.requests: list[tuple[list[int], int, int]] = []

    async def generate(self, prompt_ids, order_key, seed):
        self.requests.append((list(prompt_ids), order_key, seed))
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
        ids += [self.tokenizer.eos_token_id] if self.eos_at_end else []
        return Generation(ids, [-0.25] * len(ids), adapter_step=7)


def endpoint_of(tokenizer, replies, reply_format=HERMES, eos_at_end=True, **generation) -> ChatEndpoint:
    cfg = GenerationConfig(**{"max_new_tokens": 512, "max_prompt_tokens": 2048, "temperature": 1.0, **generation})
    return ChatEndpoint(ScriptedGenerator(tokenizer, replies, eos_at_end), PromptBuilder(tokenizer, cfg.max_prompt_tokens),
                        cfg, reply_format, "tiny", EndpointConfig())


async def post(endpoint: ChatEndpoint, path: str, body: dict, key: str | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=endpoint.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://endpoint") as client:
        return await client.post(f"/episodes/{key}/v1{path}", json=body)


def one_episode(endpoint: ChatEndpoint):
    return endpoint.open_episode(3, (11, 22, 0, 3))


# ---------------------------------------------------------------------- chat completions
def test_a_chat_call_answers_parsed_and_records_prompt_ids_sampled_ids_logprobs_and_adapter_step(tokenizer):
    endpoint = endpoint_of(tokenizer, ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'])
    door = one_episode(endpoint)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    response = asyncio.run(post(endpoint, "/chat/completions", {"model": "x", "messages": messages, "tools": TOOLS},
                                door.key))
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == ""  # SGLang never sends null content
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    [call] = endpoint.close_episode(door)
    rendered = tokenizer.apply_chat_template(messages, tools=tools_for_template({"tools": TOOLS}),
                                             add_generation_prompt=True, tokenize=False)
    assert call.prompt_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert call.token_ids[-1] == tokenizer.eos_token_id
    assert call.logprobs == [-0.25] * len(call.token_ids) and call.adapter_step == 7
    assert response.json()["usage"]["prompt_tokens"] == len(call.prompt_ids)


def test_the_tool_result_turn_reuses_the_sampled_ids_and_extends_the_prompt_token_for_token(tokenizer):
    tool_call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    endpoint = endpoint_of(tokenizer, [tool_call, "5"])
    door = one_episode(endpoint)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = asyncio.run(post(endpoint, "/chat/completions", {"messages": messages, "tools": TOOLS}, door.key)).json()
    message = first["choices"][0]["message"]
    messages += [{"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]},
                 {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5"}]
    asyncio.run(post(endpoint, "/chat/completions", {"messages": messages, "tools": TOOLS}, door.key))
    one, two = endpoint.close_episode(door)
    assert two.prompt_ids[:len(one.prompt_ids) + len(one.token_ids)] == one.prompt_ids + one.token_ids
    sequences, placements, breaks = pack_calls([one, two])
    assert (len(sequences), breaks) == (1, 0)
    assert placements == [(0, len(one.prompt_ids)), (0, len(two.prompt_ids))]


def test_a_streamed_call_sends_role_content_finish_usage_and_done_as_server_sent_events(tokenizer):
    endpoint = endpoint_of(tokenizer, ["<think>hm</think>The sum is 5"], reply_format=REPLY_FORMATS["qwen3_5_moe"])
    door = one_episode(endpoint)
    body = {"messages": [{"role": "user", "content": "2 + 3?"}], "stream": True,
            "stream_options": {"include_usage": True}}
    response = asyncio.run(post(endpoint, "/chat/completions", body, door.key))
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert deltas[:3] == [{"role": "assistant", "content": ""}, {"reasoning_content": "hm"},
                          {"content": "The sum is 5"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_a_reply_that_reaches_max_new_tokens_finishes_with_length(tokenizer):
    endpoint = endpoint_of(tokenizer, ["one two three four five six"], eos_at_end=False, max_new_tokens=3)
    door = one_episode(endpoint)
    response = asyncio.run(post(endpoint, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                door.key))
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_prompt_over_the_budget_is_answered_as_sglang_answers_a_context_overflow_and_cuts_the_episode_off(tokenizer):
    endpoint = endpoint_of(tokenizer, ["never"], max_prompt_tokens=16, max_new_tokens=8)
    door = one_episode(endpoint)
    response = asyncio.run(post(endpoint, "/chat/completions",
                                {"messages": [{"role": "user", "content": "word " * 40}]}, door.key))
    assert response.status_code == 400
    body = response.json()
    render = tokenizer.apply_chat_template([{"role": "user", "content": "word " * 40}], add_generation_prompt=True,
                                           tokenize=False)
    n = len(tokenizer(render, add_special_tokens=False)["input_ids"])
    assert body == {"object": "error", "type": "BadRequest", "param": None, "code": 400,
                    "message": f"The input ({n} tokens) is longer than the model's context length (16 tokens)."}
    assert door.cut_off == "context"
    assert endpoint.generator.requests == [] and endpoint.close_episode(door) == []


def test_calls_past_max_turns_are_answered_as_a_context_limit_and_cut_the_episode_off(tokenizer):
    endpoint = endpoint_of(tokenizer, ["a", "b"], max_turns=1)
    door = one_episode(endpoint)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert asyncio.run(post(endpoint, "/chat/completions", body, door.key)).status_code == 200
    refused = asyncio.run(post(endpoint, "/chat/completions", body, door.key))
    assert refused.status_code == 400 and door.cut_off == "max_turns"
    assert refused.json()["message"].startswith("The input is longer than the model's context length: this episode "
                                                "has made 1 model calls, the trainer's limit (generation.max_turns=1)")


def test_the_runs_sampling_settings_win_and_the_difference_is_logged_once(tokenizer, caplog):
    endpoint = endpoint_of(tokenizer, ["a", "b"], temperature=1.0, max_new_tokens=64)
    door = one_episode(endpoint)
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.2}
    with caplog.at_level(logging.WARNING, logger="ppo_affine.endpoint"):
        for _ in range(2):
            asyncio.run(post(endpoint, "/chat/completions", body, door.key))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["an evaluate() harness asked for temperature=0.2; the run's generation.temperature=1.0 applies",
                     "an evaluate() harness asked for no max_tokens; the run's cap generation.max_new_tokens=64 "
                     "applies"]


def test_the_harnesses_max_tokens_applies_up_to_the_runs_cap(tokenizer, caplog):
    endpoint = endpoint_of(tokenizer, ["one two three four five six"] * 3, max_new_tokens=4, eos_at_end=False)
    door = one_episode(endpoint)
    with caplog.at_level(logging.WARNING, logger="ppo_affine.endpoint"):
        for asked in (2, 100, 100):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": asked}
            choice = asyncio.run(post(endpoint, "/chat/completions", body, door.key)).json()["choices"][0]
            assert choice["finish_reason"] == "length"
    calls = endpoint.close_episode(door)
    full = tokenizer.encode("one two three four five six", add_special_tokens=False)
    # the scripted model ignores the caps; a server told max_tokens=k samples its first k tokens
    assert [call.token_ids for call in calls] == [full[:2], full[:4], full[:4]]
    assert [len(call.logprobs) for call in calls] == [2, 4, 4]
    assert calls[0].text == tokenizer.decode(full[:2])
    assert [r.getMessage() for r in caplog.records] == [
        "an evaluate() harness asked for max_tokens=100; the run's cap generation.max_new_tokens=4 applies"]


def test_request_fields_the_endpoint_does_not_apply_are_named_once(tokenizer, caplog):
    endpoint = endpoint_of(tokenizer, ["a", "b"])
    door = one_episode(endpoint)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 3, "frequency_penalty": 0,
            "presence_penalty": 0.5, "user": "me", "tools": TOOLS, "tool_choice": "required"}
    with caplog.at_level(logging.WARNING, logger="ppo_affine.endpoint"):
        for _ in range(2):
            asyncio.run(post(endpoint, "/chat/completions", body, door.key))
    assert [r.getMessage() for r in caplog.records] == [
        "an evaluate() harness sent seed=3, which this endpoint does not apply",
        "an evaluate() harness sent presence_penalty=0.5, which this endpoint does not apply",
        'an evaluate() harness sent tool_choice="required": the reply is parsed as SGLang parses it, but generation '
        "is not constrained to a tool call"]


def test_calls_sample_with_seeds_of_the_episode_and_call_and_keep_the_episodes_cache_key(tokenizer):
    from ppo_affine.seeds import derive_seed

    endpoint = endpoint_of(tokenizer, ["a", "b"])
    door = one_episode(endpoint)
    for _ in range(2):
        asyncio.run(post(endpoint, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, door.key))
    assert [(key, seed) for _, key, seed in endpoint.generator.requests] == [
        (3, derive_seed(11, 22, 0, 3, 0)), (3, derive_seed(11, 22, 0, 3, 1))]


def test_an_unknown_or_finished_episode_is_a_404_and_records_nothing(tokenizer):
    endpoint = endpoint_of(tokenizer, ["a"])
    door = one_episode(endpoint)
    endpoint.close_episode(door)
    response = asyncio.run(post(endpoint, "/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                                door.key))
    assert response.status_code == 404 and "no live episode" in response.json()["message"]
    assert door.calls == []


def test_text_completions_take_the_prompt_as_it_is(tokenizer):
    endpoint = endpoint_of(tokenizer, [" world"])
    door = one_episode(endpoint)
    response = asyncio.run(post(endpoint, "/completions", {"prompt": "hello"}, door.key))
    assert response.json()["choices"][0]["text"] == " world"
    [call] = endpoint.close_episode(door)
    assert call.prompt_ids == tokenizer("hello")["input_ids"] and call.render is None


class CountingGenerator(ScriptedGenerator):
    """Holds each reply a moment and counts the replies in flight at once."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, replies)
        self.in_flight = self.most_in_flight = 0

    async def generate(self, prompt_ids, order_key, seed):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.02)
        self.in_flight -= 1
        return await super().generate(prompt_ids, order_key, seed)


def test_at_most_max_concurrent_episodes_calls_generate_at_once(tokenizer):
    endpoint = endpoint_of(tokenizer, [], max_concurrent_episodes=2)
    endpoint.generator = CountingGenerator(tokenizer, ["a"] * 6)
    doors = [endpoint.open_episode(i, (i,)) for i in range(6)]

    async def all_at_once():
        body = {"messages": [{"role": "user", "content": "hi"}]}
        return await asyncio.gather(*(post(endpoint, "/chat/completions", body, door.key) for door in doors))

    assert [r.status_code for r in asyncio.run(all_at_once())] == [200] * 6
    assert endpoint.generator.most_in_flight == 2


# ---------------------------------------------------------------------- as the validators' SGLang answers
GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "sglang_0_5_14" / "replies.json").read_text())
QWEN3_6 = REPLY_FORMATS["qwen3_5_moe"]
XML_CALL = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>"


def chat(endpoint: ChatEndpoint, door, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], **body}
    return asyncio.run(post(endpoint, "/chat/completions", body, door.key))


def test_tools_reach_the_template_as_sglangs_tool_model_dumps_them():
    assert tools_for_template({"tools": GOLDEN["tools"]}) == GOLDEN["tools_as_rendered"]
    named = {"tools": GOLDEN["tools"], "tool_choice": {"type": "function", "function": {"name": "submit"}}}
    assert [t["function"]["name"] for t in tools_for_template(named)] == ["submit"]
    assert tools_for_template({"tools": GOLDEN["tools"], "tool_choice": "none"}) is None


def test_without_tools_or_with_tool_choice_none_a_tool_call_stays_content_and_the_template_gets_no_tools(tokenizer):
    endpoint = endpoint_of(tokenizer, ["done\n</think>\n\n" + XML_CALL] * 2, reply_format=QWEN3_6)
    door = one_episode(endpoint)
    for body in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        choice = chat(endpoint, door, **body).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] is None
        assert choice["message"]["content"] == "\n\n" + XML_CALL and choice["message"]["reasoning_content"] == "done\n"
    first, second = endpoint.close_episode(door)
    assert first.prompt_ids == second.prompt_ids  # no tools rendered in either
    assert "Tools:" not in tokenizer.decode(second.prompt_ids)


def test_with_tools_the_xml_call_is_parsed_typed_by_the_schema_and_finishes_with_tool_calls(tokenizer):
    endpoint = endpoint_of(tokenizer, ["add\n</think>\n\n" + XML_CALL], reply_format=QWEN3_6)
    door = one_episode(endpoint)
    choice = chat(endpoint, door, tools=TOOLS).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert (choice["message"]["content"], choice["message"]["reasoning_content"]) == ("\n\n", "add\n")
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}


def test_a_stop_string_ends_the_reply_before_it_and_keeps_only_the_tokens_sampled_up_to_it(tokenizer):
    endpoint = endpoint_of(tokenizer, ["add\n</think>\n\nrunning\n" + XML_CALL], reply_format=QWEN3_6)
    door = one_episode(endpoint)
    choice = chat(endpoint, door, tools=TOOLS, stop=["<tool_call>"]).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] is None
    assert choice["message"]["content"] == "\n\nrunning\n"
    [call] = endpoint.close_episode(door)
    decoded = tokenizer.decode(call.token_ids)
    assert "<tool_call>" in decoded and "<tool_call>" not in tokenizer.decode(call.token_ids[:-1])
    assert tokenizer.eos_token_id not in call.token_ids and len(call.logprobs) == len(call.token_ids)
    assert call.eos_text == ""


def test_special_tokens_stay_in_the_reply_when_tools_are_given_and_are_skipped_otherwise(tokenizer):
    reply = "a<|im_start|>b"
    endpoint = endpoint_of(tokenizer, [reply, reply])
    door = one_episode(endpoint)
    assert chat(endpoint, door, tools=TOOLS).json()["choices"][0]["message"]["content"] == "a<|im_start|>b"
    assert chat(endpoint, door).json()["choices"][0]["message"]["content"] == "ab"


def test_a_streamed_reply_cut_off_inside_a_call_sends_its_name_and_whole_parameters_only(tokenizer):
    cut_off = "add\n</think>\n\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3"
    length = len(tokenizer.encode(cut_off, add_special_tokens=False))  # the reply ran into the token limit
    endpoint = endpoint_of(tokenizer, [cut_off, cut_off], reply_format=QWEN3_6, eos_at_end=False, max_new_tokens=length)
    door = one_episode(endpoint)
    events = chat(endpoint, door, tools=TOOLS, stream=True).text.splitlines()
    chunks = [json.loads(line[6:]) for line in events if line.startswith("data: {")]
    calls = [call for chunk in chunks for delta in [chunk["choices"][0]["delta"]] for call in delta.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("add", '{"a": 2')]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = chat(endpoint, door, tools=TOOLS).json()["choices"][0]  # the one-shot parser reads the cut-off value
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": 3}'


def test_thinking_switched_off_leaves_a_reply_without_think_all_content(tokenizer):
    endpoint = endpoint_of(tokenizer, ["The answer is 5.", "The answer is 5."], reply_format=QWEN3_6)
    door = one_episode(endpoint)
    off = chat(endpoint, door, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    on = chat(endpoint, door).json()["choices"][0]["message"]
    assert (off["content"], off["reasoning_content"]) == ("The answer is 5.", None)
    assert (on["content"], on["reasoning_content"]) == ("", "The answer is 5.")  # the template opened <think>


def test_assistant_tool_call_arguments_that_are_not_a_json_object_are_a_400(tokenizer):
    endpoint = endpoint_of(tokenizer, ["never"])
    door = one_episode(endpoint)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "5"}]
    response = chat(endpoint, door, messages=messages, tools=TOOLS)
    assert response.status_code == 400 and "must be valid JSON" in response.json()["message"]
    assert endpoint.generator.requests == []


# ---------------------------------------------------------------------- packing
def record(index: int, prompt: list[int], reply: list[int]) -> CallRecord:
    return CallRecord(index=index, prompt_ids=prompt, token_ids=reply, logprobs=None, adapter_step=None, text="",
                      finish_reason="stop")


def test_calls_that_extend_pack_into_one_sequence_and_a_re_render_starts_another():
    calls = [record(0, [1, 2], [3]), record(1, [1, 2, 3, 4], [5]), record(2, [1, 9], [6]),
             record(3, [1, 2, 3, 4, 5, 7], [8])]
    sequences, placements, breaks = pack_calls(calls)
    assert sequences == [[1, 2, 3, 4, 5, 7, 8], [1, 9, 6]]
    assert placements == [(0, 2), (0, 4), (1, 2), (0, 6)]
    assert breaks == 1


# ---------------------------------------------------------------------- the foreign env over HTTP
def test_the_foreign_env_streams_calls_the_tool_and_breaks_the_prefix_once(tokenizer):
    tool_call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    endpoint = endpoint_of(tokenizer, [tool_call, "It is 5", "5"])

    async def play():
        await endpoint.start()
        try:
            door = one_episode(endpoint)
            result = await Actor().evaluate(task_id=32, seed=1, base_url=door.url, timeout=30)
            return result, endpoint.close_episode(door)
        finally:
            await endpoint.close()

    result, calls = asyncio.run(play())
    assert result["score"] == 1.0
    assert [m["role"] for m in result["extra"]["conversation"]] == ["system", "user", "assistant"]
    sequences, placements, breaks = pack_calls(calls)
    assert [s for s, _ in placements] == [0, 0, 1] and breaks == 1
    tool_turn = tokenizer.decode(calls[1].prompt_ids)
    assert "<tool_response>\n5\n</tool_response>" in tool_turn
