"""Inspect what a run recorded for one episode: `python -m ppo_affine.episodes show RUN --step S --episode N`.

Reads RUN/samples.jsonl (written every `logging.log_samples_every` steps) and prints the episode's model calls one by
one: the prompt and sampled token ids, the decoded reply, what the server returned of it (reasoning, content, tool
calls), the sampler's log-probs, the adapter step that sampled it and its reward. For each call made through the
endpoint it re-renders the recorded request with the model's chat template, as the endpoint renders it, and checks
that this reproduces the recorded prompt ids, naming the first token that differs where it does not (a call whose
prompt reused earlier sampled ids may differ where re-tokenising the text splits it otherwise).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ppo_affine.run_log import SAMPLES_FILE

SHOWN_IDS = 12  # ids and log-probs printed at the start of a list


class NotRecorded(ValueError):
    """The run has no such step or episode in its samples."""


def find_episode(run_dir: Path, step: int, episode: int) -> dict[str, Any]:
    """The samples.jsonl record of `episode` at `step`; NotRecorded names what is there instead."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.is_file():
        raise NotRecorded(f"{path} does not exist: the run records episodes with logging.log_samples_every=N")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for record in records:
        if record.get("step") == step and record.get("episode", 0) == episode:
            return record
    there = sorted({(r.get("step"), r.get("episode", 0)) for r in records})
    raise NotRecorded(f"{path} holds no episode {episode} of step {step}; it holds (step, episode) {there[:20]}")


def first_difference(recorded: list[int], rendered: list[int]) -> int | None:
    """The first position where the two id lists differ (one ending early counts), or None when equal."""
    for position, (a, b) in enumerate(zip(recorded, rendered)):
        if a != b:
            return position
    return None if len(recorded) == len(rendered) else min(len(recorded), len(rendered))


def rerender_check(call: dict[str, Any], prompts) -> str:
    """One line: whether re-rendering the call's request reproduces its recorded prompt ids."""
    from ppo_affine.endpoint import render_request

    recorded = call["prompt_ids"]
    try:
        render, _ = render_request(prompts, call["request"])
    except Exception as exc:  # the template refuses the recorded request
        return f"re-render: the template refused the request: {type(exc).__name__}: {exc}"
    rendered = prompts.tokenize(render)
    at = first_difference(recorded, rendered)
    if at is None:
        return f"re-render: reproduces the {len(recorded)} recorded prompt ids"

    def token(ids: list[int]) -> str:
        return f"{ids[at]} {prompts.tokenizer.decode([ids[at]])!r}" if at < len(ids) else "(end)"

    return (f"re-render: differs at token {at} of {len(recorded)}: recorded {token(recorded)}, re-rendered "
            f"{token(rendered)} (re-rendered {len(rendered)} ids)")


def describe(record: dict[str, Any], tokenizer, prompts=None) -> list[str]:
    """The lines `show` prints for one recorded episode."""
    calls = record.get("calls")
    if calls is None:
        raise NotRecorded("this sample was written before calls were recorded: it holds the messages only")
    lines = [f"step {record['step']} episode {record.get('episode', 0)}: env {record['env']} task {record['task_id']} "
             f"seed {record['seed']} | score {record['score']} | error {record.get('error')} | "
             f"cut off {record.get('cut_off')} | {len(calls)} calls"]
    for n, call in enumerate(calls):
        prompt, sampled, logprobs = call["prompt_ids"], call["token_ids"], call.get("logprobs")
        lines.append(f"--- call {n}: prompt {len(prompt)} ids, sampled {len(sampled)} ids, finish "
                     f"{call.get('finish_reason', '-')}, adapter step {call.get('adapter_step')}, reward "
                     f"{call.get('reward')}")
        lines.append(f"prompt ids:  {_head(prompt)}")
        lines.append(f"prompt tail: {tokenizer.decode(prompt[-40:])!r}")
        lines.append(f"sampled ids: {_head(sampled)}")
        lines.append(f"decoded:     {tokenizer.decode(sampled)!r}")
        if logprobs:
            lines.append(f"log-probs:   {_head([round(x, 3) for x in logprobs])} (mean {sum(logprobs) / len(logprobs):.3f}, "
                         f"min {min(logprobs):.3f})")
        else:
            lines.append("log-probs:   not recorded (the generator returned none)")
        parsed = call.get("parsed")
        if parsed is not None:
            lines.append(f"reasoning:   {parsed.get('reasoning_content')!r}")
            lines.append(f"content:     {parsed.get('content')!r}")
            for tool_call in parsed.get("tool_calls") or []:
                function = tool_call["function"]
                lines.append(f"tool call:   {function['name']}({function['arguments']})")
        if call.get("request") is not None and prompts is not None:
            lines.append(rerender_check(call, prompts))
    return lines


def _head(values: list) -> str:
    shown = ", ".join(str(v) for v in values[:SHOWN_IDS])
    return f"[{shown}{', ...' if len(values) > SHOWN_IDS else ''}]"


def load_prompts(record: dict[str, Any], model: str | None):
    """The tokenizer (`--model`, a tokenizer folder, else the model the sample names) and a PromptBuilder with the
    run's chat-template kwargs, as the run's endpoint had them."""
    from ppo_affine.config import ModelConfig
    from ppo_affine.prompts import PromptBuilder

    if model is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    elif record.get("model"):
        from ppo_affine.model_files import load_tokenizer

        tokenizer = load_tokenizer(ModelConfig(**record["model"]))
    else:
        raise NotRecorded("the sample names no model: pass --model with the run's tokenizer folder")
    run_kwargs = (record.get("model") or {}).get("chat_template_kwargs") or {}  # the run's, as its endpoint had them
    return tokenizer, PromptBuilder(tokenizer, max_prompt_tokens=10**9, chat_template_kwargs=run_kwargs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ppo_affine.episodes", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print one recorded episode's calls and check their re-render")
    show.add_argument("run", type=Path, help="the run folder (holds samples.jsonl)")
    show.add_argument("--step", type=int, required=True)
    show.add_argument("--episode", type=int, default=0, help="the episode's place in the step (default 0)")
    show.add_argument("--model", help="the run's tokenizer folder (default: the model the sample names)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        record = find_episode(args.run, args.step, args.episode)
        tokenizer, prompts = load_prompts(record, args.model)
        lines = describe(record, tokenizer, prompts)
    except NotRecorded as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
