"""A DISTILL-V2 rollout as the env renders it for a Qwen-family model: token ids and the loss mask.

The env does not use the model's chat template: it writes ChatML by hand, message by message, and tokenises each
piece on its own (`encode(text, add_special_tokens=False)`) with the model's tokenizer, so the ids are the
concatenation of the pieces' ids, not the ids of the joined text. Loss tokens are the assistant's commitments,
its text and its tool calls; everything else (system, user, tool results, the assistant's ChatML frame and, by
default, its reasoning) is context. A rendering longer than `max_seq_len` keeps its first quarter and its last
three quarters (the env's `keep_head_tail`), masks cut where they fall.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from ppo_affine.distill.cells import Message, ToolCall

MAX_SEQ_LEN = 32_768  # the env's default; validators pass no other


@dataclass(frozen=True)
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens whose NLL the score sums


def tool_call_text(call: ToolCall) -> str:
    # Hermes style, compact JSON, non-ASCII kept as is; the arguments keep the order they were stored in
    body = json.dumps({"name": call.name, "arguments": call.arguments}, separators=(",", ":"), ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>\n"


def message_pieces(message: Message, mask_reasoning: bool = True) -> list[tuple[bool, str]]:
    """(carries loss, text) pieces of one message, in order. Empty text, reasoning and tool-call lists add none."""
    if message.role in ("system", "user"):
        return [(False, f"<|im_start|>{message.role}\n{message.content or ''}<|im_end|>\n")]
    if message.role == "tool":
        return [(False, f"<|im_start|>tool\n<tool_response>\n{message.content or ''}\n</tool_response><|im_end|>\n")]
    pieces = [(False, "<|im_start|>assistant\n")]
    if message.reasoning:
        pieces.append((not mask_reasoning, f"<think>\n{message.reasoning}\n</think>\n"))
    if message.content:
        pieces.append((True, message.content))
    pieces += [(True, tool_call_text(call)) for call in message.tool_calls]
    pieces.append((False, "<|im_end|>\n"))
    return pieces


def keep_head_tail(ids: list[int], mask: list[int], max_seq_len: int) -> tuple[list[int], list[int]]:
    """At most `max_seq_len` tokens: the first max_seq_len // 4 and the rest from the end."""
    if len(ids) <= max_seq_len:
        return ids, mask
    head = max_seq_len // 4
    tail = max_seq_len - head
    return ids[:head] + ids[-tail:], mask[:head] + mask[-tail:]


def render_rollout(messages: Sequence[Message], tokenizer, mask_reasoning: bool = True,
                   max_seq_len: int = MAX_SEQ_LEN) -> Rendered:
    ids: list[int] = []
    mask: list[int] = []
    for message in messages:
        for loss, text in message_pieces(message, mask_reasoning):
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [int(loss)] * len(piece)
    ids, mask = keep_head_tail(ids, mask, max_seq_len)
    return Rendered(input_ids=ids, loss_mask=mask)
