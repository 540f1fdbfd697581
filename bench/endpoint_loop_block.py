"""How long one endpoint call holds the event loop that launches decode steps, with the render on the loop and on
the endpoint's worker thread.

A Qwen3.6-style agent conversation of `--turns` turns (reasoning, one tool call, its result, as in an SWE harness),
rendered with Qwen3.6's own chat template (tests/fixtures/qwen3_6/chat_template.jinja) and tools:
- `on_loop_ms`: the render + tokenisation the endpoint did on the event loop before (the loop is held that long);
- `worker_longest_gap_ms`: the longest the event loop went without a step (a coroutine that only yields) while the
  endpoint served the same call with its render and tokenisation on the worker thread (reply scripted, no model).
Each is the median of `--repeats` calls.

    python -m bench.endpoint_loop_block             # SmolLM2-135M's tokenizer, 10 and 50 turns
    python -m bench.endpoint_loop_block --small     # the tiny test tokenizer (CI size)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from ppo_affine.config import EndpointConfig, GenerationConfig, load_config
from ppo_affine.endpoint import ChatEndpoint, render_request
from ppo_affine.generation import Generation
from ppo_affine.prompts import PromptBuilder
from ppo_affine.reply_parsers import REPLY_FORMATS

TEMPLATE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen3_6" / "chat_template.jinja"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix the failing test."}]
    for n in range(turns):
        messages += [{"role": "assistant", "content": "", "reasoning_content": f"Step {n}: read module {n}.",
                      "tool_calls": [{"id": f"c{n}", "type": "function", "function": {
                          "name": "bash", "arguments": json.dumps({"cmd": f"cat src/module_{n}.py"})}}]},
                     {"role": "tool", "tool_call_id": f"c{n}", "content": f"def f{n}(x):\n    return x + {n}\n" * 12}]
    return messages


class Scripted:
    def __init__(self, tokenizer):
        self.tokenizer, self.eos_ids = tokenizer, {tokenizer.eos_token_id}

    async def generate(self, prompt_ids, order_key, seed):
        return Generation(self.tokenizer.encode("Done.\n</think>\n\nFixed.", add_special_tokens=False)
                          + [self.tokenizer.eos_token_id])


def on_loop_ms(prompts: PromptBuilder, body: dict) -> float:
    started = time.perf_counter()
    render, _ = render_request(prompts, body)
    prompts.tokenize(render)
    return (time.perf_counter() - started) * 1000


def worker_longest_gap_ms(tokenizer, body: dict) -> float:
    cfg = GenerationConfig(max_new_tokens=64, max_prompt_tokens=1_000_000)
    endpoint = ChatEndpoint(Scripted(tokenizer), PromptBuilder(tokenizer, cfg.max_prompt_tokens), cfg,
                            REPLY_FORMATS["qwen3_5_moe"], "bench", EndpointConfig())
    door = endpoint.open_episode(0, (1,))
    gaps, done = [], asyncio.Event()

    async def steps():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    payload = json.dumps(body).encode()  # the harness encodes its request in its own process

    async def call():
        transport = httpx.ASGITransport(app=endpoint.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://endpoint") as client:
            try:
                response = await client.post(f"/episodes/{door.key}/v1/chat/completions", content=payload,
                                             headers={"content-type": "application/json"})
                assert response.status_code == 200, response.text
            finally:
                done.set()

    async def both():
        await asyncio.gather(call(), steps())

    asyncio.run(both())
    return max(gaps) * 1000


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.endpoint_loop_block", description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the tiny test tokenizer, 10 turns, 2 repeats")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.small:
        from ppo_affine.testing.tiny import make_tokenizer

        tokenizer, turns_list, repeats = make_tokenizer(), [10], 2
    else:
        from ppo_affine.model_files import load_tokenizer

        tokenizer, turns_list, repeats = load_tokenizer(load_config(presets=["cpu"]).train.model), [10, 50], args.repeats
    tokenizer.chat_template = TEMPLATE.read_text()
    results = {"tokenizer": "tiny" if args.small else "SmolLM2-135M", "rows": []}
    for turns in turns_list:
        body = {"messages": conversation(turns), "tools": TOOLS}
        prompts = PromptBuilder(tokenizer, 1_000_000)
        on_loop_ms(prompts, body)  # the first render compiles the template
        loop = statistics.median(on_loop_ms(PromptBuilder(tokenizer, 1_000_000), body) for _ in range(repeats))
        worker = statistics.median(worker_longest_gap_ms(tokenizer, body) for _ in range(repeats))
        results["rows"].append({"turns": turns, "prompt_tokens": len(prompts.tokenize(render_request(prompts, body)[0])),
                                "on_loop_ms": round(loop, 1), "worker_longest_gap_ms": round(worker, 1)})
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
