"""A reply's text split the way the validators' server returns it: `reasoning_content`, `content`, `tool_calls`.

What a chat server hands a harness depends on the parsers it runs for the model; training must see the text that
validation sees. The validators serve with SGLang v0.5.14; one row per model family (`model_type` of the model's
config) names its parsers:
- `qwen3_5_moe` (Qwen3.6-35B-A3B): `--reasoning-parser qwen3 --tool-call-parser qwen3_coder` (qwen3_coder.py).
- `qwen3` (dense Qwen3-32B): no reasoning parser, so `<think>...</think>` stays in the content; tool calls as
  Hermes-style JSON (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), the form its chat template renders
  them in (the validators' notes name no tool parser for it: this row is our reading).
- any other family: the text is the content, no tool calls.

The request decides what is parsed, as SGLang decides it:
- tool calls only when the request has `tools` (a non-empty list) and `tool_choice` is not "none";
- the `qwen3` reasoning parser assumes the reply starts inside a reasoning block (the template opened `<think>`)
  unless thinking is switched off (`chat_template_kwargs.enable_thinking` false, or `reasoning_effort` "none"); the
  reasoning ends at `</think>`, or at a `<tool_call>` before any `</think>`; a reply cut off before either is all
  reasoning; `separate_reasoning: false` leaves the reasoning in the content. Reasoning and content keep their
  whitespace; the content is "" (never null) when empty.
- `finish_reason` "stop" becomes "tool_calls" when the reply holds `<tool_call>` (whole reply) or a call was sent
  (streamed); "length" stays.
A streamed reply is parsed as SGLang parses it a few characters at a time (`stream_pieces`), which differs from the
whole reply where the module qwen3_coder.py says so.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ppo_affine import qwen3_coder

THINK_START, THINK_END = "<think>", "</think>"
CALL_START = qwen3_coder.CALL_START
JSON_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
STREAM_PIECE = re.compile(r"<[^<>\n]{0,3}|[^<]{1,3}", re.DOTALL)


@dataclass(frozen=True)
class ReplyFormat:
    reasoning: bool  # the qwen3 reasoning parser runs
    tool_calls: str | None  # "qwen3_coder" (XML) or "hermes" (JSON); None: tool calls stay text


REPLY_FORMATS = {
    "qwen3_5_moe": ReplyFormat(reasoning=True, tool_calls="qwen3_coder"),
    "qwen3_5_moe_text": ReplyFormat(reasoning=True, tool_calls="qwen3_coder"),  # the text model saved alone
    "qwen3": ReplyFormat(reasoning=False, tool_calls="hermes"),
}
PLAIN = ReplyFormat(reasoning=False, tool_calls=None)


def reply_format_of(model_type: str | None) -> ReplyFormat:
    return REPLY_FORMATS.get(model_type or "", PLAIN)


@dataclass(frozen=True)
class ParseSettings:
    """What one request asks of the parsers (see the module's rules)."""
    tools: list[dict[str, Any]] | None = None  # the request's tools when its tool calls are parsed, else None
    thinking: bool = True  # the reply starts inside a reasoning block
    separate_reasoning: bool = True


def parses_tool_calls(body: dict[str, Any]) -> bool:
    """SGLang's rule: tools given and tool_choice not "none" (the default is "auto" with tools, "none" without)."""
    tools = body.get("tools")
    tool_choice = body.get("tool_choice") or ("none" if tools is None else "auto")
    return bool(tools) and tool_choice != "none"


def settings_of(body: dict[str, Any], template_kwargs: dict[str, Any]) -> ParseSettings:
    """A request's parse settings; `template_kwargs`: the chat-template kwargs its prompt was rendered with."""
    thinking_off = template_kwargs.get("enable_thinking") is False or (
        "enable_thinking" not in template_kwargs and body.get("reasoning_effort") == "none")
    return ParseSettings(tools=list(body["tools"]) if parses_tool_calls(body) else None, thinking=not thinking_off,
                         separate_reasoning=body.get("separate_reasoning", True) is not False)


@dataclass
class ParsedReply:
    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, arguments as JSON text
    finish_reason: str = "stop"


def parse_reply(text: str, reply_format: ReplyFormat, settings: ParseSettings = ParseSettings(),
                finish_reason: str = "stop", call_id: str = "call") -> ParsedReply:
    """A whole reply (`text`, decoded) as the server returns it; tool-call ids are `<call_id>_<n>`."""
    reasoning = None
    if reply_format.reasoning and settings.separate_reasoning:
        reasoning, text = split_reasoning(text, settings.thinking)
    if reply_format.tool_calls is None or settings.tools is None:
        return ParsedReply(text, reasoning or None, finish_reason=finish_reason)
    if reply_format.tool_calls == "qwen3_coder":
        found = qwen3_coder.one_shot(text, settings.tools)
    else:
        found = _json_calls(text)
    finish = "tool_calls" if finish_reason == "stop" and CALL_START in text else finish_reason
    return ParsedReply(found.content, reasoning or None, _openai_calls(found.calls, call_id), finish)


def stream_reply(text: str, reply_format: ReplyFormat, settings: ParseSettings = ParseSettings(),
                 finish_reason: str = "stop", call_id: str = "call") -> ParsedReply:
    """The same reply streamed: what a client that joins the deltas ends up with."""
    if reply_format.tool_calls != "qwen3_coder" and not reply_format.reasoning:
        return parse_reply(text, reply_format, settings, finish_reason, call_id)
    reasoning = None
    if reply_format.reasoning and settings.separate_reasoning:
        reasoning, text = streamed_reasoning(text, settings.thinking)
    if reply_format.tool_calls is None or settings.tools is None:
        return ParsedReply(text, reasoning or None, finish_reason=finish_reason)
    if reply_format.tool_calls == "qwen3_coder":
        found = qwen3_coder.streamed(text, settings.tools)
    else:
        found = _json_calls(text)
    finish = "tool_calls" if finish_reason == "stop" and found.calls else finish_reason
    return ParsedReply(found.content, reasoning or None, _openai_calls(found.calls, call_id), finish)


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, the rest) of a whole reply, by the qwen3 reasoning parser's rules."""
    if not thinking and THINK_START not in text:
        return None, text
    while text.startswith(THINK_START):
        text = text[len(THINK_START):]
    if THINK_END in text:
        reasoning, rest = text.split(THINK_END, 1)
        return reasoning, rest
    if CALL_START in text:  # a tool call before any </think> ends the reasoning
        return text[:text.index(CALL_START)], text[text.index(CALL_START):]
    return text, ""  # cut off while reasoning


def streamed_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, the rest) of a reply streamed in `stream_pieces`, joined as a client joins them."""
    parser = _StreamedReasoning(thinking)
    reasoning, rest = [], []
    for piece in stream_pieces(text):
        more_reasoning, more_rest = parser.feed(piece)
        reasoning.append(more_reasoning)
        rest.append(more_rest)
    return "".join(reasoning) or None, "".join(rest)


def stream_pieces(text: str) -> list[str]:
    """The reply in the pieces it is streamed in: a few characters (about a token) at a time, tags split apart."""
    return STREAM_PIECE.findall(text)


class _StreamedReasoning:
    """The qwen3 reasoning parser fed piece by piece: it holds back a piece that may begin a tag, drops the first
    `<think>` wherever it comes, and sends reasoning until `</think>` (or a `<tool_call>`), the rest after it."""

    def __init__(self, thinking: bool):
        self.buffer, self.in_reasoning, self.start_dropped = "", thinking, False

    def feed(self, piece: str) -> tuple[str, str]:
        self.buffer += piece
        text = self.buffer
        if any(tag.startswith(text) and tag != text for tag in (THINK_START, THINK_END, CALL_START)):
            return "", ""
        self.buffer = ""
        if not self.start_dropped and THINK_START in text:
            text = text.replace(THINK_START, "", 1)
            self.start_dropped = self.in_reasoning = True
        if not self.in_reasoning:
            return "", text
        end = text.find(THINK_END)
        if end != -1:
            self.in_reasoning = False
            return text[:end], text[end + len(THINK_END):]
        if CALL_START in text:
            self.in_reasoning = False
            return text[:text.index(CALL_START)], text[text.index(CALL_START):]
        return text, ""


def _openai_calls(calls: list[tuple[str, str]], call_id: str) -> list[dict[str, Any]]:
    return [{"id": f"{call_id}_{n}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for n, (name, arguments) in enumerate(calls)]


def _json_calls(text: str) -> qwen3_coder.ToolCalls:
    """Hermes-style JSON calls; the content is the text before the first call, or all of it when none parses."""
    calls = []
    for block in JSON_BLOCK.findall(text):
        try:
            call = json.loads(block.strip())
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", {})
            arguments = arguments if isinstance(arguments, dict) else {"value": arguments}
            calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return qwen3_coder.ToolCalls(text)
    return qwen3_coder.ToolCalls(text[:text.index(CALL_START)], calls)
