"""Evaluate a LoRA checkpoint (or the base model) on Affine game and trace tasks, the way validators do.

Validator settings by default: the MCTS opponent, greedy decoding (temperature 0), the `evaluate`
observation format with the whole conversation as context, and per task the seed
`validator_seed(env, task_id)` (ppo_affine/envs/tasks.py), whose parity picks the model's seat. The
episodes are played by the trainer's own RolloutRunner and generators (local or vLLM), so the
model is evaluated on exactly the prompts it trains on. `report.py` does the statistics.

Tasks: `--games a,b --episodes N` plays N task ids per game (config ids 0, 1, 2, ... over the
loadable variants; `trace` cycles the three difficulty levels). `--seed S` replaces the validator
seeds with seeds derived from S; the episodes then come in pairs, one config id with an even then
an odd seed, so every variant is played from both seats. `--task-ids 5,0-3,trace:10-12` plays each
listed id once (ranges inclusive).

`--env-evaluate URL|IMAGE` scores through the env's own evaluate() instead (env_evaluate.py): the env
plays each game against the vLLM server with the validators' prompt text, parser and timeouts.

With `--compare-base` the base replays the MCTS opponent's moves that the adapter's games recorded
wherever its game repeats one (ppo_affine/envs/opponent_moves.py: the same moves, searched only where
the games differ). `--set env.envs.openspiel.opponent_moves=FILE` keeps that record across runs.

`--distill-cells URL|DIR` scores DISTILL-V2 instead of playing games (ppo_affine/distill/): the published
teacher cells under a base URL (the public bucket's address is in docs/evaluate.md) or a local folder, each
rollout rendered and teacher-forced as the env does, by the trainer's model in process (generation.backend=local)
or through the vLLM server; the cell scores, their mean and its 95 % interval go to summary.json.

Run:  python evaluate.py --preset cpu --base-only --games leduc_poker,liars_dice --episodes 10 --opponent random
      python evaluate.py --checkpoint runs/r/checkpoints/checkpoint-500 --games goofspiel,leduc_poker \\
          --episodes 50 --compare-base --output-dir eval/r-500
      python evaluate.py --preset cpu --checkpoint CKPT --games leduc_poker --env-evaluate http://127.0.0.1:8765
      python evaluate.py --checkpoint CKPT --compare-base --distill-cells DISTILL_V2_URL --distill-limit 100 \\
          --output-dir eval/distill
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from ppo_affine import env_evaluate
from ppo_affine.distill.cells import DEFAULT_CACHE_DIR
from ppo_affine.distill.render import MAX_SEQ_LEN
from ppo_affine import report
from ppo_affine.envs.tasks import Task
from ppo_affine.envs.factory import make_env
from ppo_affine.envs.games import is_playable
from ppo_affine.envs.tasks import (AVAILABLE_GAMES, game_name_of, game_task_id, paired_seed,
                                   trace_level_range, validator_seed)
from ppo_affine.model_files import served_folder
from ppo_affine.adapter_probe import serve_evaluated_adapter
from ppo_affine.model_files import load_adapter_model
from ppo_affine.generation import VLLMError, VLLMGenerator, eos_token_ids
from ppo_affine.local_generation import LocalGenerator
from ppo_affine.endpoint import endpoint_for
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import Episode, RolloutRunner
from ppo_affine.run_log import console, report_failure, rollout_progress, setup_logging
from ppo_affine.config import Config, ConfigError, EnvSpec
from ppo_affine.file_writes import WriteFailed, probe_writable, writing
from ppo_affine.vllm_server import VLLMServerError, owned_server
from utils import add_config_arguments, config_for_adapter, program_parser

log = logging.getLogger("evaluate")

VALIDATOR_ENV_NAME = {"openspiel": "game", "trace": "trace"}  # the env names validator seeds are hashed with
TRACE = report.TRACE
# `--games trace` plays the levels that resemble the validators' dataset; the starter level 0 is for training
EVALUATED_TRACE_LEVELS = (1, 2, 3)


# ---------------------------------------------------------------------- which tasks to play
def _playable_config_ids(game: str):
    return (c for c in itertools.count() if is_playable(game_task_id(game, c)))


def game_tasks(game: str, episodes: int, seed: int | None, opponent: str, env_name: str) -> list[Task]:
    """`episodes` tasks of one game (or `trace`), spread over variants / difficulty levels."""
    tasks = []
    if game == TRACE:
        for i in range(episodes):
            low, _ = trace_level_range(EVALUATED_TRACE_LEVELS[i % len(EVALUATED_TRACE_LEVELS)])
            task_id = low + i // len(EVALUATED_TRACE_LEVELS)
            task_seed = validator_seed("trace", task_id) if seed is None else paired_seed(seed, TRACE, i)
            tasks.append(Task(env=env_name, task_id=task_id, seed=task_seed, opponent=None, stage="eval",
                              replay=False))
        return tasks
    # validator seeds are a function of the task id: one task id per episode; derived seeds: two
    per_config = 1 if seed is None else 2
    config_ids = list(itertools.islice(_playable_config_ids(game), (episodes + per_config - 1) // per_config))
    for i in range(episodes):
        task_id = game_task_id(game, config_ids[i // per_config])
        task_seed = validator_seed("game", task_id) if seed is None else paired_seed(seed, game, i)
        tasks.append(Task(env=env_name, task_id=task_id, seed=task_seed, opponent=opponent, stage="eval",
                          replay=False))
    return tasks


def parse_task_ids(text: str) -> list[tuple[str, int]]:
    """'5,0-3,trace:10-12' -> [(kind, task_id), ...]; ranges are inclusive."""
    parsed = []
    for item in (part.strip() for part in text.split(",")):
        kind, _, ids = item.rpartition(":")
        kind = kind or "openspiel"
        low, dash, high = ids.partition("-")
        if kind not in ("openspiel", "trace") or not low.isdigit() or (dash and not high.isdigit()):
            raise ConfigError(f"--task-ids: cannot read {item!r}. Expected comma-separated ids or inclusive "
                              "ranges, game tasks bare and trace tasks prefixed, e.g. '5,0-3,trace:10-12'.")
        first, last = int(low), int(high or low)
        if last < first:
            raise ConfigError(f"--task-ids: range {item!r} ends before it starts.")
        parsed += [(kind, task_id) for task_id in range(first, last + 1)]
    return parsed


def listed_tasks(ids: list[tuple[str, int]], seed: int | None, opponent: str, env_names: dict[str, str]
                 ) -> list[Task]:
    """One task per listed id; with --seed the seed parity alternates along each kind's list."""
    tasks, position = [], {"openspiel": 0, "trace": 0}
    for kind, task_id in ids:
        if kind == "openspiel" and not is_playable(task_id):
            raise ConfigError(f"--task-ids: task {task_id} ({game_name_of(task_id)}) is a variant open_spiel "
                              "cannot load; pick another config id.")
        task_seed = (validator_seed(VALIDATOR_ENV_NAME[kind], task_id) if seed is None
                     else paired_seed(seed, f"{kind}:{task_id}", position[kind]))
        position[kind] += 1
        tasks.append(Task(env=env_names[kind], task_id=task_id, seed=task_seed,
                          opponent=opponent if kind == "openspiel" else None, stage="eval", replay=False))
    return tasks


def eval_env_specs(config: Config, kinds: set[str]) -> dict[str, tuple[str, EnvSpec]]:
    """kind -> (env name, spec): the config's first env of each kind (a local default if none),
    local game envs switched to the validators' `evaluate` format."""
    chosen = {}
    for kind in sorted(kinds):
        name, spec = next(((n, s) for n, s in config.env.envs.items() if s.kind == kind), (kind, EnvSpec(kind=kind)))
        if kind == "openspiel" and spec.mode == "local" and spec.observation_format != "evaluate":
            log.info("env %s: playing the 'evaluate' observation format (validators' format) instead of %r",
                     name, spec.observation_format)
            spec = spec.model_copy(update={"observation_format": "evaluate"})
        if spec.mode != "local":
            log.warning("env %s runs in %s mode: the server decides the observation format and seat rule",
                        name, spec.mode)
        chosen[kind] = (name, spec)
    return chosen


# ---------------------------------------------------------------------- one episode -> one record
def episode_record(episode: Episode, model: str) -> dict[str, Any]:
    """The episodes.jsonl line of one played episode."""
    task = episode.task
    is_trace = episode.env_kind == "trace"
    error = episode.error
    if error is None and episode.cut_off:
        error = f"cut off after {len(episode.turns)} model turns (generation.max_turns)"
    elif error is None and not episode.done:
        error = "episode did not finish"
    if error:
        outcome = "error"
    elif is_trace:
        outcome = "correct" if episode.success else "incorrect"
    else:
        outcome = "win" if episode.score > 0.5 else "draw" if episode.score == 0.5 else "loss"
    return {
        "model": model,
        "env": task.env,
        "game": TRACE if is_trace else game_name_of(task.task_id),
        "task_id": task.task_id,
        "seed": task.seed,
        "opponent": task.opponent,
        "llm_player_id": episode.info.get("llm_player_id"),
        "score": episode.score,
        "success": episode.success,
        "outcome": outcome,
        "turns": len(episode.turns),
        "illegal_moves": episode.illegal_moves,
        # evaluate format: the only turn that both fails to parse and ends the game is the 3rd failure
        "parse_failed_game": bool(not is_trace and episode.done and episode.turns and episode.turns[-1].parse_error),
        "generated_tokens": episode.generated_tokens,
        "error": error,
        "scored_by": "in_process",
        "conversation": episode.messages,
    }


# ---------------------------------------------------------------------- models and generators
def local_policy(config: Config, adapter_dir: Path | None):
    """A Policy for generation: the adapter on the base, or (base only) a fresh LoRA that is switched off."""
    import torch

    from ppo_affine.model_files import load_base_model, load_tokenizer, pick_device
    from ppo_affine.policy import Policy, load_policy

    cfg = config.train
    device = pick_device(cfg.run.device)
    torch.manual_seed(cfg.run.seed)
    if adapter_dir is None:
        return load_policy(cfg.model, cfg.lora, device)
    model = load_adapter_model(load_base_model(cfg.model, device), adapter_dir, cfg.model.name_or_path)
    return Policy(model, load_tokenizer(cfg.model)).eval()


def model_runs(config: Config, adapter_dir: Path | None, compare_base: bool, policy=None
               ) -> tuple[Any, Any, list[tuple[str, Callable[[], contextlib.AbstractAsyncContextManager]]]]:
    """The generator, its tokenizer, and per model label a context in which the generator plays as that model
    (`policy`: one already loaded for the local backend)."""
    cfg = config.train
    gen_cfg = cfg.generation
    if gen_cfg.backend == "local":
        policy = policy or local_policy(config, adapter_dir)
        tokenizer = policy.tokenizer
        generator = LocalGenerator(policy, gen_cfg, seed=cfg.run.seed)

        @contextlib.asynccontextmanager
        async def as_adapter():
            yield

        @contextlib.asynccontextmanager
        async def as_base():
            with policy.base():
                yield
    else:
        from ppo_affine.model_files import load_generation_config, load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
        rank = (json.loads((adapter_dir / "adapter_config.json").read_text())["r"] if adapter_dir else cfg.lora.r)
        api_key = os.environ.get(config.env.vllm_api_key_env) if config.env.vllm_api_key_env else None
        generator = VLLMGenerator(config.env.vllm_urls[0], cfg.model.name_or_path, tokenizer, gen_cfg, rank,
                                  eos_token_ids(tokenizer, load_generation_config(cfg.model)), api_key,
                                  served_from=served_folder(cfg.model))

        @contextlib.asynccontextmanager
        async def as_adapter():
            await serve_evaluated_adapter(config, generator, adapter_dir)  # probed before any episode
            yield

        @contextlib.asynccontextmanager
        async def as_base():
            generator.active_adapter = None  # requests then name the base model
            yield
    if adapter_dir is None:
        return generator, tokenizer, [("base", as_base)]
    return generator, tokenizer, [("adapter", as_adapter)] + ([("base", as_base)] if compare_base else [])


# ---------------------------------------------------------------------- the run
async def evaluate(config: Config, tasks: list[Task], env_specs: dict[str, tuple[str, EnvSpec]],
                   adapter_dir: Path | None, compare_base: bool, episodes_path: Path | None, policy=None
                   ) -> list[dict[str, Any]]:
    """Play every task once per model; records in task order, each also appended to `episodes_path`. `policy`: the
    model already loaded (local backend); envs of kind `evaluate` call an endpoint served from the generator."""
    generator, tokenizer, runs = model_runs(config, adapter_dir, compare_base, policy)
    gen_cfg = config.train.generation
    meets_search = any(task.opponent == "mcts" for task in tasks)
    records: list[dict[str, Any]] = []
    # whatever fails, what was opened closes, last opened first: the episodes file, the envs (whose workers hold
    # the opponent-moves file), that file's scratch folder, the generator
    async with contextlib.AsyncExitStack() as opened:
        opened.push_async_callback(generator.close)
        if len(runs) > 1:  # the models meet the same seeds: the second searches only where its games differ
            scratch = opened.enter_context(tempfile.TemporaryDirectory(prefix="opponent-moves-"))
            env_specs = {kind: (name, shared_opponent_moves(spec, Path(scratch) / "opponent-moves.sqlite"))
                         for kind, (name, spec) in env_specs.items()}
        envs = {}
        for name, spec in env_specs.values():
            envs[name] = (spec.kind, make_env(spec, seed=config.train.run.seed, meets_search=meets_search))
            opened.push_async_callback(envs[name][1].close)
        # the validators' conversation: replies stored as their client returns them, every prompt rendered anew
        prompts = PromptBuilder(tokenizer, gen_cfg.max_prompt_tokens, config.train.model.chat_template_kwargs)
        endpoint = None
        if any(spec.kind == "evaluate" for _, spec in env_specs.values()):
            endpoint = endpoint_for(config, generator, prompts, policy.model.config.model_type if policy else None)
            opened.push_async_callback(endpoint.close)
        runner = RolloutRunner(envs, generator, prompts, gen_cfg, validator_conversation=True, endpoint=endpoint,
                               evaluate_kwargs={name: spec.evaluate_kwargs for name, spec in env_specs.values()})
        sink = opened.enter_context(open(episodes_path, "w")) if episodes_path else None
        if isinstance(generator, VLLMGenerator):
            await generator.check_server()
        for label, playing_as in runs:
            def finished(episode: Episode, label=label) -> None:
                if sink:
                    with writing("the episodes file", episodes_path):
                        sink.write(json.dumps(episode_record(episode, label)) + "\n")
                        sink.flush()
                advance()

            with rollout_progress(len(tasks), f"{label}: episodes") as advance:
                async with playing_as():
                    # step 0 for every model: identical generation seeds, so the runs differ only by the model
                    episodes = await runner.run(tasks, step=0, on_episode_done=finished)
            records += [episode_record(episode, label) for episode in episodes]
    return records


def shared_opponent_moves(spec: EnvSpec, path: Path) -> EnvSpec:
    """`spec` recording and replaying the MCTS opponent's moves in `path`, unless it names its own file."""
    if spec.kind != "openspiel" or spec.mode != "local" or spec.opponent_moves:
        return spec
    return spec.model_copy(update={"opponent_moves": str(path)})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = program_parser(__doc__)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", type=Path,
                       help="checkpoint folder (<run>/checkpoints/checkpoint-N) or adapter folder (this or "
                       "--base-only is required)")
    which.add_argument("--base-only", action="store_true",
                       help="evaluate the base model without an adapter (this or --checkpoint is required)")
    parser.add_argument("--compare-base", action="store_true",
                        help="also play the base model on the same tasks and seeds")
    parser.add_argument("--games", help=f"comma-separated games from {AVAILABLE_GAMES}, or 'trace' (default: none; "
                        "this or --task-ids is required)")
    parser.add_argument("--task-ids", help="comma-separated task ids / inclusive ranges; trace ids as trace:ID "
                        "(default: none; this or --games is required)")
    parser.add_argument("--episodes", type=int, help="episodes per game with --games (default 10)")
    parser.add_argument("--opponent", choices=("mcts", "random"), default="mcts",
                        help="game opponent (validators: mcts)")
    parser.add_argument("--seed", type=int, help="derive seeds from this instead of the validator seeds (default: "
                        "none: the validator seeds)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default 0 = greedy, as validators)")
    parser.add_argument("--max-new-tokens", type=int, help="most tokens of one reply, overriding "
                        "generation.max_new_tokens (default: the checkpoint's, else the config's)")
    parser.add_argument("--context-strategy", choices=("full", "truncated", "last"),
                        help="conversation shown to the model (default full, as validators)")
    parser.add_argument("--output-dir", type=Path, help="write episodes.jsonl and summary.json here, and the log of a "
                        "vLLM server evaluate starts (default: none: the tables are printed, nothing is written)")
    parser.add_argument("--env-evaluate", metavar="URL|IMAGE",
                        help="score through the env's own evaluate() (the validators' call): a running env server's "
                        "URL (e.g. http://127.0.0.1:8765 from `python -m ppo_affine.envs.server --env openspiel`) or an Affine "
                        "image to start in Docker (affinefoundation/game:openspiel); needs a vLLM server "
                        "(env.vllm_url) (default: none: evaluate.py plays the episodes itself)")
    parser.add_argument("--env-llm-url", metavar="URL",
                        help="with --env-evaluate: the vLLM URL the env calls (its base_url); a container cannot reach "
                        "this machine's 127.0.0.1 (default: env.vllm_url)")
    parser.add_argument("--env-timeout", type=float, default=env_evaluate.VALIDATOR_TIMEOUT_S, metavar="SECONDS",
                        help="with --env-evaluate: seconds the env may take per game (default %(default)g, "
                        "the validators')")
    parser.add_argument("--distill-cells", metavar="URL|DIR",
                        help="score DISTILL-V2 on the teacher cells at this base URL (shards cached in "
                        "--distill-cache-dir) or in this local folder, instead of playing games (default: none)")
    parser.add_argument("--distill-limit", type=int, metavar="N",
                        help="with --distill-cells: the first N cells of the manifest (default: all)")
    parser.add_argument("--distill-cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                        help="with --distill-cells URL: where downloaded shards are kept")
    parser.add_argument("--distill-max-seq-len", type=int, default=MAX_SEQ_LEN,
                        help="with --distill-cells: tokens a rendered rollout keeps (head and tail), the env's "
                        "default; a smaller value saves memory but no longer scores as the env does")
    add_config_arguments(parser, set_example="generation.backend=local")
    return parser.parse_args(argv)


def plan(args: argparse.Namespace, config: Config) -> tuple[list[Task], dict[str, tuple[str, EnvSpec]]]:
    """Validate the task options and build the task list and the envs it needs."""
    if not args.games and not args.task_ids:
        raise ConfigError("Nothing to evaluate: pass --games (e.g. --games leduc_poker,liars_dice) "
                          "and/or --task-ids (e.g. --task-ids 200000000-200000009).")
    if args.compare_base and args.base_only:
        raise ConfigError("--compare-base compares an adapter with its base; it needs --checkpoint, not --base-only.")
    if args.task_ids and args.episodes is not None and not args.games:
        raise ConfigError("--episodes applies to --games; --task-ids plays each listed id once "
                          "(list an id twice to play it twice).")
    episodes = 10 if args.episodes is None else args.episodes
    if episodes < 1:
        raise ConfigError(f"--episodes must be at least 1, got {episodes}.")
    if not args.env_evaluate and (args.env_llm_url or args.env_timeout != env_evaluate.VALIDATOR_TIMEOUT_S):
        raise ConfigError("--env-llm-url and --env-timeout apply to --env-evaluate.")
    if args.env_timeout <= 0:
        raise ConfigError(f"--env-timeout must be > 0 seconds, got {args.env_timeout:g}.")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise ConfigError(f"--seed must be in [0, 2**32), got {args.seed}.")
    games = [g.strip() for g in (args.games or "").split(",") if g.strip()]
    unknown = [g for g in games if g not in AVAILABLE_GAMES and g != TRACE]
    if unknown:
        raise ConfigError(f"--games: unknown {unknown}; expected names from {AVAILABLE_GAMES} or 'trace'.")
    listed = parse_task_ids(args.task_ids) if args.task_ids else []
    kinds = {"trace" if g == TRACE else "openspiel" for g in games} | {kind for kind, _ in listed}
    if args.env_evaluate and "trace" in kinds:
        raise ConfigError("--env-evaluate scores game tasks only; leave trace out of --games and --task-ids.")
    env_specs = eval_env_specs(config, kinds)
    names = {kind: name for kind, (name, _) in env_specs.items()}
    tasks = [t for g in games for t in game_tasks(g, episodes, args.seed, args.opponent,
                                                  names["trace" if g == TRACE else "openspiel"])]
    tasks += listed_tasks(listed, args.seed, args.opponent, names)
    return tasks, env_specs


# How validators play, before the user's --set; gradient checkpointing would turn the KV cache off.
VALIDATOR_SETTINGS = ("generation.temperature=0", "generation.context_strategy=full",
                      "model.gradient_checkpointing=false")


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The generation flags given, as config overrides (after --set: a flag wins)."""
    overrides = []
    if args.temperature is not None:
        overrides.append(f"generation.temperature={args.temperature}")
    if args.max_new_tokens is not None:
        overrides.append(f"generation.max_new_tokens={args.max_new_tokens}")
    if args.context_strategy:
        overrides.append(f"generation.context_strategy={args.context_strategy}")
    return overrides


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        # the checkpoint's adapter and configuration are all evaluate reads of it (a bad trainer state only warns)
        config, adapter_dir = config_for_adapter(args, args.checkpoint, defaults=VALIDATOR_SETTINGS,
                                                 flags=flag_overrides(args), adapter_only=True)
        if args.distill_cells:
            return distill_main(args, config, adapter_dir)
        check_no_distill_options(args)
        tasks, env_specs = plan(args, config)
        episodes_path = None
        if args.output_dir:
            probe_writable(args.output_dir, "--output-dir")  # before any model loads
            episodes_path = args.output_dir / "episodes.jsonl"
        with server_log_folder(args.output_dir) as log_dir, owned_server(config, log_dir) as config:
            if args.env_evaluate:
                records, scores_from = asyncio.run(env_evaluate.evaluate_through_env(
                    config, tasks, adapter_dir, args.compare_base, args.env_evaluate, args.env_llm_url,
                    args.env_timeout, episodes_path))
            else:
                records = asyncio.run(evaluate(config, tasks, env_specs, adapter_dir, args.compare_base,
                                               episodes_path))
                scores_from = {"path": "in_process"}
        if args.output_dir:
            with writing("the summary", args.output_dir / "summary.json"):
                (args.output_dir / "summary.json").write_text(json.dumps(summary_document(
                    args, config, records, scores_from), indent=1) + "\n")
    except ConfigError as exc:
        return report_failure("Error", exc, 2)
    except (VLLMError, VLLMServerError, WriteFailed) as exc:
        return report_failure("Stopped", exc, 1)
    print_results(args, records)
    return 0


# ---------------------------------------------------------------------- DISTILL-V2
def check_no_distill_options(args: argparse.Namespace) -> None:
    if (args.distill_limit is not None or args.distill_cache_dir != DEFAULT_CACHE_DIR
            or args.distill_max_seq_len != MAX_SEQ_LEN):
        raise ConfigError("--distill-limit, --distill-cache-dir and --distill-max-seq-len apply to --distill-cells.")


def check_distill_options(args: argparse.Namespace) -> None:
    if args.games or args.task_ids or args.env_evaluate or args.episodes is not None:
        raise ConfigError("--distill-cells scores teacher cells, not games: leave out --games, --task-ids, "
                          "--episodes and --env-evaluate.")
    if args.compare_base and args.base_only:
        raise ConfigError("--compare-base compares an adapter with its base; it needs --checkpoint, not --base-only.")
    if args.distill_limit is not None and args.distill_limit < 1:
        raise ConfigError(f"--distill-limit must be at least 1, got {args.distill_limit}.")
    if args.distill_max_seq_len < 2:
        raise ConfigError(f"--distill-max-seq-len must be at least 2, got {args.distill_max_seq_len}.")


def distill_main(args: argparse.Namespace, config: Config, adapter_dir: Path | None) -> int:
    """--distill-cells: read the cells, score each model on them, print and write the scores."""
    from ppo_affine.distill.cells import read_cells_for

    check_distill_options(args)
    if args.output_dir:
        probe_writable(args.output_dir, "--output-dir")
    cells = read_cells_for("--distill-cells", args.distill_cells, args.distill_cache_dir, limit=args.distill_limit)
    with server_log_folder(args.output_dir) as log_dir, owned_server(config, log_dir) as config:
        scores = asyncio.run(distill_scores(config, cells, adapter_dir, args.compare_base, args.distill_max_seq_len))
    document = {"settings": {"checkpoint": str(args.checkpoint) if args.checkpoint else None,
                             "base_model": config.train.model.name_or_path,
                             "backend": config.train.generation.backend, "distill_cells": args.distill_cells,
                             "distill_limit": args.distill_limit},
        "distill_v2": {label: score.summary() for label, score in scores.items()}}
    if args.output_dir:
        with writing("the summary", args.output_dir / "summary.json"):
            (args.output_dir / "summary.json").write_text(json.dumps(document, indent=1) + "\n")
    for label, score in scores.items():
        interval = f" [{score.ci95[0]:+.3f}, {score.ci95[1]:+.3f}]" if score.ci95 else ""
        console.print(f"DISTILL-V2 {label}: {score.mean:+.3f}{interval} over {len(score.cells)} cells "
                      f"(softmax_advantage; 0 = no preference)", highlight=False)
    if args.output_dir:
        console.print(f"wrote {args.output_dir / 'summary.json'}", highlight=False)
    return 0


async def distill_scores(config: Config, cells, adapter_dir: Path | None, compare_base: bool,
                         max_seq_len: int) -> dict[str, Any]:
    """label -> DistillScore for the adapter (if any) and the base (alone, or with --compare-base)."""
    from ppo_affine.distill.evaluation import score_cells, score_cells_through_server

    labels = ["base"] if adapter_dir is None else ["adapter"] + (["base"] if compare_base else [])
    scores = {}
    if config.train.generation.backend == "local":
        policy = local_policy(config, adapter_dir)
        for label in labels:
            with rollout_progress(len(cells), f"{label}: DISTILL-V2 cells") as advance, \
                    (policy.base() if label == "base" else contextlib.nullcontext()):
                scores[label] = score_cells(cells, policy, max_seq_len=max_seq_len, on_cell=lambda _: advance())
        return scores
    generator, tokenizer, runs = model_runs(config, adapter_dir, compare_base)
    api_key = os.environ.get(config.env.vllm_api_key_env) if config.env.vllm_api_key_env else None
    try:
        await generator.check_server()
        for label, playing_as in runs:
            async with playing_as():
                served = generator.active_adapter or generator.base_model
                with rollout_progress(len(cells), f"{label}: DISTILL-V2 cells") as advance:
                    scores[label] = await asyncio.to_thread(
                        score_cells_through_server, cells, tokenizer, generator.base_url, served, api_key,
                        max_seq_len=max_seq_len, on_cell=lambda _: advance())
    finally:
        await generator.close()
    return scores


@contextlib.contextmanager
def server_log_folder(output_dir: Path | None):
    """Where a vLLM server evaluate starts writes its log: --output-dir, else a temporary folder that stays only when
    the evaluation fails (the failure line names the log)."""
    if output_dir is not None:
        yield output_dir
        return
    folder = Path(tempfile.mkdtemp(prefix="evaluate-vllm-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def summary_document(args: argparse.Namespace, config: Config, records: list[dict[str, Any]],
                     scores_from: dict[str, Any]) -> dict[str, Any]:
    document = {"settings": settings(args, config) | {"scores_from": scores_from},
                "models": report.summarize(records)}
    if args.compare_base:
        document["comparison"] = report.paired_differences(records)
    return document


def print_results(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    summary = report.summarize(records)
    comparison = report.paired_differences(records) if args.compare_base else None
    out = Console()
    if not out.is_terminal:  # a file or pipe: no terminal width to respect, keep each row on one line
        out = Console(width=180)
    source = (f"scores from the env's evaluate() at {args.env_evaluate}" if args.env_evaluate
              else "scores from episodes played by evaluate.py")
    for table in (report.game_table(summary, comparison, source), report.trace_table(summary, comparison, source)):
        if table is not None:
            out.print(table)
    errors = sum(1 for r in records if r["error"])
    if errors:
        first = next(r for r in records if r["error"])
        console.print(f"[yellow]{errors} of {len(records)} episodes failed and are left out of the rates "
                      f"(first: task {first['task_id']}: {first['error']})[/yellow]", highlight=False)
    if args.output_dir:
        console.print(f"wrote {args.output_dir / 'episodes.jsonl'} and {args.output_dir / 'summary.json'}",
                      highlight=False)


def settings(args: argparse.Namespace, config: Config) -> dict[str, Any]:
    gen = config.train.generation
    common = {
        "checkpoint": str(args.checkpoint) if args.checkpoint else None,
        "base_model": config.train.model.name_or_path,
        "opponent": args.opponent,
        "seed": args.seed,
        "seeds": "validator" if args.seed is None else "derived",
        "games": args.games,
        "task_ids": args.task_ids,
        "episodes_per_game": (10 if args.episodes is None else args.episodes) if args.games else None,
        "temperature": gen.temperature,
    }
    if args.env_evaluate:  # the env and the vLLM server decide the context, the reply length and the turns
        return common
    return common | {"backend": gen.backend, "max_new_tokens": gen.max_new_tokens,
                     "context_strategy": gen.context_strategy, "max_turns": gen.max_turns}


if __name__ == "__main__":
    sys.exit(main())
