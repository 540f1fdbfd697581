"""Replies split as the validators' server (SGLang v0.5.14, qwen3 reasoning parser, qwen3_coder tool-call parser)
splits them: each case in tests/fixtures/sglang_0_5_14/replies.json is what SGLang's own serving code returned for
a reply text (recorded by record_replies.py beside it), whole and streamed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_affine.reply_parsers import (PLAIN, REPLY_FORMATS, ParseSettings, parse_reply, parses_tool_calls,
                                      settings_of, stream_pieces, stream_reply)
from ppo_affine.stop_strings import matched_stop, stop_strings_of, tokens_until_stop, trim_at_stop

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "sglang_0_5_14" / "replies.json").read_text())
QWEN3_6 = REPLY_FORMATS["qwen3_5_moe"]
CASES = {case["rule"]: case for case in GOLDEN["cases"]}


def settings(request: dict) -> ParseSettings:
    return settings_of(request, request.get("chat_template_kwargs") or {})


def as_recorded(parsed) -> dict:
    return {"content": parsed.content, "reasoning_content": parsed.reasoning_content,
            "tool_calls": [dict(call["function"]) for call in parsed.tool_calls], "finish_reason": parsed.finish_reason}


def test_the_golden_cases_came_from_sglang_0_5_14_and_cover_every_rule():
    assert GOLDEN["source"].startswith("sglang 0.5.14 (PyPI)") and "Qwen3CoderDetector" in GOLDEN["source"]
    kinds = {rule.split(":")[0] for rule in CASES}
    assert {"no tools", "tool_choice none", "values", "several function blocks in one tool_call", "stop",
            "reasoning", "only a cut-off call, inside its value"} <= kinds | set(CASES)
    assert len(CASES) == len(GOLDEN["cases"]) == 39


@pytest.mark.parametrize("rule", list(CASES))
def test_a_whole_reply_is_split_as_sglang_splits_it(rule):
    case = CASES[rule]
    parsed = parse_reply(case["reply"], QWEN3_6, settings(case["request"]), case["engine_finish"])
    assert as_recorded(parsed) == case["one_shot"]


@pytest.mark.parametrize("rule", list(CASES))
def test_a_streamed_reply_joins_to_what_sglang_streams(rule):
    case = CASES[rule]
    parsed = stream_reply(case["reply"], QWEN3_6, settings(case["request"]), case["engine_finish"])
    assert as_recorded(parsed) == case["streamed"]


@pytest.mark.parametrize("rule", [rule for rule in CASES if rule.startswith("stop")])
def test_a_stop_string_cuts_the_reply_before_it(rule):
    case = CASES[rule]
    stops = stop_strings_of(case["request"])
    chars = list(case["text"])  # one "token" per character
    kept, stop = tokens_until_stop(chars, "".join, stops)
    assert trim_at_stop("".join(chars[:kept]), stop) == case["reply"]


def test_the_stop_cut_keeps_the_tokens_up_to_the_one_that_completes_the_stop_string():
    tokens = ["ab", "c<to", "ol_", "call>", "x"]
    assert tokens_until_stop(tokens, "".join, ["<tool_call>"]) == (4, "<tool_call>")
    assert tokens_until_stop(tokens, "".join, ["zz"]) is None and tokens_until_stop(tokens, "".join, []) is None
    assert matched_stop("a b", ["c", "b", "a"]) == "b"  # the request's order decides among those present
    assert stop_strings_of({"stop": "x"}) == ["x"] and stop_strings_of({"stop": ["", "y"]}) == ["y"]


def test_tool_calls_are_parsed_only_with_tools_and_tool_choice_not_none():
    assert not parses_tool_calls({}) and not parses_tool_calls({"tools": []})
    assert not parses_tool_calls({"tools": [{"function": {"name": "f"}}], "tool_choice": "none"})
    assert parses_tool_calls({"tools": [{"function": {"name": "f"}}]})
    assert parses_tool_calls({"tools": [{"function": {"name": "f"}}], "tool_choice": "required"})


def test_thinking_is_off_only_when_the_template_kwargs_or_reasoning_effort_say_so():
    assert settings_of({}, {}).thinking and settings_of({"reasoning_effort": "low"}, {}).thinking
    assert not settings_of({}, {"enable_thinking": False}).thinking
    assert not settings_of({"reasoning_effort": "none"}, {}).thinking
    assert settings_of({"reasoning_effort": "none"}, {"enable_thinking": True}).thinking  # an explicit kwarg wins


def test_the_stream_pieces_join_back_to_the_reply_and_split_tags_apart():
    text = "ab<tool_call>\n<function=f>xyzw"
    assert "".join(stream_pieces(text)) == text
    assert stream_pieces(text)[:4] == ["ab", "<too", "l_c", "all"]


def test_dense_qwen3_keeps_think_in_the_content_and_parses_json_tool_calls():
    text = '<think>x</think>ok<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    parsed = parse_reply(text, REPLY_FORMATS["qwen3"], ParseSettings(tools=[{"function": {"name": "add"}}]))
    assert parsed.reasoning_content is None and parsed.content == "<think>x</think>ok"
    assert parsed.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert parsed.finish_reason == "tool_calls"


def test_other_families_parse_nothing():
    parsed = parse_reply("<think>a</think><tool_call>", PLAIN, ParseSettings(tools=[{"function": {"name": "f"}}]))
    assert (parsed.content, parsed.reasoning_content, parsed.tool_calls) == ("<think>a</think><tool_call>", None, [])
