"""A coding agent's episode through the local decode loop, for tests and bench/long_episode.py: a chat template that
drops earlier turns' reasoning, scripted reasoning replies, observations as tool and as user messages."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from ppo_affine.local_generation import LocalGenerator
from ppo_affine.prompts import PromptBuilder

# Drops every earlier turn's reasoning as Qwen3's template does (an assistant message's reasoning shows only after
# the last user or tool message; `</think>` cut from its content), and opens the reply's reasoning in the generation
# prompt as Qwen3.6's does. Qwen3.6's own template replaces it once tests/fixtures/qwen3_6/ lands, in one line:
# CHAT_TEMPLATE = (ROOT / "tests" / "fixtures" / "qwen3_6" / "chat_template.jinja").read_text()
REASONING_CHAT_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] in ('user', 'tool') %}{% set ns.last_query = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query and m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n"
    "</think>\n\n{% endif %}{{ m['content'].split('</think>')[-1].lstrip('\n') }}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
CHAT_TEMPLATE = REASONING_CHAT_TEMPLATE


class ScriptedReasoning(LocalGenerator):
    """The real decode loop (every turn's tokens run through the model, caches kept), whose replies are scripted:
    reasoning, then an answer, then the end of the message, as a reasoning model's (turn n's names n)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.turns: dict[int, int] = {}  # a request's seed -> its turn

    def _choose(self, logits, requests, keys):
        tokens = []
        for request in requests:
            turn = self.turns.setdefault(request.seed, len(self.turns))
            text = f"the test calls play() {turn} times, look at line {turn}\n</think>\n\nI run: grep -n {turn} play.py"
            script = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            tokens.append(script[len(request.reply)])
        return torch.tensor(tokens, device=logits.device), torch.zeros(len(requests), dtype=torch.float64)


def observation(turn: int, lines: int = 3) -> dict[str, str]:
    """A tool's output (tool role, as a tool-calling agent sends it) or a shell's as mini-swe-agent sends it (user
    role), on alternate turns: a return code and `lines` lines of a file (~13 tokens each with the tiny tokenizer)."""
    text = f"<returncode>{turn % 3}</returncode>\n" + f"line {turn} of the file: def play(): return {turn}\n" * lines
    return {"role": "tool" if turn % 2 else "user", "content": text}


def reasoning_stripped(turn: int, text: str) -> dict[str, str]:
    """A scripted reply as the agent's client resends it: reasoning as its own field (the template drops it) on even
    turns, cut from the content (litellm strips `<think>...</think>`) on odd ones."""
    reasoning, answer = text.split("</think>")
    if turn % 2:
        return {"role": "assistant", "content": answer.strip()}
    return {"role": "assistant", "content": answer.strip(), "reasoning_content": reasoning.strip()}


def converse(generator: LocalGenerator, turns: int, reply_message: Callable[[int, str], dict],
             observation_lines: int = 3, on_turn: Callable[[int, list[int], float], None] | None = None
             ) -> tuple[list[list[int]], list[list[float]], int]:
    """An agent episode of `turns` turns through `generator`: each prompt the template renders from the messages so
    far, each reply appended by `reply_message(turn, text)`, then an observation; `on_turn(turn, prompt, seconds)`
    after each reply. Returns the replies, their log-probs and the final length (last prompt + its reply)."""
    builder = PromptBuilder(generator.tokenizer, 10**7)
    messages = [{"role": "system", "content": "You fix bugs in a repository."},
                {"role": "user", "content": "The tests of play() fail. Find out why."}]
    replies, logprobs, final = [], [], 0

    async def play():
        nonlocal final
        async with generator.rollout(step=0):
            for turn in range(turns):
                prompt = builder.encode(messages)
                started = time.perf_counter()
                reply = await generator.generate(prompt, order_key=0, seed=turn)
                if on_turn is not None:
                    on_turn(turn, prompt, time.perf_counter() - started)
                replies.append(reply.token_ids)
                logprobs.append(reply.logprobs)
                final = len(prompt) + len(reply.token_ids)
                messages.append(reply_message(turn, generator.tokenizer.decode(reply.token_ids,
                                                                               skip_special_tokens=True)))
                messages.append(observation(turn, observation_lines))
        await generator.close()
    asyncio.run(play())
    return replies, logprobs, final
