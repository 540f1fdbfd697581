"""prompts.py: later turns continue the episode's exact token ids while the template is append-only."""
import pytest

from ppo_affine.prompts import PromptBuilder, TokenHistory
from ppo_affine.testing.tiny import make_tokenizer

SYSTEM = {"role": "system", "content": "rules"}

# Like Qwen3: earlier assistant turns are rendered without their <think> block.
STRIPPING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def history(tokenizer, budget=4096, template=None):
    if template:
        tokenizer = make_tokenizer()
        tokenizer.chat_template = template
    return TokenHistory(PromptBuilder(tokenizer, budget), {tokenizer.eos_token_id})


def test_second_turn_extends_the_first_with_the_sampled_ids_and_the_template_glue(tokenizer):
    h = history(tokenizer)
    first = [SYSTEM, {"role": "user", "content": "move 1?"}]
    ids, sequence, start = h.prompt(first, keep_from=1)
    assert ids == h.builder.encode(first) and (sequence, start) == (0, len(ids))
    # "7", "7" as two tokens: re-tokenising the text "77" would give other ids, the history keeps these
    reply = tokenizer("7", add_special_tokens=False)["input_ids"] * 2 + [tokenizer.eos_token_id]
    h.add_reply(reply, "77")
    second = first + [{"role": "assistant", "content": "77"}, {"role": "user", "content": "move 2?"}]
    ids2, sequence2, start2 = h.prompt(second, keep_from=3)
    assert sequence2 == 0 and ids2[: start + len(reply)] == ids + reply and start2 == len(ids2)
    glue = ids2[start + len(reply):]
    assert tokenizer.decode(glue) == "\n<|im_start|>user\nmove 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids2) == h.builder.render(second)  # the same text, our token ids
    assert h.sequences == [ids2]


def test_a_reply_cut_off_before_eos_gets_the_end_of_turn_token_as_glue(tokenizer):
    h = history(tokenizer)
    first = [SYSTEM, {"role": "user", "content": "go"}]
    ids, _, _ = h.prompt(first, 1)
    reply = tokenizer("ab", add_special_tokens=False)["input_ids"]
    h.add_reply(reply, "ab")
    ids2, _, _ = h.prompt(first + [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "again"}], 3)
    assert tokenizer.decode(ids2[len(ids) + len(reply):]).startswith("<|im_end|>\n<|im_start|>user")


def test_a_template_that_rerenders_history_starts_a_new_sequence(tokenizer):
    h = history(tokenizer, template=STRIPPING_TEMPLATE)
    tok = h.builder.tokenizer
    first = [SYSTEM, {"role": "user", "content": "go"}]
    h.prompt(first, 1)
    reply_text = "<think>hmm</think>1"
    h.add_reply(tok(reply_text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], reply_text)
    second = first + [{"role": "assistant", "content": reply_text}, {"role": "user", "content": "next"}]
    ids2, sequence2, start2 = h.prompt(second, 3)
    assert sequence2 == 1 and start2 == len(ids2) and len(h.sequences) == 2
    assert ids2 == h.builder.encode(second) and "hmm" not in tok.decode(ids2)


def test_a_reply_stored_stripped_starts_a_sequence_that_keeps_the_earlier_replies_sampled_ids(tokenizer):
    """The client stores reply 2 without its leading space: the history no longer extends the sequence, and the new
    sequence is the old one up to reply 1 (sampled as "x", " ", "5", which re-tokenising "x 5" would not give:
    "x", " 5") + the rest."""
    h = history(tokenizer)
    token, eos = (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]), tokenizer.eos_token_id
    sampled = token("x") + token(" ") + token("5") + [eos]
    assert token("x 5") != sampled[:-1]
    first = [SYSTEM, {"role": "user", "content": "move 1?"}]
    ids, _, _ = h.prompt(first, 1)
    h.add_reply(sampled, "x 5")
    second = first + [{"role": "assistant", "content": "x 5"}, {"role": "user", "content": "move 2?"}]
    _, sequence2, _ = h.prompt(second, 3)
    assert sequence2 == 0
    h.add_reply(token(" 7") + [eos], " 7")
    third = second + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "move 3?"}]
    ids3, sequence3, start3 = h.prompt(third, 5)
    assert sequence3 == 1 and start3 == len(ids3) and len(h.sequences) == 2
    assert ids3[:len(ids) + len(sampled)] == ids + sampled  # reply 1 as sampled
    assert ids3 != h.builder.encode(third) and tokenizer.decode(ids3) == h.builder.render(third)
    h.add_reply([eos], "")  # the next turn continues the new sequence
    ids4, sequence4, _ = h.prompt(third + [{"role": "assistant", "content": ""}, {"role": "user", "content": "4?"}], 7)
    assert sequence4 == 1 and ids4[:len(ids3) + 1] == ids3 + [eos]


def test_the_last_strategy_shows_a_fresh_prompt_each_turn(tokenizer):
    h = history(tokenizer)
    h.prompt([SYSTEM, {"role": "user", "content": "state 1"}], 1)
    h.add_reply([tokenizer.eos_token_id], "")
    _, sequence, _ = h.prompt([SYSTEM, {"role": "user", "content": "state 2"}], 1)
    assert sequence == 1


def test_a_continuation_over_budget_falls_back_to_a_trimmed_fresh_prompt(tokenizer):
    first = [SYSTEM, {"role": "user", "content": "move 1?"}]
    second = first + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "move 2?"}]
    budget = len(PromptBuilder(tokenizer, 10**6).encode(second)) - 1
    h = history(tokenizer, budget=budget)
    h.prompt(first, 1)
    h.add_reply(tokenizer("7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], "7")
    ids2, sequence2, _ = h.prompt(second, keep_from=3)
    assert sequence2 == 1 and ids2 == h.builder.encode([SYSTEM, second[3]])


def long_game(turns: int) -> list[dict[str, str]]:
    """A system message, then `turns` user/assistant pairs of some length, then the pending decision."""
    messages = [SYSTEM]
    for turn in range(turns):
        messages += [{"role": "user", "content": f"state {turn}: " + "board row " * 8}, {"role": "assistant", "content": str(turn)}]
    return messages + [{"role": "user", "content": "your move?"}]


def slow_fit(builder: PromptBuilder, messages, keep_from):
    """The definition: drop pairs one at a time, re-rendering each time, until it fits."""
    first, drop = 1, 0
    while True:
        kept = messages[:first] + messages[first + drop:]
        ids = builder.encode(kept)
        if len(ids) <= builder.max_prompt_tokens or drop >= keep_from - first:
            return (ids, drop) if len(ids) <= builder.max_prompt_tokens else None
        drop += 2 if keep_from - first - drop >= 2 else 1


@pytest.mark.parametrize("memo", [True, False], ids=["line-memo", "offsets"])  # how the cuts' tokens are counted
@pytest.mark.parametrize("budget", [60, 150, 333, 600, 5000])
def test_fit_drops_what_dropping_pair_by_pair_drops_with_one_tokenisation_to_estimate(tokenizer, budget, memo,
                                                                                      monkeypatch):
    builder = PromptBuilder(tokenizer, budget)
    if not memo:
        builder._memos = {}
    messages = long_game(12)
    keep_from = len(messages) - 1
    expected = slow_fit(builder, messages, keep_from)
    tokenised = []
    original = builder.tokenize
    monkeypatch.setattr(builder, "tokenize", lambda text: tokenised.append(text) or original(text))
    fitted = builder.fit(messages, keep_from)
    assert (None if fitted is None else (fitted[0], fitted[2])) == expected
    # the whole prompt once, the shortened one once (twice when the estimate was a turn short): never once per pair
    assert len(tokenised) <= 3


def test_after_a_drop_later_turns_extend_the_shortened_sequence(tokenizer):
    budget = 300
    h = history(tokenizer, budget=budget)
    messages = long_game(10)
    ids, sequence, _ = h.prompt(messages, keep_from=len(messages) - 1)
    assert len(ids) <= budget // 2  # half the budget left for the turns to come
    dropped = h._dropped
    assert dropped > 0 and ids == h.builder.encode(messages[:1] + messages[1 + dropped:])
    reply = tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    h.add_reply(reply, "5")
    messages += [{"role": "assistant", "content": "5"}, {"role": "user", "content": "next?"}]
    ids2, sequence2, _ = h.prompt(messages, keep_from=len(messages) - 1)
    assert sequence2 == sequence and ids2[: len(ids) + len(reply)] == ids + reply  # continued, cache kept
    assert tokenizer.decode(ids2) == h.builder.render(messages[:1] + messages[1 + dropped:])


def test_a_refit_starts_from_the_turns_already_dropped_and_drops_what_a_fresh_fit_drops(tokenizer, monkeypatch):
    """An episode past its budget refits every few turns: the turns its last prompt dropped are not rendered again
    (the cost stays that of the kept turns as the history grows), and the prompt is the one a fresh fit gives."""
    budget = 300
    h = history(tokenizer, budget=budget)
    fresh = PromptBuilder(tokenizer, budget)
    messages = long_game(10)
    h.prompt(messages, keep_from=len(messages) - 1)
    refits = 0
    for turn in range(10, 30):
        reply = tokenizer(str(turn), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        h.add_reply(reply, str(turn))
        messages += [{"role": "assistant", "content": str(turn)},
                     {"role": "user", "content": f"state {turn}: " + "board row " * 8}]
        earlier = h._dropped
        rendered = []
        original = h.builder.render
        monkeypatch.setattr(h.builder, "render", lambda shown: rendered.append(shown) or original(shown))
        sequences = len(h.sequences)
        ids, _, _ = h.prompt(messages, keep_from=len(messages) - 1)
        monkeypatch.setattr(h.builder, "render", original)
        if len(h.sequences) == sequences:
            continue  # the turn extended the sequence: no fit
        refits += 1
        assert h._dropped >= earlier > 0
        assert all(m not in shown for m in messages[1:1 + earlier] for shown in rendered)  # none rendered again
        expected_ids, _, expected_drop = fresh.fit(messages, len(messages) - 1, budget // 2)
        assert (ids, h._dropped) == (expected_ids, expected_drop)
    assert refits >= 2


def test_a_fit_keeps_no_earlier_drop_when_the_messages_do_not_extend_the_last_prompt(tokenizer):
    h = history(tokenizer, budget=300)
    messages = long_game(10)
    h.prompt(messages, keep_from=len(messages) - 1)
    assert h._dropped > 0
    other = long_game(3)  # not this history's continuation (e.g. `last` shows each decision alone)
    assert h._still_dropped(other, 1) == 0
    ids, _, _ = h.prompt(other, keep_from=len(other) - 1)
    assert ids == h.builder.encode(other)


def test_the_compiled_template_renders_as_apply_chat_template(tokenizer):
    builder = PromptBuilder(tokenizer, 4096)
    messages = long_game(3)
    assert builder.render(messages) == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert builder._template  # the first render checked it
    later = long_game(5)
    assert builder.render(later) == tokenizer.apply_chat_template(later, add_generation_prompt=True, tokenize=False)


# Qwen2's and Llama 3's pre-tokenizer pattern: spaces go with the newlines after them
NEWLINE_KEEPING_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                           r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def tokenizer_cutting(how: str):
    from tokenizers import Regex, pre_tokenizers

    return make_tokenizer({
        "gpt2": None,
        "qwen": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(NEWLINE_KEEPING_PATTERN), behavior="isolated"),
                                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        # a marker before the text's first word only: no piece of a text tokenises as it does inside the text
        "first-word": pre_tokenizers.Metaspace(replacement="_", prepend_scheme="first"),
    }[how])


WHITESPACE_TEXTS = ["a \nb", "x  \n\n\ny", "P0 hand: 3 8 \nP1 hand: 2 3 \n\n\nYou are Player 1.\n", ".\nX", "\n\n",
                    "end \n", "<|im_end|>\n<|im_start|>user\nLegal Actions:\n1 -> [P1]Bid: 2\n\nYour choice:",
                    "tab\t\nnext", "  lead\n  indented\n\tcode"]


@pytest.mark.parametrize("how,rule", [("gpt2", "before newline"), ("qwen", "after newline"), ("first-word", None)])
def test_prompts_tokenise_piece_by_piece_only_where_that_keeps_the_tokenizers_ids(how, rule, monkeypatch):
    from ppo_affine import prompts

    monkeypatch.setattr(prompts, "VERIFY_FIRST", 12)
    monkeypatch.setattr(prompts, "VERIFY_EVERY", 5)
    tokenizer = tokenizer_cutting(how)
    builder = PromptBuilder(tokenizer, 4096)
    texts = WHITESPACE_TEXTS + [builder.render(long_game(turns)) for turns in range(1, 12)] * 3
    for text in texts:  # the first 12 check both rules, the rest run on the memo (one in 5 checked)
        assert builder.tokenize(text) == tokenizer(text, add_special_tokens=False)["input_ids"], repr(text)
    assert list(builder._memos) == ([rule] if rule else [])
    if rule:  # the texts seen again came from the memo
        assert builder._memos[rule] and builder._tokenized == len(texts)


def test_a_rule_that_stops_agreeing_is_dropped_and_the_text_gets_the_tokenizers_ids(monkeypatch):
    from ppo_affine import prompts

    monkeypatch.setattr(prompts, "VERIFY_FIRST", 1)
    monkeypatch.setattr(prompts, "VERIFY_EVERY", 1)
    tokenizer = tokenizer_cutting("gpt2")
    builder = PromptBuilder(tokenizer, 4096)
    assert builder.tokenize("one\ntwo") == tokenizer("one\ntwo", add_special_tokens=False)["input_ids"]
    assert builder._memos  # "one\ntwo" tokenises alike either way
    for memo in builder._memos.values():  # memos gone wrong: the next check finds them
        memo.update({piece: [0] for piece in memo})
    expected = tokenizer("one\ntwo", add_special_tokens=False)["input_ids"]
    assert builder.tokenize("one\ntwo") == expected
    assert list(builder._memos) == ["after newline"]  # past the first texts only the rule in use is checked
    assert builder.tokenize("one\ntwo") == expected
    assert builder._memos == {}  # for good: tokenised whole from now on
    assert builder.tokenize("one\ntwo") == tokenizer("one\ntwo", add_special_tokens=False)["input_ids"]


# Append-only, but a user message's render depends on how many came before it: a window shows it otherwise
LATE_TAG_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'user' and loop.index > 4 %}[late] "
    "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def played(builder: PromptBuilder, replies: list[str], shown=lambda messages: messages,
           system: bool = True) -> list[list[int]]:
    """A game of len(replies) turns through one TokenHistory: each reply, then the next state. `shown`: which
    messages a turn's prompt shows (the context strategy)."""
    tok = builder.tokenizer
    h = TokenHistory(builder, {tok.eos_token_id})
    messages = [SYSTEM] * system + [{"role": "user", "content": "state 0: board row board row"}]
    for turn, reply in enumerate(replies):
        view = shown(messages)
        assert h.prompt(view, len(view) - 1) is not None
        h.add_reply(tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], reply)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"state {turn + 1}: row"}]
    return h.sequences


# Like SmolLM2's: a conversation without a system message gets a default one (an empty one gets none)
DEFAULT_SYSTEM_TEMPLATE = (
    "{% if messages and messages[0]['role'] != 'system' %}<|im_start|>system\ndefault<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Like Qwen's newer templates: a conversation without a user message is refused
NEEDS_USER_TEMPLATE = (
    "{% if not (messages | selectattr('role', 'equalto', 'user') | list) %}{{ raise_exception('No user query') }}"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Gemma's, Mistral's: after the system message, roles must alternate from a user message on
ALTERNATING_TEMPLATE = (
    "{% set offset = 1 if messages and messages[0]['role'] == 'system' else 0 %}"
    "{% for m in messages[offset:] %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("template,windows", [(None, True), (STRIPPING_TEMPLATE, True), (LATE_TAG_TEMPLATE, False),
                                              (DEFAULT_SYSTEM_TEMPLATE, True), (NEEDS_USER_TEMPLATE, True),
                                              (ALTERNATING_TEMPLATE, True)],
                         ids=["default", "stripping", "late-tag", "default-system", "needs-user", "alternating"])
def test_a_turn_renders_only_its_new_messages_where_that_gives_the_whole_renders_text(template, windows, system,
                                                                                     monkeypatch):
    from ppo_affine import prompts

    monkeypatch.setattr(prompts, "VERIFY_FIRST", 4)
    monkeypatch.setattr(prompts, "VERIFY_EVERY", 3)
    tokenizer = make_tokenizer()
    if template:
        tokenizer.chat_template = template
    replies = [str(turn % 10) if turn % 5 else f"<think>turn {turn}</think>{turn % 10}" for turn in range(24)]
    whole = PromptBuilder(tokenizer, 4096)
    whole._windows = False  # every turn renders the whole conversation
    builder = PromptBuilder(tokenizer, 4096)
    rendered = []
    original = builder.render
    monkeypatch.setattr(builder, "render", lambda messages: rendered.append(len(messages)) or original(messages))
    sequences = played(whole, replies, system=system)
    assert played(builder, replies, system=system) == sequences
    assert len(sequences) == (6 if template is STRIPPING_TEMPLATE else 1)  # each of 5 reasoned replies: a new one
    assert builder._windows is windows
    if windows:  # after the checks, most turns rendered a few messages: the head (system or last state), the new ones
        assert sum(n <= 4 for n in rendered) >= len(replies)
    if windows:  # a template that refuses the system message alone keeps windows headed by it and the last state
        assert builder._system_head is not (system and template in (NEEDS_USER_TEMPLATE, ALTERNATING_TEMPLATE))


def test_a_window_is_not_used_when_earlier_messages_changed(tokenizer, monkeypatch):
    """A view that keeps only the last turns (its oldest turn changes every turn) is not an extension of the last
    prompt's messages: the whole render decides, and every turn starts a new sequence as before."""
    def last_two_turns(messages):
        return messages[:1] + messages[-5:] if len(messages) > 6 else list(messages)

    whole = PromptBuilder(tokenizer, 4096)
    whole._windows = False
    replies = [str(turn) for turn in range(8)]
    sequences = played(PromptBuilder(tokenizer, 4096), replies, last_two_turns)
    assert sequences == played(whole, replies, last_two_turns) and len(sequences) > 1
