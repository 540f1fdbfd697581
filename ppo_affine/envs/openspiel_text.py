"""What the model reads and writes in the Affine game env: prompts, observation texts and action parsing.

Two formats (docs/protocols.md): `evaluate`, the validators' conversation
('The evaluate() conversation'), and `openenv`, the reset/step texts ('The reset/step protocol').
Layouts follow the real env's; the sentences are our own. Pure functions on strings and ints, no pyspiel.
"""
from __future__ import annotations

import re

FORMATS = ("evaluate", "openenv")

# Longest digit string that can still name an action; longer runs would also trip Python's
# int() limit on 4300-digit strings.
_MAX_ACTION_DIGITS = 18

_THINK_BLOCK = re.compile(r"<(think|thinking)>.*?</\1>", re.IGNORECASE | re.DOTALL)
_THINK_CLOSE = re.compile(r"</(?:think|thinking)>", re.IGNORECASE)
_THINK_OPEN = re.compile(r"<(?:think|thinking)>", re.IGNORECASE)


def strip_think(text: str) -> str:
    """Remove reasoning the way the Affine LLM client does; "" when nothing is left."""
    text = _THINK_BLOCK.sub("", text)
    closings = list(_THINK_CLOSE.finditer(text))
    if closings:
        text = text[closings[-1].end():]
    opening = _THINK_OPEN.search(text)
    if opening:
        text = text[:opening.start()]
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _as_action(digits: str, legal: list[int]) -> int | None:
    digits = digits.lstrip("0") or "0"
    if len(digits) > _MAX_ACTION_DIGITS:
        return None
    value = int(digits)
    return value if value in legal else None


def _alphanumeric(text: str) -> str:
    return "".join(ch for ch in text if ch.isalnum())


def parse_evaluate_action(reply: str, legal: list[int], labels: list[str]) -> int | None:
    """The evaluate() parser on an already think-stripped reply: a bare number, else a legal id as a
    whole word (ascending ids), else a label contained in the reply; None when nothing matches."""
    reply = reply.strip()
    if re.fullmatch(r"\d+", reply):
        # A bare number is final: an illegal one fails without trying the other rules.
        return _as_action(reply, legal)
    # `\b{id}\b` matches exactly when some maximal run of word characters equals the id.
    words = set(re.findall(r"\w+", reply))
    for action in legal:
        if str(action) in words:
            return action
    lowered = reply.lower()
    lowered_alnum = _alphanumeric(lowered)
    # Later duplicates overwrite the id but keep the key's first position, like a Python dict does.
    keys: dict[str, int] = {}
    for action, label in zip(legal, labels):
        keys[label.lower()] = action
        keys[_alphanumeric(label.lower())] = action
    for key, action in keys.items():
        # An empty key (a label of symbols only) would match every reply.
        if key and (key in lowered or key in lowered_alnum):
            return action
    return None


def parse_openenv_action(text: str, legal: list[int]) -> int | None:
    """The reset/step parser: the first run of digits anywhere, which must be a legal id."""
    found = re.search(r"\d+", text)
    return _as_action(found.group(), legal) if found else None


def system_prompt(game_name: str, rules: str) -> str:
    return "\n".join([
        f"You are playing {game_name}.",
        f"\n# Game Rules\n{rules}\n",
        "\n# Output Format",
        "Answer with the numeric ID of the action you choose and nothing else. "
        "Leave out descriptions, reasoning and explanations.",
        "",
        "Examples:",
        '- for the legal action line "0 -> roll", reply "0"',
        '- for the legal action line "89 -> a3", reply "89"',
    ])


def _action_lines(legal: list[int], labels: list[str], indent: str) -> list[str]:
    return [f"{indent}{action} -> {label}" for action, label in zip(legal, labels)]


def evaluate_turn_prompt(description: str, player: int, legal: list[int], labels: list[str]) -> str:
    return "\n".join([
        "Current State:", description, "", f"You are Player {player}.", "Legal Actions:",
        *_action_lines(legal, labels, ""), "", "Your choice (ID only):",
    ])


def evaluate_feedback(attempt: int, max_attempts: int) -> str:
    return (
        "Your reply did not contain a valid action. Answer with only the action ID number, "
        f"for example '5'. This is attempt {attempt} of {max_attempts}."
    )


def result_word(score: float) -> str:
    return "WIN" if score > 0.5 else "LOSS" if score < 0.5 else "DRAW"


def evaluate_summary(game_name: str, player: int, returns: list[float] | None, score: float,
                     max_attempts: int) -> str:
    """The closing message of an evaluate-format episode (the real conversation simply stops)."""
    if returns is None:
        return (f"Game over: {game_name}. No valid action after {max_attempts} attempts, so the game is lost. "
                f"Score: {score:.3f} (LOSS).")
    return (f"Game over: {game_name}. You were Player {player}; final returns {returns}. "
            f"Score: {score:.3f} ({result_word(score)}).")


def openenv_state_block(game_name: str, player: int, description: str, legal: list[int],
                        labels: list[str]) -> str:
    return "\n".join([
        f"Game: {game_name}", f"You are Player {player}.", "", "Current State:", description, "",
        "Legal Actions:", *_action_lines(legal, labels, "  "), "", "Your choice (action ID only):",
    ])


def openenv_reset_text(rules: str, state_block: str) -> str:
    return f"# Game Rules\n{rules}\n\n# Current Game State\n{state_block}"


def openenv_terminal_text(game_name: str, player: int, returns: list[float], score: float) -> str:
    return "\n".join([
        f"Game Over: {game_name}", f"You were Player {player}.", "",
        f"Final Returns: {returns!r}", f"Your Return: {returns[player]!r}",
        f"Normalized Score: {score:.3f}", f"Result: {result_word(score)}",
    ])


def openenv_invalid_text(raw_action: str, legal: list[int], labels: list[str]) -> str:
    lines = [
        f'Invalid action: "{raw_action}"', "",
        "Your response could not be read as a legal action ID. Reply with the number only.", "",
        "Legal Actions:", *_action_lines(legal[:10], labels[:10], "  "),
    ]
    if len(legal) > 10:
        lines.append(f"  ... and {len(legal) - 10} more")
    return "\n".join([*lines, "", "Your choice (action ID only):"])
