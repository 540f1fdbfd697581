"""Warm start from expert play: expert episodes in the env's evaluate() conversation, then supervised
fine-tuning of the LoRA adapter on the expert's replies, written as a checkpoint PPO starts from.

1. Generate: for every game, `--episodes` expert episodes against the env's opponent, both seats, on every core
   (`sft_data.jsonl`); `--explore`, `--openings` and `--relabel FILE` (DAgger data: a model's games with the
   expert answering at every turn) add to them, and `--trace N` trace tasks answered by the interpreter.
2. Train: the mean negative log-likelihood of the expert's replies, tokenised as a rollout builds them.
3. Save `checkpoints/checkpoint-<optimizer steps>`; `--dagger-rounds N` then lets the newest adapter play, the
   experts relabel its games, and SFT go on, N times.

The engine is `ppo_affine/warm_start/` (its docstring explains each step); every option is a field of
`WarmStartConfig` (ppo_affine/warm_start/config.py) with its default and check. docs/warm_start.md: what each
option measured.

Run:  python sft_warmstart.py --preset cpu --games leduc_poker,goofspiel --episodes 200
      python sft_warmstart.py --preset cpu --preset trace --games '' --trace 400 --trace-levels 0,1
      python train_ppo.py --preset cpu --preset warm_start --init-adapter runs/sft-warmstart/checkpoints/checkpoint-50
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Literal, get_args, get_origin

from ppo_affine.config import ConfigError, EnvSpec
from ppo_affine.run_log import console, report_failure, setup_logging
from ppo_affine.warm_start.config import WarmStartConfig, game_count, option_of, option_text
from ppo_affine.warm_start.run import load_inputs, run_warm_start
from utils import add_config_arguments, config_from_arguments, program_parser


def add_option(parser: argparse.ArgumentParser, field: str, **settings) -> None:
    """The option of a WarmStartConfig field, with the model's description as its help and its default as text."""
    info = WarmStartConfig.model_fields[field]
    default = info.get_default(call_default_factory=True)
    if settings.get("action") not in ("append", "store_true"):  # those keep the model's list / bool
        default = None if default is None else option_text(default)
    if get_origin(info.annotation) is Literal:
        settings.setdefault("choices", get_args(info.annotation))
    parser.add_argument(option_of(field), dest=field, **{"default": default, "help": info.description, **settings})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ppo_affine.experts import CHOICES

    parser = program_parser(__doc__)
    add_option(parser, "games")
    add_option(parser, "episodes")
    add_option(parser, "config_ids")
    add_option(parser, "opponent")
    add_option(parser, "opponent_simulations", type=int)
    add_option(parser, "expert_budget", type=int)
    add_option(parser, "experts", metavar="GAME=KIND,...",
               help=WarmStartConfig.model_fields["experts"].description + ": "
               + "; ".join(f"{game}: {', '.join(kinds)}" for game, kinds in CHOICES.items()))
    add_option(parser, "cfr_iterations", type=int)
    add_option(parser, "reason", nargs="?", const="*", metavar="GAMES")
    add_option(parser, "explore", type=float, metavar="P")
    add_option(parser, "openings", metavar="N")
    add_option(parser, "trace", type=int, metavar="N")
    add_option(parser, "trace_levels", metavar="LEVELS")
    add_option(parser, "data", type=Path)
    add_option(parser, "relabel", action="append", metavar="FILE[:MODEL]")
    add_option(parser, "relabel_missed_only", action="store_true")
    add_option(parser, "dagger_rounds", type=int, metavar="N")
    add_option(parser, "dagger_episodes", metavar="N")
    add_option(parser, "dagger_data", type=Path, metavar="FILE")
    add_option(parser, "dagger_aggregate")
    add_option(parser, "init_adapter", type=Path, metavar="CHECKPOINT")
    add_option(parser, "workers", type=int)
    add_option(parser, "epochs", type=int)
    add_option(parser, "learning_rate", type=float)
    add_option(parser, "batch_size", type=int)
    add_option(parser, "output_dir", type=Path)
    add_config_arguments(parser, set_example="generation.context_strategy=full")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        config = config_from_arguments(args)
        settings = WarmStartConfig.from_options(**{name: getattr(args, name) for name in WarmStartConfig.model_fields})
        inputs = load_inputs(settings)
        checkpoint = run_warm_start(settings, config, inputs, functools.partial(play_student, args, settings))
    except ConfigError as exc:
        return report_failure("Configuration error", exc, 2)
    # PPO goes on against the opponent the experts met: trained against random, a policy loses to MCTS
    versus = " --curriculum-config config/curriculum_vs_mcts.json" if settings.opponent == "mcts" else ""
    console.print(f"saved {checkpoint}\ncontinue with PPO: python train_ppo.py "
                  f"{' '.join('--preset ' + p for p in [*args.preset, 'warm_start'])}{versus} "
                  f"--init-adapter {checkpoint}", highlight=False, soft_wrap=True)
    return 0


def play_student(args: argparse.Namespace, settings: WarmStartConfig, checkpoint: Path, seed: int,
                 simulations: int | dict[str, int] | None, played_path: Path) -> EnvSpec:
    """A DAgger round's student games (`dagger.StudentPlay`), played by evaluate.py as it evaluates: greedy, both
    seats, the same --set items."""
    import asyncio

    import evaluate
    from ppo_affine.policy import adapter_folder

    play_config = config_from_arguments(args, defaults=evaluate.VALIDATOR_SETTINGS, flags=["generation.temperature=0"])
    env_name, env_spec = evaluate.eval_env_specs(play_config, {"openspiel"})["openspiel"]
    if simulations is not None:  # the opponent's budget the relabelling replays with
        env_spec = env_spec.model_copy(update={"mcts_simulations": simulations})
    # the relabelling replays these games: it reads the opponent's moves their play recorded
    env_spec = evaluate.shared_opponent_moves(env_spec, played_path.parent / "opponent-moves.sqlite")
    tasks = [task for game in settings.games for task in evaluate.game_tasks(
        game, game_count(settings.dagger_episodes, game), seed, settings.opponent, env_name)]
    try:
        asyncio.run(evaluate.evaluate(play_config, tasks, {"openspiel": (env_name, env_spec)},
                                      adapter_folder(checkpoint), False, played_path))
    except evaluate.VLLMError as exc:  # the student plays where generation.backend says
        raise ConfigError(f"--dagger-rounds: {exc}") from None
    return env_spec


if __name__ == "__main__":
    sys.exit(main())
