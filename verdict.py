"""Would the validators crown the candidate? Both models on the same tasks and seeds, their Pareto rule and copy check.

The champion (the base model, a checkpoint, or a merged model folder) plays every env's tasks first, then the
candidate (a checkpoint or a merged folder) plays the same task ids with the same seeds, one model loaded at a time,
at temperature 0 (the validators'; --temperature overrides). Episodes are played by evaluate.py's own episode runner,
so any env of the config works: embedded game and trace envs, affinetes envs (url / docker) and kind-`evaluate` envs.
Per env: both means over the shared tasks, the paired difference candidate - champion with its 95 % interval
(report.py), the bucket of the validators' rule (ppo_affine/validator_rule.py) and the buckets the interval spans,
the sample count against the validators' minimum. The verdict is "would dethrone", "would not, because ..." or
"unknown" while an env the validators score (env.validators.sampling_counts) was not run here.

`--distill-cells URL|DIR` adds DISTILL-V2: the teacher cells scored by each model in process, as evaluate.py
--distill-cells scores them (ppo_affine/distill/); the cell's task index is its task id.

Copy check (ppo_affine/copy_check.py): the champion's most recent `copy_rollouts_per_env` finished episodes per env
(or the episodes in --copy-episodes), teacher-forced by both models: the pooled median |log-prob difference| at
decision positions, a copy below 0.05 with at least 50 positions.

Run:  python verdict.py --preset cpu --candidate runs/r/checkpoints/checkpoint-500 --champion base \\
          --env openspiel --games leduc_poker,liars_dice --env trace --episodes 20 --output-dir verdict/r-500
      python verdict.py --candidate merged/r-500 --champion merged/champion --env swe=0-199 \\
          --distill-cells DISTILL_V2_URL --distill-limit 100 --output-dir verdict/x
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

import evaluate
from ppo_affine import report
from ppo_affine.config import Config, ConfigError, EnvSpec
from ppo_affine.distill.cells import DEFAULT_CACHE_DIR
from ppo_affine.copy_check import assistant_tokens, copy_statistic, teacher_forced_logprobs
from ppo_affine.envs.tasks import AVAILABLE_GAMES, Task, validator_seed
from ppo_affine.file_writes import WriteFailed, probe_writable, writing
from ppo_affine.generation import VLLMError
from ppo_affine.run_log import console, report_failure, rollout_progress, setup_logging
from ppo_affine.validator_rule import Verdict, buckets_across, judge
from ppo_affine.vllm_server import VLLMServerError, owned_server
from utils import add_config_arguments, config_for_adapter, program_parser

CHAMPION, CANDIDATE = "champion", "candidate"
DISTILL = "DISTILL-V2"  # the validators' name of the env, the rule's additive one


@dataclass(frozen=True)
class ModelUnderTest:
    label: str  # CHAMPION | CANDIDATE
    source: str  # as given: "base", a checkpoint or adapter folder, a merged model folder
    config: Config
    adapter_dir: Path | None


@dataclass(frozen=True)
class EnvPlan:
    name: str  # the score table's key: the env's name in the config (or a runner's own, e.g. DISTILL-V2)
    runner: str  # the RUNNERS entry that scores it
    spec: EnvSpec | None
    tasks: list[Task]
    cells: list | None = None  # DISTILL-V2: the teacher cells, read once before any model loads


# ---------------------------------------------------------------------- the two models
def model_under_test(args: argparse.Namespace, label: str, source: str) -> ModelUnderTest:
    """A model named on the command line: `base`, a checkpoint / adapter folder, or a merged model folder."""
    flags = evaluate.flag_overrides(args)
    if source == "base":
        config, adapter_dir = config_for_adapter(args, None, evaluate.VALIDATOR_SETTINGS, flags)
        return ModelUnderTest(label, source, config, adapter_dir)
    path = Path(source)
    if not path.is_dir():
        raise ConfigError(f"--{label}: {source} is not a folder; give 'base', a checkpoint or adapter folder, or a "
                          "merged model folder (merge.py's output).")
    if is_merged_model(path):
        merged = [f"model.name_or_path={path}", "model.gguf_file=null", "model.gguf_package=null"]
        config, _ = config_for_adapter(args, None, evaluate.VALIDATOR_SETTINGS, [*flags, *merged])
        return ModelUnderTest(label, source, config, None)
    config, adapter_dir = config_for_adapter(args, path, evaluate.VALIDATOR_SETTINGS, flags, adapter_only=True)
    return ModelUnderTest(label, source, config, adapter_dir)


def is_merged_model(path: Path) -> bool:
    """A whole model's folder (merge.py's output): a transformers config.json beside no adapter. A checkpoint also
    holds a config.json (the run's configuration), with no `model_type` in it."""
    config = path / "config.json"
    if not config.is_file() or (path / "adapter_config.json").is_file() or (path / "adapter").is_dir():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def load_local_policy(model: ModelUnderTest):
    return evaluate.local_policy(model.config, model.adapter_dir)


def free_memory() -> None:
    """Return a dropped model's memory before the next one loads (two large models never sit side by side)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- which tasks each env plays
def plan_envs(args: argparse.Namespace, config: Config) -> list[EnvPlan]:
    """One plan per --env: its spec from the config and its tasks with the validators' seeds."""
    if not args.env and not args.distill_cells:
        raise ConfigError("Nothing to compare on: pass --env NAME (an env of the env config, or openspiel / trace "
                          "for the embedded ones), e.g. --env openspiel --games leduc_poker --env trace.")
    plans = []
    for item in args.env:
        name, _, ids = item.partition("=")
        if name in RUNNER_OF_ENV:
            if not ids:
                raise ConfigError(f"--env {name}: give its task ids, e.g. --env {name}=0-99.")
            plans.append(EnvPlan(name, RUNNER_OF_ENV[name], None, listed_tasks(name, ids, "evaluate", None)))
            continue
        spec = config.env.envs.get(name)
        if spec is None and name in ("openspiel", "trace"):
            spec = EnvSpec(kind=name)
        if spec is None:
            raise ConfigError(f"--env {name}: no such env in the env config (defined: {sorted(config.env.envs)}), "
                              "and not one of the embedded openspiel / trace.")
        if spec.kind == "openspiel" and spec.mode == "local":  # the validators' observation format
            spec = spec.model_copy(update={"observation_format": "evaluate"})
        plans.append(EnvPlan(name, "episodes", spec, env_tasks(args, name, spec, ids)))
    if args.distill_cells:
        plans.append(distill_plan(args))
    return plans


def distill_plan(args: argparse.Namespace) -> EnvPlan:
    """DISTILL-V2 from --distill-cells: the cells are read here, once, before a model loads."""
    from ppo_affine.distill.cells import read_cells_for

    if args.distill_limit is not None and args.distill_limit < 1:
        raise ConfigError(f"--distill-limit must be at least 1, got {args.distill_limit}.")
    cells = read_cells_for("--distill-cells", args.distill_cells, args.distill_cache_dir, limit=args.distill_limit)
    tasks = [Task(env=DISTILL, task_id=cell.task_idx, seed=0, opponent=None, stage="eval", replay=False)
             for cell in cells]
    return EnvPlan(DISTILL, "distill", None, tasks, cells)


def env_tasks(args: argparse.Namespace, name: str, spec: EnvSpec, ids: str) -> list[Task]:
    """`--env NAME=0-9,12` plays the listed ids; without ids, `--episodes` per game (openspiel) or trace tasks."""
    if ids:
        return listed_tasks(name, ids, spec.kind, args.opponent if spec.kind == "openspiel" else None)
    if spec.kind == "trace":
        return evaluate.game_tasks(report.TRACE, args.episodes, None, args.opponent, name)
    if spec.kind == "openspiel":
        games = [g.strip() for g in (args.games or ",".join(spec.games or [])).split(",") if g.strip()]
        unknown = [g for g in games if g not in AVAILABLE_GAMES]
        if not games or unknown:
            raise ConfigError(f"--env {name}: say which games it plays with --games (names from {AVAILABLE_GAMES})"
                              + (f"; unknown: {unknown}" if unknown else ""))
        return [t for game in games for t in evaluate.game_tasks(game, args.episodes, None, args.opponent, name)]
    raise ConfigError(f"--env {name}: an env of kind {spec.kind!r} needs its task ids, e.g. --env {name}=0-99.")


def listed_tasks(name: str, ids: str, kind: str, opponent: str | None) -> list[Task]:
    """The listed task ids of one env, each with the seed the validators derive from the env's name and the id."""
    seed_env = {"openspiel": "game", "trace": "trace"}.get(kind, name)
    return [Task(env=name, task_id=task_id, seed=validator_seed(seed_env, task_id), opponent=opponent, stage="eval",
                 replay=False) for _, task_id in evaluate.parse_task_ids(ids)]


# ---------------------------------------------------------------------- env runners
def play_episodes(model: ModelUnderTest, plans: list[EnvPlan], policy, episodes_path: Path | None
                  ) -> list[dict[str, Any]]:
    """Episodes of every plan's tasks, played by evaluate.py's runner; records carry env, task_id, seed, score,
    error and conversation."""
    tasks = [task for plan in plans for task in plan.tasks]
    specs = {plan.name: (plan.name, plan.spec) for plan in plans}
    records = asyncio.run(evaluate.evaluate(model.config, tasks, specs, model.adapter_dir, False, episodes_path,
                                            policy=policy))
    return [record | {"model": model.label} for record in records]


def score_distill_cells(model: ModelUnderTest, plans: list[EnvPlan], policy, output_path: Path | None
                        ) -> list[dict[str, Any]]:
    """DISTILL-V2: each cell's score by teacher forcing in process (ppo_affine/distill/), keyed by its task index."""
    from ppo_affine.distill.evaluation import score_cells

    records = []
    for plan in plans:
        with rollout_progress(len(plan.cells), f"{model.label}: DISTILL-V2 cells") as advance:
            scored = score_cells(plan.cells, policy, on_cell=lambda _: advance())
        records += [{"model": model.label, "env": plan.name, "task_id": task_idx, "seed": 0, "score": cell.score,
                     "error": None} for task_idx, cell in scored.cells.items()]
    if output_path:
        with writing("the DISTILL-V2 scores", output_path):
            output_path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


# How one model is scored on a group of envs while it is loaded: (model, plans, its local policy or None, an
# output file of its own to write or None) -> records, each with model, env, task_id, seed, score, error. Runners other
# than "episodes" get the model's local policy. Another env scored without episodes is a runner here and its name in
# RUNNER_OF_ENV: `--env NAME=IDS` then hands it the ids.
EnvRunner = Callable[[ModelUnderTest, list[EnvPlan], Any, Path | None], list[dict[str, Any]]]
RUNNERS: dict[str, EnvRunner] = {"episodes": play_episodes, "distill": score_distill_cells}
RUNNER_OF_ENV: dict[str, str] = {}  # env name -> RUNNERS key, for envs that are not in the env config


# ---------------------------------------------------------------------- one model's turn
@dataclass(frozen=True)
class Rollout:
    """One of the champion's episodes as the copy check teacher-forces it."""
    key: str
    env: str
    token_ids: list[int]
    assistant_mask: list[bool]


def run_model(model: ModelUnderTest, plans: list[EnvPlan], rollouts: list[Rollout] | None,
              copy_source: list[dict[str, Any]] | None, output_dir: Path | None, copy_check: bool
              ) -> tuple[list[dict[str, Any]], list[Rollout] | None, dict[str, list[float]]]:
    """Load one model, score it on every plan, teacher-force the copy check's rollouts, unload it. The champion
    (rollouts None) picks the rollouts from its own episodes (or `copy_source`) and returns them."""
    policy = load_local_policy(model) if model.config.train.generation.backend == "local" else None
    records: list[dict[str, Any]] = []
    for runner in dict.fromkeys(plan.runner for plan in plans):
        path = output_dir / f"{runner}-{model.label}.jsonl" if output_dir else None
        if runner != "episodes":  # scored by teacher forcing in process
            policy = policy or load_local_policy(model)
        records += RUNNERS[runner](model, [p for p in plans if p.runner == runner], policy, path)
    logprobs: dict[str, list[float]] = {}
    if copy_check:
        policy = policy or load_local_policy(model)  # a vLLM server played: teacher forcing is local
        if rollouts is None:
            rollouts = champion_rollouts(copy_source or records, policy.tokenizer,
                                         model.config.train.model.chat_template_kwargs,
                                         model.config.env.validators.copy_rollouts_per_env)
        logprobs = {r.key: teacher_forced_logprobs(policy, r.token_ids, r.assistant_mask) for r in rollouts}
    del policy
    free_memory()
    return records, rollouts, logprobs


def champion_rollouts(records: list[dict[str, Any]], tokenizer, chat_template_kwargs: dict, per_env: int
                      ) -> list[Rollout]:
    """Per env the `per_env` finished episodes with the highest task ids (the validators' "most recent": their task
    ids grow over time) that hold an assistant turn, rendered and tokenised."""
    by_env: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if not record.get("error") and any(m.get("role") == "assistant" for m in record.get("conversation") or []):
            by_env.setdefault(record.get("env") or record["game"], []).append(record)
    rollouts = []
    for env, chosen in by_env.items():
        for record in sorted(chosen, key=lambda r: r["task_id"], reverse=True)[:per_env]:
            ids, mask = assistant_tokens(tokenizer, record["conversation"], chat_template_kwargs)
            if any(mask):
                rollouts.append(Rollout(f"{env}#{record['task_id']}#{record['seed']}", env, ids, mask))
    return rollouts


# ---------------------------------------------------------------------- numbers
def score_tables(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[tuple, float]]]:
    """model -> env -> (task_id, seed) -> score, errored episodes left out (the validators set them apart)."""
    tables: dict[str, dict[str, dict[tuple, float]]] = {CHAMPION: {}, CANDIDATE: {}}
    for record in records:
        if not record["error"]:
            tables[record["model"]].setdefault(record["env"], {})[(record["task_id"], record["seed"])] = record["score"]
    return tables


def env_rows(verdict: Verdict, tables: dict[str, dict[str, dict[tuple, float]]], config: Config
             ) -> list[dict[str, Any]]:
    """Per env: the judgement, the paired difference with its 95 % interval, and the buckets the interval spans."""
    rows = []
    for judged in verdict.envs:
        candidate, champion = tables[CANDIDATE].get(judged.env, {}), tables[CHAMPION].get(judged.env, {})
        differences = [candidate[key] - champion[key] for key in candidate.keys() & champion.keys()]
        mean, interval = report.mean_interval(differences)
        spans = buckets_across(judged, interval, config.env.validators)
        rows.append(asdict(judged) | {"difference": mean, "difference_ci95": interval,
                                      "pairs_to_decide": report.pairs_to_decide(differences),
                                      "interval_buckets": spans, "interval_could_change_bucket": len(spans) > 1})
    return rows


# ---------------------------------------------------------------------- the program
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = program_parser(__doc__)
    parser.add_argument("--candidate", required=True, help="the model to submit: a checkpoint or adapter folder, "
                        "or a merged model folder (required)")
    parser.add_argument("--champion", default="base", help="the model to beat: 'base' (the config's base model), a "
                        "checkpoint or adapter folder, or a merged model folder")
    parser.add_argument("--env", action="append", default=[], metavar="NAME[=IDS]",
                        help="an env to compare on, repeatable: a name from the env config or openspiel / trace; "
                        "=IDS lists its task ids (inclusive ranges, e.g. swe=0-199), needed for kind 'evaluate'")
    parser.add_argument("--games", help="games of an openspiel env given without ids (default: the env's `games`)")
    parser.add_argument("--episodes", type=int, default=20, help="tasks per game / trace env given without ids")
    parser.add_argument("--opponent", choices=("mcts", "random"), default="mcts", help="game opponent")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default 0 = greedy, as validators)")
    parser.add_argument("--max-new-tokens", type=int, help="most tokens of one reply (default: the config's)")
    parser.add_argument("--context-strategy", choices=("full", "truncated", "last"),
                        help="conversation shown to the model (default full, as validators)")
    parser.add_argument("--distill-cells", metavar="URL|DIR", help="also score DISTILL-V2 on the teacher cells under "
                        "this base URL or in this folder, as evaluate.py --distill-cells does (default: none: DISTILL-V2 "
                        "stays 'unknown')")
    parser.add_argument("--distill-limit", type=int, metavar="N", help="with --distill-cells: the first N cells "
                        "(default: all; the validators sample 100)")
    parser.add_argument("--distill-cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                        help="with --distill-cells URL: where downloaded shards are kept")
    parser.add_argument("--copy-episodes", type=Path, help="an episodes.jsonl of the champion (evaluate.py "
                        "--output-dir) whose conversations the copy check teacher-forces (default: the champion's "
                        "episodes of this run)")
    parser.add_argument("--no-copy-check", action="store_true", help="skip the copy check")
    parser.add_argument("--output-dir", type=Path, help="write episodes-champion.jsonl, episodes-candidate.jsonl and "
                        "summary.json here (default: none: printed only)")
    add_config_arguments(parser, set_example="env.validators.margin=0.05")
    return parser.parse_args(argv)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Both models' turns, then the rule and the copy check: the summary document."""
    champion = model_under_test(args, CHAMPION, args.champion)
    candidate = model_under_test(args, CANDIDATE, args.candidate)
    plans = plan_envs(args, champion.config)
    if args.episodes < 1:
        raise ConfigError(f"--episodes must be at least 1, got {args.episodes}.")
    copy_source = read_episodes(args.copy_episodes) if args.copy_episodes else None
    if args.output_dir:
        probe_writable(args.output_dir, "--output-dir")  # before any model loads
    records, rollouts, logprobs = [], None, {}
    for model in (champion, candidate):
        with evaluate.server_log_folder(args.output_dir) as log_dir, owned_server(model.config, log_dir) as config:
            played, rollouts, logprobs[model.label] = run_model(replace(model, config=config), plans, rollouts,
                                                                copy_source, args.output_dir, not args.no_copy_check)
        records += played
    tables = score_tables(records)
    rule = champion.config.env.validators
    verdict = judge(tables[CANDIDATE], tables[CHAMPION], rule,
                    list(dict.fromkeys([*(p.name for p in plans), *rule.sampling_counts])))
    copy = None
    if not args.no_copy_check:
        copy = copy_statistic(logprobs[CANDIDATE], logprobs[CHAMPION], {r.key: r.env for r in rollouts}, rule)
    return {"settings": {"candidate": args.candidate, "champion": args.champion,
                         "temperature": champion.config.train.generation.temperature,
                         "envs": {p.name: len(p.tasks) for p in plans}, "rule": rule.model_dump()},
            "verdict": verdict.outcome, "verdict_text": verdict.text, "envs": env_rows(verdict, tables, champion.config),
            "copy_check": None if copy is None else asdict(copy) | {"line": copy.line}}


def read_episodes(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"--copy-episodes: {path} does not exist; give an episodes.jsonl written by evaluate.py.")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def print_summary(summary: dict[str, Any]) -> None:
    out = Console() if Console().is_terminal else Console(width=180)
    table = Table(title=f"{summary['settings']['candidate']} vs {summary['settings']['champion']}")
    for column in ("env", "champion", "candidate", "tasks / needed", "candidate - champion [95 %]", "bucket",
                   "the interval spans"):
        table.add_column(column)
    for row in summary["envs"]:
        mean = "-" if row["difference"] is None else f"{row['difference']:+.3f}"
        interval = "" if row["difference_ci95"] is None else " [{:+.3f}, {:+.3f}]".format(*row["difference_ci95"])
        table.add_row(row["env"], _number(row["champion_mean"]), _number(row["candidate_mean"]),
                      f"{row['shared_tasks']} / {row['required_tasks']}", mean + interval,
                      f"{row['bucket']} ({row['reason']})", " .. ".join(row["interval_buckets"]))
    out.print(table)
    console.print(f"verdict: {summary['verdict_text']}", highlight=False)
    if summary["copy_check"]:
        console.print(summary["copy_check"]["line"], highlight=False)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        summary = compare(args)
        if args.output_dir:
            with writing("the summary", args.output_dir / "summary.json"):
                (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    except ConfigError as exc:
        return report_failure("Error", exc, 2)
    except (VLLMError, VLLMServerError, WriteFailed) as exc:
        return report_failure("Stopped", exc, 1)
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
