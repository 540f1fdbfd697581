"""A request's `stop` strings applied as SGLang v0.5.14 applies them to a reply it generates.

Generation ends at the first token after which the decoded reply holds one of the stop strings; the reply sent is
the text before that string's first occurrence (the string itself is trimmed) with `finish_reason` "stop". The
endpoint's generator samples whole replies, so the reply is cut afterwards: the tokens kept are those up to that
token (what the server would have sampled), the text is cut before the stop string.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def stop_strings_of(body: dict[str, Any]) -> list[str]:
    """The request's `stop`: one string or a list of them; empty strings never match."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return [s for s in stops if isinstance(s, str) and s]


def matched_stop(text: str, stops: list[str]) -> str | None:
    """The stop string a reply decoded so far has reached (the first in the request's order), or None."""
    return next((stop for stop in stops if stop in text), None)


def trim_at_stop(text: str, stop: str) -> str:
    return text[:text.find(stop)]


def tokens_until_stop(ids: list[int], decode: Callable[[list[int]], str], stops: list[str]) -> tuple[int, str] | None:
    """(how many of `ids` the server would have sampled, the stop string matched), or None when no stop string is
    reached. Whether the decoded prefix holds a stop string only grows with the prefix, so a bisection finds the
    first token that completes one with a few decodes."""
    if not stops or matched_stop(decode(ids), stops) is None:
        return None
    low, high = 1, len(ids)  # the answer lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        if matched_stop(decode(ids[:middle]), stops) is None:
            low = middle + 1
        else:
            high = middle
    return low, matched_stop(decode(ids[:low]), stops)
