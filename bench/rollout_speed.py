"""Generated tokens/s of the rollout engine vs a plain batched `generate` and vs one `generate` per action.

All three use the same model on the same machine in one run, and the same prompts: the ones the
rollout engine actually built while playing. Prints JSON.

    python -m bench.rollout_speed                    # SmolLM2-135M (cpu preset), 8 episodes of leduc_poker
    python -m bench.rollout_speed --episodes 16 --game goofspiel --max-new-tokens 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from ppo_affine.envs.tasks import Task
from ppo_affine.envs.factory import make_envs
from ppo_affine.envs.tasks import game_task_id
from ppo_affine.local_generation import LocalGenerator
from ppo_affine.policy import load_policy
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import RolloutRunner
from ppo_affine.config import load_config


def plain_generate(policy, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int] | None = None) -> int:
    """One left-padded batched generate over `prompts`; returns generated tokens (up to the first EOS)."""
    tokenizer = policy.tokenizer
    eos_ids = eos_ids or {tokenizer.eos_token_id}
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.no_grad():
        out = policy.model.generate(input_ids=ids.to(policy.device), attention_mask=mask.to(policy.device),
                                    max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=None,
                                    top_p=1.0, pad_token_id=tokenizer.pad_token_id, eos_token_id=sorted(eos_ids))
    if policy.device.type == "cuda":
        torch.cuda.synchronize()
    generated = 0
    for row in out[:, width:].tolist():
        generated += next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
    return generated


async def engine(runner: RolloutRunner, tasks: list[Task]):
    started = time.perf_counter()
    episodes = await runner.run(tasks, step=0)
    seconds = time.perf_counter() - started
    prompts = [e.prompt_ids(turn) for e in episodes for turn in e.turns]
    return seconds, sum(e.generated_tokens for e in episodes), prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--game", default="leduc_poker")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    config = load_config(presets=[args.preset], overrides=[
        f"generation.max_new_tokens={args.max_new_tokens}", f"generation.max_concurrent_episodes={args.episodes}",
        "generation.context_strategy=last", *args.set])
    torch.manual_seed(0)
    policy = load_policy(config.train.model, config.train.lora, torch.device("cpu"))
    gen_cfg = config.train.generation
    envs = make_envs(config.env, seed=0)
    runner = RolloutRunner(envs, LocalGenerator(policy, gen_cfg, seed=0),
                           PromptBuilder(policy.tokenizer, gen_cfg.max_prompt_tokens), gen_cfg)
    tasks = [Task("openspiel", game_task_id(args.game, i), 1000 + i, "random", "bench", False)
             for i in range(args.episodes)]
    plain_generate(policy, [[policy.tokenizer.eos_token_id] * 8], 2)  # warm-up: first call pays one-off costs
    engine_seconds, engine_tokens, prompts = asyncio.run(engine(runner, tasks))

    started = time.perf_counter()
    ceiling_tokens = plain_generate(policy, prompts, args.max_new_tokens)
    ceiling_seconds = time.perf_counter() - started

    started = time.perf_counter()
    sequential_tokens = sum(plain_generate(policy, [p], args.max_new_tokens) for p in prompts)
    sequential_seconds = time.perf_counter() - started

    engine_rate = engine_tokens / engine_seconds
    result = {
        "model": config.train.model.name_or_path, "game": args.game, "episodes": args.episodes,
        "turns": len(prompts), "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
        "engine": {"tokens": engine_tokens, "seconds": round(engine_seconds, 2), "tokens_per_s": round(engine_rate, 2)},
        "plain_batched_generate": {"tokens": ceiling_tokens, "seconds": round(ceiling_seconds, 2),
                                   "tokens_per_s": round(ceiling_tokens / ceiling_seconds, 2)},
        "sequential_generate": {"tokens": sequential_tokens, "seconds": round(sequential_seconds, 2),
                                "tokens_per_s": round(sequential_tokens / sequential_seconds, 2)},
    }
    result["engine_vs_ceiling"] = round(engine_rate / result["plain_batched_generate"]["tokens_per_s"], 3)
    result["engine_vs_sequential"] = round(engine_rate / result["sequential_generate"]["tokens_per_s"], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
