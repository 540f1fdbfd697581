"""Replies that cost no model: a legal action id read off the prompt, for stand-ins that time everything but the
model (bench/host_speed.py's model, the fake vLLM server's `--scripted` mode)."""
from __future__ import annotations

import re

LEGAL_LINE = re.compile(r"^(\d+) -> ", re.MULTILINE)


def scripted_reply(tokenizer, prompt_ids: list[int], seed: int, eos_id: int) -> list[int]:
    """A legal action id from the prompt's last 'Legal Actions:' block (chosen by `seed`), then EOS."""
    tail = tokenizer.decode(prompt_ids[-200:], skip_special_tokens=True)
    block = tail.rsplit("Legal Actions:", 1)[-1]
    legal = LEGAL_LINE.findall(block) or ["0"]
    return tokenizer.encode(legal[seed % len(legal)], add_special_tokens=False) + [eos_id]
