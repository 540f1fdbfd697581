"""Whether a harness run is scored, as SWE-INFINITE decides it (affinetes environments/SWE-INFINITE/agents/
outcome.py and affent_protocol.py, read for facts): a run that ended on its own is scored; one the model ended (a
context overflow, a format error) is a model failure, scored 0; anything else is an infrastructure failure, not
scored (our env returns it as an `error`, and the trainer drops the episode).

A context overflow is: mini-swe-agent's litellm raising ContextWindowExceededError (litellm's reading of the
server's 400 message); codex reporting `contextWindowExceeded` (its reading of `finish_reason: "length"`), or
reporting `other` / `badRequest` with the server's JSON error body whose `code` is `context_length_exceeded` /
`context_window_exceeded`, or which is SGLang's 400 for an input over its limit.
"""
from __future__ import annotations

import json
import re

COMPLETED, MODEL_FAILURE, INFRA_FAILURE = "completed", "model_failure", "infra_failure"
MINISWE_MODEL_FAILURES = ("ContextWindowExceededError", "FormatError")
CODEX_OVERFLOW_KINDS = {"contextWindowExceeded", "context_window_exceeded"}
CONTEXT_ERROR_CODES = {"context_length_exceeded", "context_window_exceeded"}
SGLANG_OVERFLOW = re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)\. "
                             r"Use a shorter input or enable --allow-auto-truncate\.")


def miniswe_outcome(harness_error: str | None) -> str:
    if harness_error is None:
        return COMPLETED
    return MODEL_FAILURE if harness_error.startswith(MINISWE_MODEL_FAILURES) else INFRA_FAILURE


def codex_outcome(status: str | None, errors: list[dict]) -> str:
    """`errors`: the `error` objects codex reported (message, codexErrorInfo)."""
    if status == "completed":
        return COMPLETED
    return MODEL_FAILURE if any(_is_context_overflow(error) for error in errors) else INFRA_FAILURE


def _is_context_overflow(error: dict) -> bool:
    kind = error.get("codexErrorInfo")
    if isinstance(kind, dict):  # some kinds carry details: {"kind": {...}}
        kind = next(iter(kind), None)
    if kind in CODEX_OVERFLOW_KINDS:
        return True
    return kind in (None, "other", "badRequest") and provider_context_overflow(error.get("message"))


def provider_context_overflow(message) -> bool:
    """The server's error body (as codex passes it on) says the input was over the model's context."""
    try:
        body = json.loads(message)
    except (TypeError, ValueError):
        return False
    error = body.get("error", body) if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return False
    if error.get("code") in CONTEXT_ERROR_CODES:
        return True
    match = SGLANG_OVERFLOW.fullmatch(str(error.get("message", "")))
    return (error.get("code") in (400, "400") and error.get("type") == "BadRequestError" and match is not None
            and int(match.group(1)) > int(match.group(2)))
