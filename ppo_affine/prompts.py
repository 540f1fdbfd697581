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

What a turn costs the host does not grow with the conversation where the template and tokenizer allow:
the check and the glue come from a window of a few messages (PromptBuilder.glue) and the text is
tokenised line by line from a memo (LINE_CUTS), each checked against the whole way on the first
turns and now and then after.
"""
from __future__ import annotations

import bisect
import logging
import re
from typing import Any

log = logging.getLogger(__name__)

# A prompt's text is mostly lines the tokenizer has already seen: the rules, the legal-action lines, the template's
# glue. Cut where the tokenizer's pre-tokenizer always cuts, the text tokenises piece by piece into the same ids, and
# a seen piece is a lookup instead of ~1 µs per character. Where that is depends on the pre-tokenizer's pattern:
# GPT-2's (SmolLM2) gives the last space before a word its own piece, so it cuts before a newline that a non-space
# follows; Qwen's and Llama 3's keep spaces with the newlines after them, so they cut after it. Both rules are checked
# against the tokenizer's own ids on the first VERIFY_FIRST texts, the one that always agreed is kept and checked
# again on one text in VERIFY_EVERY; when none agrees, prompts are tokenised whole.
LINE_CUTS = {"before newline": re.compile(r"(?=\n\S)"), "after newline": re.compile(r"(?<=\n)(?=\S)")}
MEMO_PIECES = 1 << 16  # pieces kept per rule; a memo starts over when full
MEMO_SYSTEM_RENDERS = 256  # system messages whose render alone is kept (one per game and prompt variant)
VERIFY_FIRST, VERIFY_EVERY = 16, 64


class PromptBuilder:
    """Chat messages -> prompt token ids with the model's chat template, within a token budget."""

    def __init__(self, tokenizer, max_prompt_tokens: int, chat_template_kwargs: dict[str, Any] | None = None,
                 incremental: bool = True):
        """`incremental=False`: every turn renders and tokenises its whole conversation (the memo and the windows
        off), for comparison."""
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._template = None  # the compiled chat template once it rendered as apply_chat_template does; False: not
        self._memos = {rule: {} for rule in LINE_CUTS}  # per cutting rule still agreeing: piece -> ids
        self._tokenized = 0
        self._windows: bool | None = None  # whether a turn's glue comes from its window render (None: checking)
        self._window_checks = 0
        self._system_renders: dict[str, str] = {}  # a system message's content -> its render alone (see glue)
        self._token_texts: dict[int, str] = {}  # token id -> its text (see token_text)
        self._system_head = True  # whether a window's head is the system message alone (see glue)
        if not incremental:
            self._memos, self._windows = {}, False

    def render(self, messages: list[dict[str, str]]) -> str:
        # A prompt renders many messages: apply_chat_template spends two thirds of that converting the
        # messages, which are plain dicts here, so the compiled template renders them directly once the first
        # render showed both ways agree.
        if self._template:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._template_variables)
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )
        if self._template is None:
            self._template = self._compiled_template_rendering(messages, text) or False
        return text

    def _compiled_template_rendering(self, messages: list[dict[str, str]], text: str):
        """The tokenizer's chat template compiled (transformers' own compiler), if it renders `messages` as `text`."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            template = _compile_jinja_template(self.tokenizer.chat_template)
            self._template_variables = {**self.tokenizer.special_tokens_map, **self.chat_template_kwargs}
            same = template.render(messages=messages, add_generation_prompt=True, **self._template_variables) == text
        except Exception:  # another transformers version, a template given another way: keep the public path
            return None
        return template if same else None

    def glue(self, messages: list[dict[str, str]], shown: list[dict[str, str]], before: str, reply: str) -> str | None:
        """The text the render of `messages` adds after `before`, the last prompt's render + `reply` (the reply
        and EOS text since); None when the render does not start with `before` (the template re-rendered the
        history, or shows the reply otherwise).

        Rendering the whole conversation every turn costs more each turn. When `messages` extends `shown` (the
        last prompt's messages), a template that renders each message on its own gives the same text from a few
        messages (the window: the head, then the new ones): its render after the head's render + `reply`. The head is
        the system message, whose render is kept from turn to turn; without one, or where the template refuses a
        conversation that a system message alone starts or renders it otherwise (one that needs a user message or
        strict alternation), the system message and the last prompt's last message (a template may add a default
        system message to any conversation but an empty one). Whether this template renders messages on their own
        is checked as the tokenizer's memo is (VERIFY_FIRST, VERIFY_EVERY)."""
        window = None  # the window's answer, where it has one
        extends = self._windows is not False and len(messages) > len(shown) and messages[:len(shown)] == shown
        system_head = self._system_head and bool(messages) and messages[0]["role"] == "system"
        if extends:
            first = 1 if messages[0]["role"] == "system" else 0
            head = messages[:1] if system_head else messages[:first] + shown[first:][-1:]
            try:
                start = self._head_render(head) + reply
                text = self.render(head + messages[len(shown):])
            except Exception as exc:  # e.g. a template that needs a user message
                if system_head:
                    self._head_failed(f"refused the system message alone ({exc})")
                    return self.glue(messages, shown, before, reply)
                log.info("this chat template refuses a window of messages (%s): every turn renders them all", exc)
                self._windows, extends = False, False
            else:
                window = (text[len(start):],) if text.startswith(start) else (None,)
        if extends:
            self._window_checks += 1
            if self._windows and self._window_checks % VERIFY_EVERY:
                return window[0]
        text = self.render(messages)
        whole = text[len(before):] if text.startswith(before) else None
        if extends:
            if window[0] != whole and system_head:
                self._head_failed("renders a window headed by the system message alone otherwise")
            elif window[0] != whole:
                log.info("this chat template renders messages in view of others: every turn renders them all")
                self._windows = False
            elif self._window_checks >= VERIFY_FIRST:
                self._windows = True
        return whole

    def _head_failed(self, why: str) -> None:
        """Windows go on headed by the system message and the last prompt's message, checked afresh."""
        log.info("this chat template %s: windows keep the last prompt's message", why)
        self._system_head, self._windows, self._window_checks = False, None, 0

    def _head_render(self, head: list[dict[str, str]]) -> str:
        """render(head), kept for a system message alone (every turn of every episode with it renders it)."""
        if len(head) != 1 or head[0]["role"] != "system":
            return self.render(head)
        key = head[0]["content"]
        if key not in self._system_renders:
            if len(self._system_renders) >= MEMO_SYSTEM_RENDERS:
                self._system_renders.clear()
            self._system_renders[key] = self.render(head)
        return self._system_renders[key]

    def token_text(self, token_id: int) -> str:
        """One token's text (e.g. the EOS the template writes after a reply), decoded once per id."""
        if token_id not in self._token_texts:
            self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return self._token_texts[token_id]

    def tokenize(self, text: str) -> list[int]:
        """Token ids of template text; special tokens written in it (e.g. <|im_start|>) become their ids.
        Piece by piece from a memo where that gives the tokenizer's own ids (see LINE_CUTS)."""
        if not self._memos:
            return self._plain_ids(text)
        self._tokenized += 1
        verifying = self._tokenized <= VERIFY_FIRST
        if not verifying and self._tokenized % VERIFY_EVERY:
            rule, memo = next(iter(self._memos.items()))
            return self._memo_ids(LINE_CUTS[rule].split(text), memo)
        plain = self._plain_ids(text)
        for rule, memo in list(self._memos.items()):
            if self._memo_ids(LINE_CUTS[rule].split(text), memo) != plain:
                del self._memos[rule]
                if not self._memos:
                    log.info("no line cut keeps this tokenizer's ids: prompts are tokenised whole")
            if not verifying:
                break  # past the first texts only the rule in use is checked
        return plain

    def _plain_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _memo_ids(self, pieces: list[str], memo: dict[str, list[int]]) -> list[int]:
        new = list(dict.fromkeys(piece for piece in pieces if piece not in memo))
        if new:
            if len(memo) + len(new) > MEMO_PIECES:
                memo.clear()
                new = list(dict.fromkeys(pieces))
            memo.update(zip(new, self._encode_each(new)))
        return [token for piece in pieces for token in memo[piece]]

    def _encode_each(self, texts: list[str]) -> list[list[int]]:
        # one call for the lot: the library's own tokenizer when the wrapper exposes it (transformers' wrapper
        # costs more per call than a short line takes to tokenise), else the wrapper
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch"):
            return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenize(self.render(messages))

    def fit(self, messages: list[dict[str, str]], keep_from: int, room: int = 0,
            dropped: int = 0) -> tuple[list[int], str, int] | None:
        """(ids, rendered text, messages dropped): the oldest turns after the system message dropped, never the
        pending decision (`messages[keep_from:]`), until the prompt fits the budget, and then until it also leaves
        `room` tokens free (so that later turns can extend it); None when even the shortest is too long.
        `dropped` turns (after the system message) go from the start: an episode's earlier prompt dropped them, so
        its longer history cannot keep them, and a fit then costs what the kept turns cost, not the whole history."""
        first = 1 if messages and messages[0]["role"] == "system" else 0
        dropped = min(dropped, max(0, keep_from - first))
        if dropped:
            fitted = self._fit(messages[:first] + messages[first + dropped:], keep_from - dropped, room)
            return None if fitted is None else (fitted[0], fitted[1], fitted[2] + dropped)
        return self._fit(messages, keep_from, room)

    def _fit(self, messages: list[dict[str, str]], keep_from: int, room: int) -> tuple[list[int], str, int] | None:
        """fit, with no turns dropped beforehand.

        One render and tokenisation (with offsets) say how many turns must go: each token's place in the text tells which
        message it belongs to. The shortened prompt is rendered and tokenised once to check (a turn more goes
        in the rare case that the tokens at a cut differ from the estimate). With the memo (LINE_CUTS) the count
        comes from its pieces, each a whole line's tokens where it overlaps a cut: never fewer than the cut's own,
        so the estimate never drops a turn too many, and the check adds any turn it left."""
        text = self.render(messages)
        ids = self.tokenize(text)
        if len(ids) <= self.max_prompt_tokens:
            return ids, text, 0
        # over the budget: where each token starts in the text tells which message it belongs to
        first = 1 if messages and messages[0]["role"] == "system" else 0
        droppable = max(0, keep_from - first)
        target = max(1, self.max_prompt_tokens - room)
        drop = self._turns_to_drop(text, messages, first, droppable, self._token_counter(text), len(ids) - target)
        while True:
            if drop:
                text = self.render(messages[:first] + messages[first + drop:])
                ids = self.tokenize(text)
            if len(ids) <= target or drop >= droppable:
                break
            drop = self._next_drop(drop, droppable)
        return (ids, text, drop) if len(ids) <= self.max_prompt_tokens else None

    @staticmethod
    def _next_drop(drop: int, droppable: int) -> int:
        """Turns go a user/assistant pair at a time, the last one alone when one is left."""
        return drop + (2 if droppable - drop >= 2 else 1)

    def _token_counter(self, text: str):
        """tokens_between(lo, hi): how many of `text`'s tokens start in (lo, hi], or more (see fit)."""
        memo = next(iter(self._memos.values()), None) if self._memos else None
        if memo is not None:
            rule = next(iter(self._memos))
            pieces = LINE_CUTS[rule].split(text)
            if all(piece in memo for piece in pieces):
                starts, ends, counts = [], [], [0]
                for piece in pieces:
                    starts.append(ends[-1] if ends else 0)
                    ends.append(starts[-1] + len(piece))
                    counts.append(counts[-1] + len(memo[piece]))

                def overlapping(lo: int, hi: int) -> int:  # the pieces that end after lo and start by hi
                    return counts[bisect.bisect_right(starts, hi)] - counts[bisect.bisect_right(ends, lo)]
                return overlapping
        token_starts = [start for start, _ in
                        self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
        return lambda lo, hi: bisect.bisect_right(token_starts, hi) - bisect.bisect_right(token_starts, lo)

    def _turns_to_drop(self, text: str, messages: list[dict[str, str]], first: int, droppable: int,
                       tokens_between, excess: int) -> int:
        """The fewest turns (in pairs) whose tokens add up to `excess`, estimated from where each message's
        content ends in `text`; 0 when the contents cannot be found there (the template rewrites them)."""
        ends, position = [], 0
        for message in messages[: first + droppable]:
            found = text.find(message["content"], position)
            if found < 0:
                return 0
            position = found + len(message["content"])
            ends.append(position)
        cut_from = ends[first - 1] if first else 0
        drop = 0
        while drop < droppable:
            drop = self._next_drop(drop, droppable)
            cut_to = ends[first + drop - 1]
            removed = tokens_between(cut_from, cut_to)
            if removed >= excess:
                break
        return drop


class TokenHistory:
    """One episode's token sequences: each turn's prompt continues the current sequence when the
    template allows it, else starts a new one. `sequences[i]` ends with the last reply added to it.

    A new sequence keeps the sampled ids of the history it still shows unchanged: where the render starts with
    the text up to an earlier reply (latest first; e.g. the client stored the last reply whitespace-stripped, but
    the replies before it as sampled), it is that sequence's ids up to that reply + the rest tokenised, as the
    endpoint for evaluate() envs splices a call onto an earlier one (endpoint.py), so both give the same ids.

    `continue_sequences=False` renders every prompt afresh from the messages, the way an OpenAI chat
    server does (evaluation plays the validators' conversation; training keeps the sampled ids)."""

    def __init__(self, builder: PromptBuilder, eos_ids: set[int], continue_sequences: bool = True):
        self.builder = builder
        self.eos_ids = eos_ids
        self.continue_sequences = continue_sequences
        self.sequences: list[list[int]] = []
        self._dropped = 0  # turns the current sequence leaves out after the system message (the oldest ones)
        self._rendered = ""  # the text the current sequence stands for (prompt render + reply text)
        self._eos_text = ""  # the reply's final EOS as text, which the template writes after the reply
        self._reply = ""  # the last reply's text
        self._shown: list[dict[str, str]] = []  # the messages the last prompt rendered
        self._texts: list[str] = []  # each sequence's text (prompt renders + reply texts), as `_rendered` grew
        self._marks: list[tuple[int, int, int]] = []  # after each reply: (sequence, its ids then, its text then)

    def prompt(self, messages: list[dict[str, str]], keep_from: int) -> tuple[list[int], int, int] | None:
        """(prompt ids, sequence index, position of the reply's first token) for the pending turn;
        None when the prompt cannot fit `max_prompt_tokens`."""
        first = 1 if messages and messages[0]["role"] == "system" else 0
        if self.sequences and self.continue_sequences:
            continued = self._continue(messages[:first] + messages[first + self._dropped:])
            if continued is not None:
                return continued
            resumed = self._resume_from_a_reply(messages)
            if resumed is not None:
                return resumed
        # A sequence that outgrew the budget restarts at half of it, so that the turns after it extend it again
        # (keeping their KV cache) instead of each re-fitting and re-tokenising the whole prompt.
        room = self.builder.max_prompt_tokens // 2 if self.continue_sequences else 0
        fitted = self.builder.fit(messages, keep_from, room, self._still_dropped(messages, first))
        if fitted is None:
            return None
        ids, self._rendered, self._dropped = fitted
        self._shown = messages[:first] + messages[first + self._dropped:]
        self.sequences.append(list(ids))
        self._texts.append(self._rendered)
        return ids, len(self.sequences) - 1, len(ids)

    def _resume_from_a_reply(self, messages: list[dict[str, str]]) -> tuple[list[int], int, int] | None:
        """A new sequence from the latest earlier reply whose text (prompt render + reply + EOS) the render of
        `messages` extends: its ids up to there + the rest tokenised. Only for a history that grew (no turn dropped,
        `messages` extend the last prompt's), and only where the result fits the budget; None otherwise."""
        if self._dropped or len(messages) <= len(self._shown) or messages[:len(self._shown)] != self._shown:
            return None
        text = self.builder.render(messages)
        for sequence, length, end in reversed(self._marks):
            before = self._texts[sequence][:end]
            if len(text) > len(before) and text.startswith(before):
                ids = self.sequences[sequence][:length] + self.builder.tokenize(text[len(before):])
                if len(ids) > self.builder.max_prompt_tokens:
                    return None
                self.sequences.append(ids)
                self._texts.append(text)
                self._rendered, self._shown = text, list(messages)
                return list(ids), len(self.sequences) - 1, len(ids)
        return None

    def _still_dropped(self, messages: list[dict[str, str]], first: int) -> int:
        """The turns the last prompt dropped, when `messages` extend what it showed (the same episode's history,
        longer): a fit then starts from them. 0 otherwise (e.g. `last` shows each decision alone)."""
        kept = self._shown[first:]
        start = first + self._dropped
        if not self._dropped or messages[:first] != self._shown[:first] or messages[start:start + len(kept)] != kept:
            return 0
        return self._dropped

    def _continue(self, messages: list[dict[str, str]]) -> tuple[list[int], int, int] | None:
        before = self._rendered + self._eos_text
        text = self.builder.glue(messages, self._shown, before, self._reply + self._eos_text)
        if text is None:
            return None  # the template re-rendered the history: this turn starts a new sequence
        glue = self.builder.tokenize(text)
        sequence = self.sequences[-1]
        if not glue or len(sequence) + len(glue) > self.builder.max_prompt_tokens:
            return None
        sequence.extend(glue)
        self._rendered, self._shown = before + text, list(messages)
        self._texts[-1] = self._rendered
        return list(sequence), len(self.sequences) - 1, len(sequence)

    def add_reply(self, reply_ids: list[int], reply_text: str) -> None:
        """Append the sampled ids to the current sequence; `reply_text` is what the env and messages got."""
        self.sequences[-1].extend(reply_ids)
        self._rendered += reply_text
        self._reply = reply_text
        ends_with_eos = bool(reply_ids) and reply_ids[-1] in self.eos_ids
        self._eos_text = self.builder.token_text(reply_ids[-1]) if ends_with_eos else ""
        self._texts[-1] = self._rendered + self._eos_text  # what the template writes after the reply: its EOS
        self._marks.append((len(self.sequences) - 1, len(self.sequences[-1]), len(self._texts[-1])))
