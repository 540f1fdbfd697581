"""One real training step per setting: how many tokens go through the model, how fast the rollout
runs against plain batched `generate`, how long the step takes and how much memory it peaks at.

Each setting runs in its own process (so peak memory is that setting's) through the trainer's own
phases (sample -> rollout -> score/advantages/update), on the configured device.

    python -m bench.step_speed                       # cpu preset, SmolLM2-135M, 3 settings, a table
    python -m bench.step_speed --json --episodes 8 --set run.device=cuda

Columns: tokens_processed = tokens through the model in one scoring pass over the step's batch
(padding included, a shared prefix counted once); unique_tokens = the sum over episodes of their
packed length; per_turn_tokens = what one sample per turn (each prompt repeating the history) would
process instead. `validator/group` is the validator profile's step (leduc_poker + liars_dice against
MCTS, groups of 4 episodes of one task and seed); `.../whole-rows` is the same step with every row
run whole, so the pair measures prefix sharing side by side. `validator/exact-search` and
`validator/fast-search` play leduc_poker + liars_dice against the MCTS opponent at the validators'
budgets, with the exact Python search in the trainer's process and with the fast C++ search on worker
processes; `opponent_seconds` is the opponents' own move time summed over the step's episodes and
`opponent_share_of_step` that over the step's wall time. On a GPU, `gpu_busy_rollout` and `gpu_busy_update` are
nvidia-smi's busy readings during each phase (bench/gpu_busy.py):

    python -m bench.step_speed --settings validator/exact-search,validator/fast-search

The `.../reason` settings play replies that reason first, '<think>...</think>ID', which the conversation
shows stripped from the next turn on, so every turn after the first is a sequence of its own: scripted
replies (a legal action ID after a reason of a set number of words, the same episodes every run, the model's
own replies would need a reasoning SFT first), scored and trained as one prefix tree per episode
(`ppo.tree_scoring: auto`: where they pay) and, in the `.../per-turn` twin, each sequence whole.
goofspiel's reasons are as long as its teacher's (about 14 tokens a reply), liars_dice's as the counting reasons; the validator pair is the
validator profile's step with those counting replies:

    python -m bench.step_speed --settings goofspiel/reason,goofspiel/reason/per-turn --max-new-tokens 40
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_busy import GpuBusy
from bench.rollout_speed import plain_generate
from ppo_affine.generation import Generation

# name -> (games, opponent, context strategy, extra overrides, share prefixes)
GROUPS = ["ppo.advantage=group", "ppo.group_size=4", "ppo.micro_batch_tokens=4096",
          'env.envs.openspiel.mcts_simulations={"liars_dice": 300}']
REASONED = ["goofspiel/reason", "liars_dice/reason", "validator/reason"]
REASON_WORDS = {"goofspiel": 12, "leduc_poker": 12, "liars_dice": 40}  # of the scripted replies' reasons
SETTINGS = {
    "goofspiel/reason": (["goofspiel"], "random", "full", [], True),
    "goofspiel/reason/per-turn": (["goofspiel"], "random", "full", ["ppo.tree_scoring=off"], True),
    "liars_dice/reason": (["liars_dice"], "random", "full", [], True),
    "liars_dice/reason/per-turn": (["liars_dice"], "random", "full", ["ppo.tree_scoring=off"], True),
    "validator/reason": (["leduc_poker", "liars_dice"], "mcts", "full", GROUPS, True),
    "validator/reason/per-turn": (["leduc_poker", "liars_dice"], "mcts", "full", [*GROUPS, "ppo.tree_scoring=off"],
                                  True),
    "goofspiel/full": (["goofspiel"], "random", "full", [], True),
    "goofspiel/last": (["goofspiel"], "random", "last", [], True),
    "leduc_poker/full": (["leduc_poker"], "random", "full", [], True),
    "validator/group": (["leduc_poker", "liars_dice"], "mcts", "full", GROUPS, True),
    "validator/group/whole-rows": (["leduc_poker", "liars_dice"], "mcts", "full", GROUPS, False),
    # the MCTS opponent at the validators' budgets: the exact Python search in this process, then the fast one
    # on worker processes; perf/opponent_seconds is the searches' own time over the step's episodes
    "validator/exact-search": (["leduc_poker", "liars_dice"], "mcts", "full",
                               ["env.envs.openspiel.opponent_search=exact", "env.envs.openspiel.workers=0"], True),
    "validator/fast-search": (["leduc_poker", "liars_dice"], "mcts", "full",
                              ["env.envs.openspiel.opponent_search=fast", "env.envs.openspiel.workers=auto"], True),
}


def plain_generate_rate(policy, prompts: list[list[int]], batch_size: int, max_new_tokens: int, eos_ids) -> float:
    """Generated tokens/s of plain left-padded batched `generate` over `prompts`, `batch_size` at a time."""
    generated, seconds = 0, 0.0
    for first in range(0, len(prompts), batch_size):
        started = time.perf_counter()
        generated += plain_generate(policy, prompts[first:first + batch_size], max_new_tokens, eos_ids)
        seconds += time.perf_counter() - started
    return generated / seconds


class ReasonedReplies:
    """The rollout's generator for the `reason` settings: '<think>' + a reason of the game's REASON_WORDS words +
    '</think>' + a legal action ID (chosen by the request's seed) + EOS, at once, for any prompt."""

    def __init__(self, tokenizer, eos_ids: set[int], words: int):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.reason = " ".join(["the", "opponent", "bid", "high", "so", "my", "card", "keeps", "the", "lead"] * 8)
        self.reason = " ".join(self.reason.split()[:words])

    async def generate(self, prompt_ids: list[int], order_key: int, seed: int) -> Generation:
        from ppo_affine.testing.scripted import scripted_reply

        move = scripted_reply(self.tokenizer, prompt_ids, seed, min(self.eos_ids))
        reason = self.tokenizer.encode(f"<think>{self.reason}</think>", add_special_tokens=False)
        return Generation(reason + move)

    async def close(self) -> None:
        pass


def run_setting(name: str, args: argparse.Namespace) -> dict:
    import train_ppo
    from ppo_affine import prefixes
    from ppo_affine.batching import build_sequences, plan_micro_batches, scoring_sequences
    from ppo_affine.run_log import opponent_seconds
    from ppo_affine.config import load_config

    games, opponent, strategy, extra, share = SETTINGS[name]
    if not share:  # every row through the model whole: the same step as before prefixes were shared
        prefixes.MIN_SHARED_PREFIX = 10**9
    stages = json.dumps([{"name": "s", "opponent": opponent, "min_episodes": 10**6,
                          "tasks": [{"env": "openspiel", "games": games, "config_ids": args.config_ids}]}])
    overrides = [f"curriculum.stages={stages}", f"generation.context_strategy={strategy}", *extra,
                 f"ppo.batch_size={args.episodes}", f"generation.max_concurrent_episodes={args.episodes}",
                 f"generation.max_new_tokens={args.max_new_tokens}", "generation.max_prompt_tokens=4096",
                 "run.max_steps=1", "run.name=step-speed", *args.set]
    config = load_config(presets=[args.preset], overrides=overrides)
    trainer = train_ppo.Trainer(config, Path(tempfile.mkdtemp(prefix="step-speed-")), resume_from=None)
    policy = trainer.policy
    reasoned = "/reason" in name
    if reasoned:  # one game per setting, or the validator pair: the longest reasons of its games
        words = max(REASON_WORDS[game] for game in games)
        trainer.generator = trainer.runner.generator = ReasonedReplies(policy.tokenizer, trainer.generator.eos_ids,
                                                                       words)

    busy = {"rollout": GpuBusy(), "update": GpuBusy()}  # nvidia-smi's readings, where there is one

    async def one_step():
        warm = trainer.policy.tokenizer.eos_token_id
        plain_generate_rate(policy, [[warm] * 8], 1, 2, {warm})  # first calls pay one-off costs
        started = time.perf_counter()
        tasks, group_ids = trainer.sample()
        with busy["rollout"]:
            episodes = await trainer.rollout(tasks, trainer.step)
        rollout_seconds = time.perf_counter() - started
        usable, usable_groups = trainer.usable(episodes, group_ids)
        with busy["update"]:
            metrics = trainer.learn_with_oom_retry(usable, usable_groups)
        step_seconds = time.perf_counter() - started
        await trainer.close()
        return episodes, usable, metrics, rollout_seconds, step_seconds

    if policy.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    episodes, usable, metrics, rollout_seconds, step_seconds = asyncio.run(one_step())
    peak = (torch.cuda.max_memory_allocated() if policy.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    generated = sum(e.generated_tokens for e in episodes)
    searching = opponent_seconds(episodes)  # perf/opponent_seconds of this step
    prompts = [e.prompt_ids(turn) for e in episodes for turn in e.turns]
    ceiling = (float("nan") if reasoned  # scripted replies: no rollout speed to compare
               else plain_generate_rate(policy, prompts, args.episodes, args.max_new_tokens, trainer.generator.eos_ids))
    sequences = build_sequences(usable)
    budget = trainer.micro_batch_tokens
    scored = scoring_sequences(sequences, budget, config.train.ppo.tree_scoring)
    largest = max((len(rows) * max(len(scored[i].input_ids) for i in rows)
                   for rows in plan_micro_batches([s.input_ids for s in scored], budget)), default=0)
    per_turn = sum(turn.start + len(turn.response_ids) for e in usable for turn in e.turns if turn.response_ids)
    return {
        "setting": name, "device": str(policy.device), "episodes": len(episodes), "config_ids": args.config_ids,
        "turns": sum(len(e.turns) for e in episodes), "sequences": len(sequences),
        "tokens_processed": int(metrics["perf/tokens_processed"]), "unique_tokens": int(metrics["perf/unique_tokens"]),
        "per_turn_tokens": per_turn,
        "processed_over_unique": round(metrics["perf/tokens_processed"] / metrics["perf/unique_tokens"], 3),
        "rollout_tokens_per_s": round(generated / rollout_seconds, 2),
        "generate_ceiling_tokens_per_s": round(ceiling, 2),
        "rollout_over_ceiling": round(generated / rollout_seconds / ceiling, 3),
        "prefill_fraction": round(trainer.generator.prefilled_tokens / max(1, trainer.generator.prompt_tokens), 3)
        if hasattr(trainer.generator, "prefilled_tokens") else None,
        "rollout_seconds": round(rollout_seconds, 2), "step_seconds": round(step_seconds, 2),
        "update_seconds": round(metrics["perf/update_seconds"], 2),
        # of update_seconds (the whole learn phase): scoring the batch, and the PPO epochs with the rest
        "score_seconds": round(metrics["perf/score_seconds"], 2),
        "ppo_seconds": round(metrics["perf/update_seconds"] - metrics["perf/score_seconds"], 2),
        "reply_tokens": sum(len(turn.response_ids) for e in usable for turn in e.turns),
        "peak_memory_bytes": int(peak),
        # rows x width of the largest micro-batch (what activation memory grows with; RSS on CPU is noisy)
        "largest_micro_batch_tokens": largest,
        "opponent_seconds": round(searching, 2),
        "opponent_share_of_step": round(searching / step_seconds, 3),
        "gpu_busy_rollout": busy["rollout"].summary(), "gpu_busy_update": busy["update"].summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {list(SETTINGS)}")
    parser.add_argument("--episodes", type=int, default=8, help="episodes per step (= generation batch)")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--config-ids", default="0",
                        help="the games' config ids the episodes draw from (goofspiel's 0-4: 8 to 16 cards, as the "
                             "validators draw them; 0 alone: 8 cards)")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one setting in this process
    args = parser.parse_args()
    try:
        args.config_ids = [int(c) for c in args.config_ids.split(",")]
    except ValueError:
        parser.error(f"--config-ids: expected comma-separated integers, got {args.config_ids!r}")
    if args.one:
        print(json.dumps(run_setting(args.one, args)))
        return
    results = []
    for name in args.settings.split(","):
        command = [sys.executable, "-m", "bench.step_speed", "--one", name, "--preset", args.preset,
                   "--episodes", str(args.episodes), "--max-new-tokens", str(args.max_new_tokens),
                   "--config-ids", ",".join(map(str, args.config_ids)), *[a for s in args.set for a in ("--set", s)]]
        done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if done.returncode != 0:
            sys.exit(f"setting {name} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps({"settings": results}, indent=1))
        return
    columns = ["setting", "tokens_processed", "unique_tokens", "per_turn_tokens", "processed_over_unique",
               "rollout_tokens_per_s", "generate_ceiling_tokens_per_s", "rollout_over_ceiling", "step_seconds",
               "opponent_seconds", "opponent_share_of_step", "peak_memory_bytes"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for result in results:
        print("| " + " | ".join(str(result[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
