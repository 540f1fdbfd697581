"""A reply's text split the way the validators' server returns it: `reasoning_content`, `content`, `tool_calls`.

What a chat server hands a harness depends on the parsers it runs for the model; training must see the text that
validation sees. One row per model family (`model_type` of the model's config) names them:
- `qwen3_5_moe` (Qwen3.6-35B-A3B): a `<think>` reasoning parser (the reasoning ends at `</think>`; the template may
  open the block in the generation prompt, so a reply can hold only its end) and XML tool calls in the qwen3_coder
  style (`<tool_call><function=NAME><parameter=ARG>VALUE</parameter></function></tool_call>`).
- `qwen3` (dense Qwen3-32B): no reasoning parser, so `<think>...</think>` stays in the content; tool calls as
  Hermes-style JSON (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), the form its chat template renders
  them in (the validators' notes name no tool parser for it: this row is our reading).
- any other family: the text is the content, no tool calls.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@dataclass(frozen=True)
class ReplyFormat:
    reasoning: bool  # a <think> reasoning parser runs
    tool_calls: str | None  # "qwen3_coder" (XML) or "hermes" (JSON); None: tool calls stay text


REPLY_FORMATS = {
    "qwen3_5_moe": ReplyFormat(reasoning=True, tool_calls="qwen3_coder"),
    "qwen3_5_moe_text": ReplyFormat(reasoning=True, tool_calls="qwen3_coder"),  # the text model saved alone
    "qwen3": ReplyFormat(reasoning=False, tool_calls="hermes"),
}
PLAIN = ReplyFormat(reasoning=False, tool_calls=None)


def reply_format_of(model_type: str | None) -> ReplyFormat:
    return REPLY_FORMATS.get(model_type or "", PLAIN)


@dataclass
class ParsedReply:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, arguments as a JSON string


def parse_reply(text: str, reply_format: ReplyFormat, tools: list[dict[str, Any]] | None = None,
                reasoning_open: bool = False, call_id: str = "call") -> ParsedReply:
    """`text` (the decoded reply) as the server returns it. `reasoning_open`: the prompt ended inside a <think>
    block the template opened; `tools`: the request's, whose parameter types turn XML values into JSON values;
    tool-call ids are `<call_id>_<n>`."""
    reasoning = None
    if reply_format.reasoning and (reasoning_open or THINK_START in text):
        inner = text.replace(THINK_START, "", 1)
        if THINK_END not in inner:  # cut off while reasoning: all of it is reasoning
            return ParsedReply(content=None, reasoning_content=inner.strip() or None)
        reasoning, text = inner.split(THINK_END, 1)
        reasoning, text = reasoning.strip() or None, text.strip()
    if reply_format.tool_calls is None or "<tool_call>" not in text:
        # after a reasoning block an empty answer is no content; a plain reply is its text, even empty
        content = (text or None) if reasoning is not None else text
        return ParsedReply(content=content, reasoning_content=reasoning)
    before = text[: text.index("<tool_call>")].strip()
    parse = _xml_call if reply_format.tool_calls == "qwen3_coder" else _json_call
    calls = [call for block in TOOL_CALL_BLOCK.findall(text) for call in [parse(block, tools or [])] if call]
    if not calls:  # nothing parsable: the server leaves the text as it is
        return ParsedReply(content=text, reasoning_content=reasoning)
    tool_calls = [{"id": f"{call_id}_{n}", "type": "function",
                   "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                  for n, (name, arguments) in enumerate(calls)]
    return ParsedReply(content=before or None, reasoning_content=reasoning, tool_calls=tool_calls)


def _json_call(block: str, tools: list[dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    try:
        call = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return call["name"], arguments if isinstance(arguments, dict) else {"value": arguments}


def _xml_call(block: str, tools: list[dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    found = XML_FUNCTION.search(block)
    if found is None:
        return None
    name, body = found.group(1), found.group(2)
    types = _parameter_types(name, tools)
    arguments = {key: _typed(_trim_newlines(value), types.get(key)) for key, value in XML_PARAMETER.findall(body)}
    return name, arguments


def _trim_newlines(value: str) -> str:
    # the format puts each value on lines of its own: one newline after the tag and one before the closing tag
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _parameter_types(name: str, tools: list[dict[str, Any]]) -> dict[str, str]:
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {key: str(spec.get("type", "string")) for key, spec in properties.items() if isinstance(spec, dict)}
    return {}


def _typed(value: str, schema_type: str | None) -> Any:
    """An XML parameter's text as its schema type says (strings stay text; an unknown type is JSON if it parses)."""
    if schema_type == "string":
        return value
    if schema_type == "integer":
        try:
            return int(value.strip())
        except ValueError:
            return value
    if schema_type == "number":
        try:
            number = float(value.strip())
        except ValueError:
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    if schema_type == "boolean":
        lowered = value.strip().lower()
        return lowered == "true" if lowered in ("true", "false") else value
    try:
        return json.loads(value)
    except ValueError:
        return value
