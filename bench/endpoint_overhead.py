"""What the endpoint costs per call: the game env played natively and through its own evaluate(), side by side.

Both paths play the same leduc_poker games with the same replies (a legal action id read off the prompt and chosen
by the request's seed, then EOS: no model, so what is timed is everything but the model) and the embedded env in
this process:
- `native`: the rollout plays the env turn by turn (render, tokenise, generate, step);
- `endpoint`: the rollout runs the game env's evaluate() (ppo_affine/envs/llm_play.py, the validators' client:
  streamed requests over HTTP) against the trainer's endpoint (render with the template, splice, generate, parse,
  answer as server-sent events, record).
`overhead_ms_per_call` = (endpoint wall time - native wall time) / calls, at one episode at a time and at
`--concurrency`. `same_replies`: both paths sampled the same ids (they must).

    python -m bench.endpoint_overhead                 # SmolLM2-135M's tokenizer and chat template, 32 games
    python -m bench.endpoint_overhead --small         # the tiny test tokenizer, 8 games (CI size)
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import time

from ppo_affine.config import EndpointConfig, GenerationConfig, load_config
from ppo_affine.endpoint import ChatEndpoint
from ppo_affine.envs.llm_play import GameEvaluator
from ppo_affine.envs.openspiel_env import OpenSpielEnv
from ppo_affine.envs.tasks import Task, game_task_id
from ppo_affine.generation import Generation
from ppo_affine.prompts import PromptBuilder
from ppo_affine.reply_parsers import PLAIN
from ppo_affine.rollout import RolloutRunner
from ppo_affine.testing.scripted import scripted_reply


class LegalMoves:
    """A generator that costs nothing: a legal action id from the prompt, chosen by the request's seed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.eos_ids = tokenizer, {tokenizer.eos_token_id}

    async def generate(self, prompt_ids, order_key, seed):
        return Generation(scripted_reply(self.tokenizer, prompt_ids, seed, self.tokenizer.eos_token_id))


class InProcessEvaluate:
    """The game env's evaluate() called in this process (no env server between): only the endpoint is HTTP."""
    call_timeout = 600.0

    def __init__(self):
        self.evaluator = GameEvaluator(OpenSpielEnv("evaluate"), llm_retries=0)

    async def methods(self):
        return ["evaluate"]

    async def evaluate(self, timeout, **kwargs):
        return await self.evaluator.evaluate(timeout=timeout, **kwargs)

    async def close(self):
        await self.evaluator.close()


async def play(tokenizer, tasks: list[Task], concurrency: int, through_endpoint: bool) -> dict:
    cfg = GenerationConfig(backend="local", max_new_tokens=8, temperature=0.0, max_concurrent_episodes=concurrency,
                           context_strategy="full", max_prompt_tokens=8192)
    generator, prompts = LegalMoves(tokenizer), PromptBuilder(tokenizer, cfg.max_prompt_tokens)
    if through_endpoint:
        env = InProcessEvaluate()
        endpoint = ChatEndpoint(generator, prompts, cfg, PLAIN, "bench", EndpointConfig())
        runner = RolloutRunner({"game": ("evaluate", env)}, generator, prompts, cfg, endpoint=endpoint,
                               evaluate_kwargs={"game": {"opponent": "random"}})
        await endpoint.start()  # listening is set-up, not a call's cost
    else:
        env, endpoint = OpenSpielEnv("evaluate"), None
        runner = RolloutRunner({"game": ("openspiel", env)}, generator, prompts, cfg)
    try:
        started = time.perf_counter()
        episodes = await runner.run(tasks, step=0)
        seconds = time.perf_counter() - started
    finally:
        if endpoint is not None:
            await endpoint.close()
        await env.close()
    calls = sum(len(e.turns) for e in episodes)
    digest = hashlib.sha256(json.dumps([[t.response_ids for t in e.turns] for e in episodes]).encode())
    return {"calls": calls, "failed": sum(bool(e.error) for e in episodes), "wall_s": round(seconds, 3),
            "ms_per_call": round(1e3 * seconds / max(calls, 1), 3), "digest": digest.hexdigest()[:16]}


async def measure(args: argparse.Namespace) -> dict:
    """Both paths at one game at a time and at --concurrency; the report."""
    if args.small:
        from ppo_affine.testing.tiny import make_tokenizer

        tokenizer, name = make_tokenizer(), "tiny"
    else:
        from ppo_affine.model_files import load_tokenizer

        model = load_config(presets=["cpu"]).train.model
        tokenizer, name = load_tokenizer(model), model.name_or_path
    games = args.games or (8 if args.small else 32)
    tasks = [Task("game", game_task_id("leduc_poker"), seed, "random", "s", False) for seed in range(games)]
    report: dict = {"tokenizer": name, "games": games, "cpu_count": os.cpu_count(),
                    "load_average_1m": os.getloadavg()[0], "python": platform.python_version(), "settings": {}}
    for concurrency in (1, args.concurrency):
        native = await play(tokenizer, tasks, concurrency, through_endpoint=False)
        endpoint = await play(tokenizer, tasks, concurrency, through_endpoint=True)
        report["settings"][f"concurrency_{concurrency}"] = {
            "native": native, "endpoint": endpoint, "same_replies": native["digest"] == endpoint["digest"],
            "overhead_ms_per_call": round(1e3 * (endpoint["wall_s"] - native["wall_s"]) / max(native["calls"], 1), 3),
        }
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="the tiny test tokenizer and 8 games")
    parser.add_argument("--games", type=int, help="leduc_poker games per setting (default 32, --small 8)")
    parser.add_argument("--concurrency", type=int, default=8)
    report = asyncio.run(measure(parser.parse_args(argv)))
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
