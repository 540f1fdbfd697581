"""Does training make the model play better? SmolLM2-135M trained on CPU against its base model.

The real pipeline trains it; base and trained models then play greedily on held-out seeds (the
validators' evaluate() conversation, both seats), and the bench prints, per game and opponent: the
legal-move rate and the mean score with 95 % intervals, and the paired score difference to base.

    python bench/learning.py                                   # SFT warm start + PPO, goofspiel + leduc_poker
    python bench/learning.py --no-warm-start                   # PPO alone (10 steps) from the base model
    python bench/learning.py --opponents random,mcts --sft-checkpoint runs/x/sft/checkpoints/checkpoint-40

By default (`--warm-start`) `sft_warmstart.py` first imitates the experts (prize matching for
goofspiel, CFR+ for leduc_poker) with a short reason before the id ('<think>Current point card:
8</think>7'), on the game variants the evaluation plays, and PPO (`train_ppo.py`: cpu preset + the
overrides below; context `full`, turn-level credit, KL anchored to the SFT adapter) starts from
that adapter; the table then has base / SFT / SFT+PPO / expert rows. Replies may take up to
`--max-new-tokens` (24: room for the reason). Evaluation is `evaluate.py`'s (greedy, full
conversation, seeds derived from EVAL_SEED that training never draws); every played episode goes
to `<output-dir>/eval-<opponent>.jsonl`. Intervals are `report.py`'s: Wilson for the legal-move
rate over replies, Student t for mean scores and paired differences.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import evaluate  # noqa: E402
import report  # noqa: E402
import sft_warmstart  # noqa: E402
import train_ppo  # noqa: E402
from checkpoint import find_resumable  # noqa: E402
from envs.tasks import GAME_ID_STRIDE, game_name_of  # noqa: E402
from experts import DEFAULT_GOOFSPIEL_EXPERT, GOOFSPIEL_EXPERTS  # noqa: E402
from utils import load_config  # noqa: E402

# Tuned on this machine so that a CPU budget visibly moves the model: 8 episodes and one epoch per
# step give a steadier gradient per minute than more epochs, and 2e-4 was the fastest rate that kept
# the KL to the base small.
TRAIN_OVERRIDES = ["ppo.batch_size=8", "ppo.ppo_epochs=1", "ppo.learning_rate=2e-4", "ppo.init_kl_coef=0.05",
                   "ppo.kl_target=0.2", "generation.context_strategy=full", "generation.max_concurrent_episodes=8",
                   "generation.max_prompt_tokens=4096", "logging.log_samples_every=1"]
# PPO from an SFT adapter samples at 0.7: at 1.0 the peaked imitation policy wanders into replies it never saw
WARM_START_OVERRIDES = ["generation.temperature=0.7"]
EVAL_SEED = 900_000  # training draws its seeds from the curriculum's generator; these are derived apart


def eval_variants(games: list[str], episodes: int) -> list[int]:
    """The game variants (config ids) the evaluation plays: training sees the same variants, other seeds."""
    return sorted({t.task_id % GAME_ID_STRIDE for game in games
                   for t in evaluate.game_tasks(game, episodes, EVAL_SEED, "random", "openspiel")})


def train(games: list[str], steps: int, out: Path, overrides: list[str], init_adapter: Path | None,
          opponent: str = "random", config_ids: list[int] | None = None) -> Path:
    """The real train_ppo loop; returns the final checkpoint (a stopped run is an error, not a result)."""
    stages = json.dumps([{"name": "bench", "opponent": opponent, "min_episodes": 10**6,
                          "tasks": [{"env": "openspiel", "games": games, "config_ids": config_ids or [0]}]}])
    args = ["--preset", "cpu", "--output-dir", str(out), "--max-steps", str(steps), "--set", "run.name=ppo",
            "--set", f"curriculum.stages={stages}"]
    for override in overrides:
        args += ["--set", override]
    if init_adapter is not None:
        args += ["--init-adapter", str(init_adapter)]
    if train_ppo.main(args) != 0:
        sys.exit("training failed")
    checkpoint = find_resumable(out / "ppo" / "checkpoints")
    if checkpoint is None or checkpoint.name != f"checkpoint-{steps}":
        sys.exit(f"training stopped early ({checkpoint}); no evaluation of a partial run")
    return checkpoint


def play(config, games: list[str], episodes: int, opponent: str, adapter: Path | None, label: str,
         with_base: bool, episodes_path: Path | None = None) -> list[dict]:
    """evaluate.py's episodes (greedy, full context, held-out seeds, both seats) for one model (+ the base);
    each record is also appended to `episodes_path`."""
    tasks = [t for game in games for t in evaluate.game_tasks(game, episodes, EVAL_SEED, opponent, "openspiel")]
    specs = evaluate.eval_env_specs(config, {"openspiel"})
    adapter_dir = evaluate.adapter_folder(adapter) if adapter else None
    records = asyncio.run(evaluate.evaluate(config, tasks, specs, adapter_dir, with_base and adapter is not None,
                                            None))
    for record in records:
        record["model"] = record["model"] if record["model"] == "base" else label
    if episodes_path is not None:
        with open(episodes_path, "a") as sink:
            sink.writelines(json.dumps(record) + "\n" for record in records)
    return records


def expert_records(games: list[str], episodes: int, opponent: str, simulations: int, workers: int,
                   goofspiel_expert: str) -> list[dict]:
    """The experts themselves on the same tasks and seeds, as evaluation records."""
    tasks = [t for game in games for t in evaluate.game_tasks(game, episodes, EVAL_SEED, opponent, "openspiel")]
    jobs = [sft_warmstart.expert_job(game_name_of(t.task_id), t.task_id, t.seed, opponent,
                                     opponent_simulations=simulations, goofspiel_expert=goofspiel_expert)
            for t in tasks]
    played = sft_warmstart.generate(jobs, workers, None)
    return [{"model": "expert", "game": r["game"], "task_id": r["task_id"], "seed": r["seed"], "score": r["score"],
             "outcome": "win" if r["score"] > 0.5 else "draw" if r["score"] == 0.5 else "loss",
             "turns": sum(m["role"] == "assistant" for m in r["messages"]), "illegal_moves": 0,
             "parse_failed_game": False, "generated_tokens": 0, "error": None} for r in played]


def table(records: list[dict], opponent: str, models: list[str]) -> tuple[dict, list[str]]:
    """Per game and model: legal-move rate, mean score and paired difference to base, with intervals."""
    summary = report.summarize(records)
    rows, result = [], {}
    for game in sorted({r["game"] for r in records}):
        for model in models:
            s = summary.get(model, {}).get(game)
            if s is None:
                continue
            pair = report.paired_differences(records, model, "base").get(game) if model != "base" else None
            legal = None if s["illegal_rate"] is None else 1 - s["illegal_rate"]
            legal_ci = None if s["illegal_rate_ci95"] is None else [1 - s["illegal_rate_ci95"][1],
                                                                    1 - s["illegal_rate_ci95"][0]]
            result.setdefault(game, {})[model] = {
                "episodes": s["episodes"], "errors": s["errors"], "legal_move_rate": legal, "legal_ci95": legal_ci,
                "mean_score": s["mean_score"], "score_ci95": s["score_ci95"],
                "score_minus_base": pair and pair["score_diff"],
                "score_minus_base_ci95": pair and pair["score_diff_ci95"],
            }
            difference = _ci(pair and pair["score_diff"], pair and pair["score_diff_ci95"], signed=True)
            rows.append(f"| {game} | {opponent} | {model} | {_ci(legal, legal_ci)} | "
                        f"{_ci(s['mean_score'], s['score_ci95'])} | {difference} |")
    return result, rows


def has_mcts_opponent(game: str) -> bool:
    """False where the env plays a uniform random opponent whatever the opponent setting (goofspiel,
    as in Affine's env): `mcts` episodes there would repeat the random ones."""
    from envs.games import GAMES
    from envs.openspiel_episode import has_search_opponent, load_game

    spec = GAMES[game]
    return has_search_opponent(load_game(game, tuple(sorted(spec.params(0).items()))), spec)


def leduc_best_response_vs_random() -> float:
    """The highest mean score any policy can reach against the env's uniform random opponent in
    leduc_poker, both seats averaged: open_spiel's exact best response, scored (return + 13) / 26."""
    import pyspiel
    from open_spiel.python import policy as policy_lib
    from open_spiel.python.algorithms import best_response

    game = pyspiel.load_game("leduc_poker", {"players": 2})
    uniform = policy_lib.UniformRandomPolicy(game)
    values = [best_response.BestResponsePolicy(game, seat, uniform).value(game.new_initial_state()) for seat in (0, 1)]
    return (sum(values) / 2 + 13) / 26


def _ci(value, interval, signed: bool = False) -> str:
    if value is None:
        return "-"
    text = f"{value:+.3f}" if signed else f"{value:.3f}"
    return text + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--games", default="goofspiel,leduc_poker")
    parser.add_argument("--steps", type=int, help="PPO steps (default 4 after a warm start, 10 without)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="reply length: room for a short reason")
    parser.add_argument("--eval-episodes", type=int, default=16, help="per game and opponent, both seats")
    parser.add_argument("--opponents", default="random", help="comma-separated: random, mcts")
    parser.add_argument("--train-opponent", choices=["random", "mcts"], default="random",
                        help="the opponent PPO trains against")
    parser.add_argument("--mcts-simulations", type=int, default=300,
                        help="the MCTS opponent's simulations in training and evaluation (validators: 3000 for "
                             "poker and dice)")
    parser.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True,
                        help="SFT on expert play first, PPO from its adapter; SFT and expert rows in the table")
    parser.add_argument("--sft-episodes", type=int, default=32, help="expert episodes per game for SFT")
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--sft-batch-size", type=int, default=4, help="conversations per SFT optimizer step")
    parser.add_argument("--sft-learning-rate", type=float, default=1e-3)
    parser.add_argument("--goofspiel-expert", choices=GOOFSPIEL_EXPERTS, default=DEFAULT_GOOFSPIEL_EXPERT,
                        help="the goofspiel expert for SFT data and the expert rows (experts.py)")
    parser.add_argument("--sft-reason", action=argparse.BooleanOptionalAction, default=True,
                        help="SFT replies '<think>reason</think>ID' (sft_warmstart --reason); --no-sft-reason: the ID "
                             "alone")
    parser.add_argument("--sft-checkpoint", type=Path,
                        help="with --warm-start: start PPO from this SFT checkpoint instead of training one")
    parser.add_argument("--workers", type=int, default=2, help="processes playing expert episodes")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench-learning"))
    parser.add_argument("--set", action="append", default=[], help="extra train_ppo --set overrides")
    args = parser.parse_args()
    games = args.games.split(",")
    opponents = args.opponents.split(",")
    steps = args.steps if args.steps is not None else (4 if args.warm_start else 10)
    if steps < 1:
        parser.error(f"--steps must be at least 1, got {steps}")
    # one MCTS strength for training against mcts and for evaluation; random opponents ignore it
    overrides = [*TRAIN_OVERRIDES, *(WARM_START_OVERRIDES if args.warm_start else []),
                 f"generation.max_new_tokens={args.max_new_tokens}",
                 f"env.envs.openspiel.mcts_simulations={args.mcts_simulations}", *args.set]
    if args.sft_checkpoint is not None and not (args.warm_start and (args.sft_checkpoint / "adapter").is_dir()):
        parser.error(f"--sft-checkpoint needs --warm-start and a checkpoint folder with adapter/: "
                     f"{args.sft_checkpoint}")
    if args.sft_checkpoint is not None and args.output_dir.resolve() in args.sft_checkpoint.resolve().parents:
        parser.error("--sft-checkpoint lies inside --output-dir, which the bench clears first")
    shutil.rmtree(args.output_dir, ignore_errors=True)  # this bench's own scratch folder
    args.output_dir.mkdir(parents=True)
    timings: dict[str, float] = {}
    variants = eval_variants(games, args.eval_episodes)

    sft_checkpoint = args.sft_checkpoint
    if args.warm_start and sft_checkpoint is None:
        started = time.perf_counter()
        sft_args = ["--preset", "cpu", "--games", ",".join(games), "--episodes", str(args.sft_episodes),
                    "--config-ids", ",".join(map(str, variants)), "--goofspiel-expert", args.goofspiel_expert,
                    "--epochs", str(args.sft_epochs), "--workers", str(args.workers),
                    "--batch-size", str(args.sft_batch_size), "--learning-rate", str(args.sft_learning_rate),
                    "--output-dir", str(args.output_dir / "sft"), *(["--reason"] if args.sft_reason else [])]
        for override in overrides:
            sft_args += ["--set", override]
        if sft_warmstart.main(sft_args) != 0:
            sys.exit("warm start failed")
        sft_checkpoint = find_resumable(args.output_dir / "sft" / "checkpoints")
        timings["sft_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    trained = train(games, steps, args.output_dir, overrides, sft_checkpoint, args.train_opponent, variants)
    timings["ppo_seconds"] = time.perf_counter() - started

    config = load_config(presets=["cpu"], overrides=[*overrides, "generation.temperature=0"])
    trained_label = "sft+ppo" if args.warm_start else "ppo"
    models = ["base", *(["sft"] if args.warm_start else []), trained_label, *(["expert"] if args.warm_start else [])]
    results, rows = {}, []
    started = time.perf_counter()
    for opponent in opponents:
        played = [g for g in games if opponent == "random" or has_mcts_opponent(g)]
        if not played:
            continue
        episodes_path = args.output_dir / f"eval-{opponent}.jsonl"
        records = play(config, played, args.eval_episodes, opponent, trained, trained_label, with_base=True,
                       episodes_path=episodes_path)
        if sft_checkpoint is not None:
            records += play(config, played, args.eval_episodes, opponent, sft_checkpoint, "sft", with_base=False,
                            episodes_path=episodes_path)
            records += expert_records(played, args.eval_episodes, opponent, args.mcts_simulations, args.workers,
                                      args.goofspiel_expert)
        results[opponent], opponent_rows = table(records, opponent, models)
        rows += opponent_rows
    timings["eval_seconds"] = time.perf_counter() - started
    ceilings = {"leduc_poker_best_mean_score_vs_random": round(leduc_best_response_vs_random(), 4)} \
        if "leduc_poker" in games else {}
    print(json.dumps({"model": "SmolLM2-135M-Instruct (cpu preset)", "games": games, "ppo_steps": steps,
                      "train_opponent": args.train_opponent, "variants": variants,
                      "train_episodes": steps * config.train.ppo.batch_size, "max_new_tokens": args.max_new_tokens,
                      "extra_overrides": args.set,
                      "eval_episodes_per_game": args.eval_episodes, "mcts_simulations": args.mcts_simulations,
                      "sft": ({"checkpoint": str(args.sft_checkpoint)} if args.sft_checkpoint else
                              {"episodes_per_game": args.sft_episodes, "epochs": args.sft_epochs,
                               "goofspiel_expert": args.goofspiel_expert, "reason": args.sft_reason,
                               "batch_size": args.sft_batch_size, "learning_rate": args.sft_learning_rate})
                      if args.warm_start else None,
                      "checkpoint": str(trained), "seconds": {k: round(v) for k, v in timings.items()},
                      "ceilings": ceilings, "results": results}, indent=1))
    print("\n| game | opponent | model | legal-move rate [95% CI] | mean score [95% CI] | score - base [95% CI] |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
