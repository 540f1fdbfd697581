"""SFT on reasoned conversations with each conversation's turns as one prefix tree, against each turn whole.

Replies that reason first ('<think>reason</think>ID') are shown stripped from the next turn on, so each turn
is a sequence that repeats the conversation before it. This bench plays expert games with reasons once
(`sft_warmstart.py --reason`'s teachers, the same records for both modes), then runs one SFT epoch on them
twice, each in its own process (so peak memory is that mode's): `ppo.tree_scoring` always (trees) and off
(per-turn). It reports the tokens the model processed, the episodes' unique tokens, the SFT seconds, the
mean NLL (the same in both up to rounding and minibatch order) and the peak RSS.

    python -m bench.sft_speed --games liars_dice --expert liars_dice=count_bids --episodes 24
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def expert_records(args: argparse.Namespace, path: Path) -> None:
    """Play the expert games once and write them to `path` (JSONL)."""
    from ppo_affine.warm_start.config import WarmStartConfig
    from ppo_affine.warm_start.expert_play import OpponentSetup, generate, plan_jobs

    settings = WarmStartConfig.from_options(games=args.games, episodes=str(args.episodes), experts=args.expert,
                                            reason="*", opponent=args.opponent)
    jobs = plan_jobs(settings, seed=args.seed, setup=OpponentSetup())
    generate(jobs, settings.workers, path)


def train_once(args: argparse.Namespace, data: Path, trees: bool) -> dict:
    """One SFT pass over the records at `data` (SmolLM2 by the preset), trees on or off; what it measured."""
    import torch

    from ppo_affine.batching import build_sequences
    from ppo_affine.config import load_config
    from ppo_affine.experience import unique_tokens
    from ppo_affine.generation import eos_token_ids
    from ppo_affine.model_files import pick_device
    from ppo_affine.policy import load_policy
    from ppo_affine.prompts import PromptBuilder
    from ppo_affine.warm_start.sft import conversations_to_episodes, train_sft

    config = load_config(presets=[args.preset], overrides=args.set)
    cfg = config.train
    torch.manual_seed(cfg.run.seed)
    policy = load_policy(cfg.model, cfg.lora, pick_device(cfg.run.device))
    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    builder = PromptBuilder(policy.tokenizer, cfg.generation.max_prompt_tokens, cfg.model.chat_template_kwargs)
    episodes = conversations_to_episodes(records, builder, cfg.generation.context_strategy,
                                         eos_token_ids(policy.tokenizer, policy.model.generation_config))
    sequences = build_sequences(episodes)
    started = time.perf_counter()
    history = train_sft(policy, sequences, epochs=1, learning_rate=2e-4, batch_size=args.batch_size,
                        token_budget=cfg.ppo.micro_batch_tokens, seed=cfg.run.seed, trees="always" if trees else "off")
    seconds = time.perf_counter() - started
    return {
        "mode": "tree" if trees else "per-turn", "conversations": len(episodes), "sequences": len(sequences),
        "reply_tokens": sum(s.response_len for s in sequences), "unique_tokens": unique_tokens(sequences),
        "tokens_processed": history[0]["tokens_processed"], "sft_seconds": round(seconds, 1),
        "nll": round(history[0]["loss"], 4), "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        * 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--games", default="liars_dice")
    parser.add_argument("--expert", default="liars_dice=count_bids", help="GAME=KIND, as sft_warmstart.py --expert")
    parser.add_argument("--opponent", default="random")
    parser.add_argument("--episodes", type=int, default=24, help="expert games per game")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--set", action="append", default=[], help="config overrides")
    parser.add_argument("--data", type=Path, help="expert records to reuse (JSONL); default: play them now")
    parser.add_argument("--one", choices=["tree", "per-turn"], help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.one:
        print(json.dumps(train_once(args, args.data, trees=args.one == "tree")))
        return
    data = args.data
    if data is None:
        data = Path(tempfile.mkdtemp(prefix="sft-speed-")) / "sft_data.jsonl"
        expert_records(args, data)
    results = []
    for mode in ("per-turn", "tree"):
        command = [sys.executable, "-m", "bench.sft_speed", "--one", mode, "--data", str(data), "--preset",
                   args.preset, "--batch-size", str(args.batch_size), *[a for s in args.set for a in ("--set", s)]]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    per_turn, tree = results
    print(json.dumps({"data": str(data), "modes": results,
                      "sft_speedup": round(per_turn["sft_seconds"] / tree["sft_seconds"], 2),
                      "tree_processed_over_unique": round(tree["tokens_processed"] / tree["unique_tokens"], 3),
                      "per_turn_processed_over_unique": round(per_turn["tokens_processed"] / per_turn["unique_tokens"],
                                                              3)}, indent=1))


if __name__ == "__main__":
    main()
