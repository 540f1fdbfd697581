"""Prompts as token ids, and an episode's history kept as the exact tokens the model produced.

The chat template renders the messages a turn shows; the first turn of a sequence is that render
tokenised. A later turn *continues* the sequence: the previous prompt ids + the sampled reply ids
+ the template's glue and the new messages, tokenised on their own. So the model is conditioned on
the tokens it generated (re-tokenising "B" "B" can give one token "BB"), and one sequence holds
every turn, to be scored and trained in one pass.

A continuation is only valid while the template renders the conversation append-only. Every turn
checks that on the text: the new render must start with the previous render + the reply text (+
the EOS text when the reply ended with EOS). Templates that re-render history (Qwen3 drops earlier
thinking, the `truncated` strategy, budget trimming, the `last` strategy) and a reply the `full`
conversation shows stripped (reasoning, surrounding whitespace: what the validators' client stores)
fail the check, and that turn starts a new sequence from a fresh render.
"""
from __future__ import annotations

from typing import Any


class PromptBuilder:
    """Chat messages -> prompt token ids with the model's chat template, within a token budget."""

    def __init__(self, tokenizer, max_prompt_tokens: int, chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.chat_template_kwargs = chat_template_kwargs or {}

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of template text; special tokens written in it (e.g. <|im_start|>) become their ids."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenize(self.render(messages))

    def fit(self, messages: list[dict[str, str]], keep_from: int) -> tuple[list[int], str] | None:
        """(ids, rendered text), dropping the oldest turns (never the system message or the pending
        decision) until it fits the budget; None when even that is too long."""
        text = self.render(messages)
        ids = self.tokenize(text)
        first = 1 if messages and messages[0]["role"] == "system" else 0
        while len(ids) > self.max_prompt_tokens and keep_from > first:
            drop = 2 if keep_from - first >= 2 else 1
            messages = messages[:first] + messages[first + drop :]
            keep_from -= drop
            text = self.render(messages)
            ids = self.tokenize(text)
        return (ids, text) if len(ids) <= self.max_prompt_tokens else None


class TokenHistory:
    """One episode's token sequences: each turn's prompt continues the current sequence when the
    template allows it, else starts a new one. `sequences[i]` ends with the last reply added to it.

    `continue_sequences=False` renders every prompt afresh from the messages, the way an OpenAI chat
    server does (evaluation plays the validators' conversation; training keeps the sampled ids)."""

    def __init__(self, builder: PromptBuilder, eos_ids: set[int], continue_sequences: bool = True):
        self.builder = builder
        self.eos_ids = eos_ids
        self.continue_sequences = continue_sequences
        self.sequences: list[list[int]] = []
        self._rendered = ""  # the text the current sequence stands for (prompt render + reply text)
        self._eos_text = ""  # the reply's final EOS as text, which the template writes after the reply

    def prompt(self, messages: list[dict[str, str]], keep_from: int) -> tuple[list[int], int, int] | None:
        """(prompt ids, sequence index, position of the reply's first token) for the pending turn;
        None when the prompt cannot fit `max_prompt_tokens`."""
        if self.sequences and self.continue_sequences:
            continued = self._continue(messages)
            if continued is not None:
                return continued
        fitted = self.builder.fit(messages, keep_from)
        if fitted is None:
            return None
        ids, self._rendered = fitted
        self.sequences.append(list(ids))
        return ids, len(self.sequences) - 1, len(ids)

    def _continue(self, messages: list[dict[str, str]]) -> tuple[list[int], int, int] | None:
        text = self.builder.render(messages)
        if not text.startswith(self._rendered + self._eos_text):
            return None  # the template re-rendered the history: this turn starts a new sequence
        glue = self.builder.tokenize(text[len(self._rendered) + len(self._eos_text):])
        sequence = self.sequences[-1]
        if not glue or len(sequence) + len(glue) > self.builder.max_prompt_tokens:
            return None
        sequence.extend(glue)
        self._rendered = text
        return list(sequence), len(self.sequences) - 1, len(sequence)

    def add_reply(self, reply_ids: list[int], reply_text: str) -> None:
        """Append the sampled ids to the current sequence; `reply_text` is what the env and messages got."""
        self.sequences[-1].extend(reply_ids)
        self._rendered += reply_text
        ends_with_eos = bool(reply_ids) and reply_ids[-1] in self.eos_ids
        self._eos_text = self.builder.tokenizer.decode(reply_ids[-1:]) if ends_with_eos else ""
