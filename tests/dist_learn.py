"""One learn phase (score -> advantages -> update) of the real Trainer on hand-built episodes, in one
process or as one rank of several: tests/test_distributed.py compares the weights both end with.

Run:  python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_learn.py MODEL_DIR OUT_DIR
      (each rank writes OUT_DIR/<case>-rank<r>.pt: adapter and value-head weights and the step's metrics)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ppo_affine.envs.tasks import Task
from ppo_affine.distributed import ONE_PROCESS, Ranks
from ppo_affine.rollout import Episode, Turn

LEARNING_RATE = 1e-2  # the adapter's and the value head's
STAGES = json.dumps([{"name": "s", "opponent": "random", "tasks": [{"env": "openspiel", "games": ["leduc_poker"]}]}])
# name -> (config overrides, scores of the step's usable episodes, group ids)
CASES = {
    # turn credit, whitened over the batch, two minibatches drawn over the batch, per-game loss weights,
    # entropy bonus, and the update-signal check gathering every rank's replies
    "gae": (["ppo.num_minibatches=2", "ppo.loss_weighting=game", "ppo.entropy_coef=0.01",
             "logging.signal_check_every=1"], [1.0, 0.0, 0.75, 0.25], None),
    "group": (["ppo.advantage=group", "ppo.group_size=2"], [1.0, 0.0, 0.2, 0.9], [0, 0, 1, 1]),
    "critic_warmup": (["value_head.warmup_steps=1", "run.max_steps=2"], [1.0, 0.0, 0.5, 0.0], None),
    # three usable episodes: rank 0 trains one, rank 1 two
    "uneven": (["ppo.credit=token"], [1.0, 0.0, 0.5], None),
    # one usable episode: rank 0 has nothing to train and still takes part in every exchange
    "one_episode": ([], [1.0], None),
    # each first reply reasons and the second turn's sequence shows it stripped: scored as one tree per episode,
    # and (the same episodes) each sequence whole, which test_distributed.py compares the tree runs with. One
    # minibatch: minibatches are drawn over sequences, and a tree is one where the per-turn path has two
    "stripped": (["ppo.entropy_coef=0.01", "logging.signal_check_every=1", "ppo.tree_scoring=always"],
                 [1.0, 0.0, 0.75, 0.25], None),
    "stripped_per_turn": (["ppo.entropy_coef=0.01", "logging.signal_check_every=1", "ppo.tree_scoring=off"],
                          [1.0, 0.0, 0.75, 0.25], None),
}


def hand_built_episodes(tokenizer, scores: list[float], stripped: bool = False) -> list[Episode]:
    """Two-turn games held in one sequence each (reply, glue, reply), a different pair of replies per episode.
    `stripped`: the first reply reasons first, and the second turn is a sequence of its own that shows it without."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = encode("<|im_start|>user\nplay<|im_end|>\n<|im_start|>assistant\n")
    glue = [tokenizer.eos_token_id] + encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    words = ["Raise", "Call", "Fold", "Liar", "bid", "card", "dice", "game"]
    episodes = []
    for i, score in enumerate(scores):
        first, second = encode(f"{words[i]} {i}"), encode(f"{words[(i + 3) % 8]} {2 * i} and more")
        sequence = prompt + first + glue + second + [tokenizer.eos_token_id]
        if stripped:
            reasoned = encode(f"<think>{words[(i + 5) % 8]} {i}</think>") + first
            turns = [Turn(reasoned + [tokenizer.eos_token_id], "", None, sequence=0, start=len(prompt), reward=0.1 * i),
                     Turn(second + [tokenizer.eos_token_id], "", None, sequence=1, start=len(prompt + first + glue))]
            episodes.append(Episode(task=Task("openspiel", i, i, "random", "s", False), env_kind="openspiel",
                                    done=True, turns=turns, sequences=[prompt + reasoned + [tokenizer.eos_token_id],
                                                                       sequence], score=score,
                                    game_name="leduc_poker" if i % 3 else "liars_dice"))
            continue
        turns = [Turn(first, "", None, sequence=0, start=len(prompt), reward=0.1 * i, parse_error=i == 2),
                 Turn(second + [tokenizer.eos_token_id], "", None, sequence=0, start=len(prompt + first + glue))]
        episodes.append(Episode(task=Task("openspiel", i, i, "random", "s", False), env_kind="openspiel", done=True,
                                turns=turns, sequences=[sequence], score=score,
                                game_name="leduc_poker" if i % 3 else "liars_dice"))
    return episodes


def learn_once(model_dir: Path, run_dir: Path, case: str, ranks: Ranks = ONE_PROCESS) -> dict:
    """A fresh Trainer's first learn phase on the case's episodes; its weights and metrics afterwards."""
    import train_ppo
    from ppo_affine.config import load_config

    sets, scores, group_ids = CASES[case]
    overrides = [f"model.name_or_path={model_dir}", "model.use_4bit=false", "model.dtype=float32",
                 "model.gradient_checkpointing=false", "run.device=cpu", "generation.backend=local",
                 "ppo.batch_size=4", "ppo.ppo_epochs=2", f"ppo.learning_rate={LEARNING_RATE}",
                 "ppo.micro_batch_tokens=64", f"value_head.learning_rate={LEARNING_RATE}", "ppo.kl_stop=null",
                 f"curriculum.stages={STAGES}", *sets]
    config = load_config(overrides=overrides)
    torch.manual_seed(0)
    trainer = train_ppo.Trainer(config, run_dir, resume_from=None, ranks=ranks)
    episodes = hand_built_episodes(trainer.policy.tokenizer, scores, stripped=case.startswith("stripped"))
    metrics = trainer.learn_with_oom_retry(episodes, group_ids)
    trained = {name: parameter for name, parameter in trainer.policy.named_parameters() if parameter.requires_grad}
    weights = {name: parameter.detach().clone() for name, parameter in trained.items()}
    # Adam's running mean of each weight's gradient, and how many steps it took: test_distributed.py tells the
    # weights whose gradient is a sum that cancels to rounding noise from the rest with them
    state = trainer.optimizer.state
    moments = {name: state[parameter]["exp_avg"].detach().clone() if "exp_avg" in state[parameter]
               else torch.zeros_like(parameter) for name, parameter in trained.items()}  # no state: never a gradient
    steps = max(int(state[parameter].get("step", 0)) for parameter in trained.values())
    return {"weights": weights, "moments": moments, "optimizer_steps": steps, "metrics": metrics,
            "kl_coef": trainer.kl_ctl.value}


if __name__ == "__main__":
    model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    ranks = Ranks.from_environment()
    ranks.start(torch.device("cpu"), timeout_minutes=5)
    try:
        for name in CASES:
            result = learn_once(model_dir, out_dir / f"run-{name}-{ranks.rank}", name, ranks)
            torch.save(result, out_dir / f"{name}-rank{ranks.rank}.pt")
    finally:
        ranks.close()
