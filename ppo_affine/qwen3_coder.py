"""Tool calls in the qwen3_coder XML form, read as SGLang v0.5.14's `qwen3_coder` tool-call parser reads them.

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

What the validators' server does, rule by rule (tests/test_reply_parsers.py checks each against replies SGLang's own
code returned, tests/fixtures/sglang_0_5_14/replies.json):
- A whole reply (`one_shot`): the calls are the `<function=...>` blocks inside complete `<tool_call>...</tool_call>`
  blocks, several per block allowed; only when there is no complete block is the whole text read, so a call cut off
  at the end of the reply is returned only when it is the reply's only call. A parameter ends at `</parameter>`, at
  the next `<parameter=`, at `</function>` or at the end of the text; one newline is dropped on each side of its value.
  The content is the text before the first `<tool_call>`, the rest is dropped; no call parsed leaves the text whole.
- A streamed reply (`streamed`): tags are read in order; text outside the `<tool_call>` blocks (before, between, after)
  is content, text inside them is dropped; a call's name is sent when its `<function=NAME>` tag is complete and each
  parameter when it has ended, so a call cut off at the end arrives with its name and its whole parameters only
  (arguments `""`, or a JSON object without its closing brace).
- Values: "null" (any case) is None whatever the type; a parameter the tool's schema does not list keeps its text;
  the schema's `type` picks the conversion (string kinds: the text; int kinds: int() or the text; number/float kinds:
  float(), an int when written without a dot or exponent and whole; boolean kinds: true only for "true", any case;
  object/array kinds: JSON, then a Python literal; any other type: a Python literal, else the text).
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
TAGS = (CALL_START, CALL_END, FUNCTION_START, FUNCTION_END, PARAMETER_START, PARAMETER_END)

WHOLE_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)

STRING_KINDS = ("string", "str", "text", "varchar", "char", "enum")
INT_KINDS = ("int", "uint", "long", "short", "unsigned")
BOOLEAN_KINDS = ("boolean", "bool", "binary")


@dataclass
class ToolCalls:
    """What the parser made of a reply's text: content, and each call's name and arguments as JSON text."""
    content: str
    calls: list[tuple[str, str]] = field(default_factory=list)


def one_shot(text: str, tools: list[dict[str, Any]]) -> ToolCalls:
    """A whole reply's calls (see the module's rules); no call parsed: the text is all content."""
    if CALL_START not in text:
        return ToolCalls(text)
    blocks = WHOLE_BLOCK.findall(text) or ([text] if FUNCTION_START in text else [])
    calls = []
    for block in blocks:
        for whole, cut_off in FUNCTION.findall(block):
            body = whole or cut_off
            if ">" not in body:
                continue
            name, parameters = body.split(">", 1)
            arguments = {}
            for found in PARAMETER.findall(parameters):
                if ">" in found:
                    key, value = found.split(">", 1)
                    arguments[key] = convert(_drop_edge_newlines(value), key, _properties(name, tools))
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return ToolCalls(text)
    return ToolCalls(text[:text.find(CALL_START)], calls)


def streamed(text: str, tools: list[dict[str, Any]]) -> ToolCalls:
    """A reply's calls as a streaming client assembles them (see the module's rules)."""
    content, calls = [], []
    inside, position = False, 0
    while position < len(text):
        rest = text[position:]
        if rest.startswith(CALL_START) or rest.startswith(CALL_END):
            inside = rest.startswith(CALL_START)
            position += len(CALL_START if inside else CALL_END)
        elif rest.startswith(FUNCTION_START):
            if ">" not in rest:
                break  # the name is not complete: never sent
            name = rest[len(FUNCTION_START):rest.index(">")]
            calls.append([name, ""])
            position += rest.index(">") + 1
        elif rest.startswith(PARAMETER_START):
            step = _streamed_parameter(rest, calls, tools)
            if step is None:
                break  # the value has not ended: never sent
            position += step
        elif rest.startswith(FUNCTION_END):
            if calls:
                calls[-1][1] = (calls[-1][1] or "{") + "}"
            position += len(FUNCTION_END)
        else:
            step = _streamed_text(rest)
            if step is None:
                break  # a tag's beginning at the very end: held back
            if not inside:
                content.append(rest[:step])
            position += step
    return ToolCalls("".join(content), [(name, arguments) for name, arguments in calls])


def _streamed_parameter(rest: str, calls: list[list[str]], tools: list[dict[str, Any]]) -> int | None:
    """Adds `"key": value` to the current call's arguments; the characters read, or None while the value is open."""
    if ">" not in rest:
        return None
    name_end = rest.index(">")
    value = rest[name_end + 1:]
    ends = [(value.find(tag), len(tag) if tag == PARAMETER_END else 0)
            for tag in (PARAMETER_END, PARAMETER_START, FUNCTION_END) if tag in value]
    if not ends:
        return None
    end, tag_length = min(ends)
    key = rest[len(PARAMETER_START):name_end]
    if calls:
        name, arguments = calls[-1]
        converted = convert(_drop_edge_newlines(value[:end]), key, _properties(name, tools))
        pair = f"{json.dumps(key)}: {json.dumps(converted, ensure_ascii=False)}"
        calls[-1][1] = f"{arguments}, {pair}" if arguments else "{" + pair
    return name_end + 1 + end + tag_length


def _streamed_text(rest: str) -> int | None:
    """How many characters of plain text start `rest` (a lone "<" counts), or None for a tag cut off at the end."""
    angle = rest.find("<")
    if angle == -1:
        return len(rest)
    if angle > 0:
        return angle
    return None if any(tag.startswith(rest) for tag in TAGS) else 1


def _drop_edge_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _properties(name: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The named tool's parameter schemas (its `parameters` itself when that has no `properties`); {} if unknown."""
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") == "function" and isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            if isinstance(parameters, dict):
                return parameters["properties"] if "properties" in parameters else parameters
            return {}
    return {}


def convert(value: str, key: str, properties: dict[str, Any]) -> Any:
    """One parameter's text as the validators' server converts it (the module's rules)."""
    if value.lower() == "null":
        return None
    if key not in properties:
        return value
    spec = properties[key]
    kind = str(spec["type"]).strip().lower() if isinstance(spec, dict) and "type" in spec else "string"
    if kind in STRING_KINDS:
        return value
    if kind.startswith(INT_KINDS):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        whole_as_written = "." not in value and "e" not in value.lower()
        return int(number) if whole_as_written and number.is_integer() else number
    if kind in BOOLEAN_KINDS:
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except Exception:  # literal_eval raises several kinds on text that is no literal
        return value
