"""Does training make the model play better? SmolLM2-135M trained on CPU against its base model.

The real pipeline trains it; the models then play greedily on held-out seeds (the validators'
evaluate() conversation, both seats), and the bench prints, per game and opponent: the legal-move
rate and the mean score with 95 % intervals, and the paired score differences to base and to SFT.

    python -m bench.learning --profile validator        # the validators' four games at their opponent's strength
    python -m bench.learning                            # SFT + 4 PPO steps vs random, goofspiel + leduc_poker
    python -m bench.learning --no-warm-start            # PPO alone from the base model
    python -m bench.learning --profile validator --sft-checkpoint runs/x/sft/checkpoints/checkpoint-64 \
        --models sft,sft+ppo --set ppo.learning_rate=1e-4   # an ablation row: PPO only, two rows
    python -m bench.learning --tables-from runs/a/eval-mcts.jsonl runs/b/eval-mcts.jsonl   # two runs, one table

Profiles set the defaults every flag can still override:
- `random` (default): goofspiel + leduc_poker against the env's random opponent; SFT replies carry a
  short reason before the ID ('<think>Current point card: 8</think>7'), up to 40 tokens.
- `validator`: the four games validators sampled (leduc_poker, liars_dice, goofspiel, gin_rummy)
  against their opponent at its real strength (the MCTS budgets of the game table, in the fast
  search; goofspiel's is uniform random, as simultaneous moves get in the env), in SFT data,
  training and evaluation alike; teachers aimed at that opponent (`--experts`); ID-only replies
  (6 tokens: the validators' conversation keeps each reply think-stripped, and so does training, so
  a reply with a reason makes the next turn a new token sequence, about 4x the tokens on goofspiel;
  docs/benchmarks.md), 20 PPO steps, 32 held-out seeds per
  game. Two CPU cores set the sizes: goofspiel's conversations run to 4 000 tokens, so it gets 16
  SFT games and 16 seeds; gin_rummy's to 8 000 and its opponent (the exact search: open_spiel's C++
  one crashes on gin_rummy) thinks for seconds a move, so it gets 4 SFT games, a 1/61 share of the
  PPO episodes (`--game-weights`) and 4 seeds (`--eval-episodes`), which their intervals show; a
  run with gin_rummy allows 60 model turns and 8 186-token prompts (GAME_OVERRIDES), room for its
  whole conversation, and checkpoints activations in backward passes.
- `ci`: the same four games and rows at toy sizes (2 games each, 1 PPO step, 20 simulations), for
  the tests (with a tiny model: `--set model.name_or_path=DIR`).

With `--warm-start` (default) `sft_warmstart.py` first imitates the experts (experts.py; the
defaults, or `--experts`) against the training opponent, on the game variants the evaluation plays,
and PPO (`train_ppo.py`: the cpu and warm_start presets + the overrides below, KL anchored to the
SFT adapter) starts from that adapter; `--sft-dagger-rounds N` first runs N DAgger rounds
(`sft_warmstart.py --dagger-rounds`), after the SFT (whose expert games every round trains on again) or from
`--sft-checkpoint` (`--sft-dagger-data FILE`: the expert games to train on beside). Against MCTS the table
also has a `ceiling` row for leduc_poker: the best response to the opponent (experts.py
`best_response`), the most any player scores. Every row, the teachers' and the ceiling's too, meets the
opponent the run's config sets (its budgets and search: `--set env.envs.openspiel.opponent_search=exact` reaches
them all), and the best response keeps its opponent model in `model.cache_dir`. Evaluation is `evaluate.py`'s
(greedy, full conversation, held-out seeds that training never draws: the tuning block by default, the
confirmation block with `--eval-block confirmation`, for a chosen recipe's one verdict); every played episode goes to
`<output-dir>/eval-<opponent>.jsonl`, the PPO run's curves to `<output-dir>/plots/`; `--eval-episodes 48
--eval-skip 16` plays seeds 17–48 of a game whose first 16 an earlier run played (episode i's seed does
not depend on the count), so two runs' files together are the 48-seed evaluation: `--tables-from A B`
prints their table (`B:sft=sft+ppo` when B's run evaluated a PPO adapter through --sft-checkpoint). The
teachers' and the ceiling's episodes are in those files too; each row's JSON has its mean score per seat
(`score_by_seat`, seat 0 moves first). Intervals are `report.py`'s: Wilson for the legal-move rate over
replies, Student t for mean scores and paired differences; under the table each paired difference says
how many pairs scored differently and how many pairs with the same mean and spread would put 0 outside
its interval, the size an evaluation needs to decide it. `signal` in the JSON is how PPO's updates moved
each reply's log-probability against its advantage (logging.signal_check_every; a healthy update has a
clearly positive correlation). `--teacher-moves` replays every evaluated game with its teacher answering
at each turn and prints how often each model played the teacher's move: a student that never leaves one
move (leduc_poker's Call at every turn) shows there, where its score does not say why PPO cannot move it.
`--output-dir` holds every file of a run: the bench clears it at start only if it made it (its `.bench-learning`
file), makes it if new or empty, and refuses any other folder, leaving its files as they were.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import evaluate
import sft_warmstart
import train_ppo
import visualize
from ppo_affine import report
from ppo_affine.checkpoint import find_resumable
from ppo_affine.envs.tasks import EVALUATION_BLOCKS, GAME_ID_STRIDE, game_name_of
from ppo_affine.experts import DEFAULT_GOOFSPIEL_EXPERT, GOOFSPIEL_EXPERTS, expert_choices, expert_kind
from ppo_affine.policy import adapter_folder
from ppo_affine.config import ConfigError, load_config
from ppo_affine.warm_start import expert_play
from ppo_affine.warm_start.config import (
    DAGGER_AGGREGATES, WarmStartConfig, parse_experts, parse_game_counts, parse_reason_games,
)
from ppo_affine.warm_start.expert_play import game_env  # the opponent every row of the table meets
from ppo_affine.warm_start.relabel import expert_moves_played, relabel_each

# Tuned on this machine so that a CPU budget visibly moves the model: 8 episodes and one epoch per
# step give a steadier gradient per minute than more epochs, and 2e-4 was the fastest rate that kept
# the KL to the base small. 4096 tokens per micro-batch leave room for a shared prefix and its rows.
TRAIN_OVERRIDES = ["ppo.batch_size=8", "ppo.ppo_epochs=1", "ppo.learning_rate=2e-4", "ppo.init_kl_coef=0.05",
                   "ppo.kl_target=0.2", "generation.context_strategy=full", "generation.max_concurrent_episodes=8",
                   "generation.max_prompt_tokens=4096", "logging.log_samples_every=1", "logging.signal_check_every=1",
                   "ppo.micro_batch_tokens=4096"]
# PPO from an SFT adapter runs with the warm_start preset (config/presets/warm_start.json: temperature 0.7,
# a loose KL anchor to the SFT adapter); the bench's own curriculum stage replaces the preset's.
WARM_START_PRESET = "warm_start"
# What a game's whole evaluate() conversation needs beyond TRAIN_OVERRIDES, set when the game is in the run:
# gin_rummy plays up to about 45 model turns before the stock runs out, and its full conversation outgrows
# 4 096 tokens after about 15 (SmolLM2 holds 8 192, 6 of them for the reply); backward passes through
# 8 000-token rows keep one layer's activations at a time (gradient checkpointing: 6.9 GB RSS in SFT).
GAME_OVERRIDES = {"gin_rummy": ["generation.max_turns=60", "generation.max_prompt_tokens=8186",
                                "model.gradient_checkpointing=true"]}
# A reply with a short reason fits in 40 tokens: '<think>Current point card: 8</think>7' takes 13, goofspiel's
# longest, when the prize's card is gone ('...; card 14 is gone, so I bid my card 15</think>14'), 32 with
# its EOS; a cut one carries no ID. ID-only replies end at their EOS long before, so a run that mixes the
# two costs nothing more for the ID-only games.
REASON_REPLY_TOKENS = 40
# written into every --output-dir the bench makes: the one mark of a folder it may clear (never a user's own)
OUTPUT_MARKER = ".bench-learning"


def count(per_game: dict[str, int], game: str) -> int:
    return per_game.get(game, per_game["*"])


def eval_tasks(games: list[str], episodes: dict[str, int], opponent: str, skip: int = 0,
               block: str = "tuning") -> list:
    """evaluate.py's held-out tasks: `episodes` per game (both seats, seeds derived from the block's base in
    tasks.EVALUATION_BLOCKS; training never draws them), less each game's first `skip` (an earlier run played
    those: the seeds of episode i do not depend on the count). Both blocks play the same variants."""
    base = EVALUATION_BLOCKS[block]
    return [t for game in games
            for t in evaluate.game_tasks(game, count(episodes, game), base, opponent, "openspiel")[skip:]]


def eval_variants(games: list[str], episodes: dict[str, int]) -> dict[str, list[int]]:
    """Per game, the variants (config ids) the evaluation plays: training sees the same variants, other seeds."""
    return {game: sorted({t.task_id % GAME_ID_STRIDE for t in eval_tasks([game], episodes, "random")})
            for game in games}


def train(games: list[str], steps: int, out: Path, overrides: list[str], init_adapter: Path | None,
          opponent: str = "random", variants: dict[str, list[int]] | None = None,
          weights: dict[str, float] | None = None, seat: int | None = None) -> Path:
    """The real train_ppo loop; returns the final checkpoint (a stopped run is an error, not a result).
    `variants`: game -> config ids to train on; `weights`: game -> sampling weight (1 for the others);
    `seat`: the model's seat in every training episode (None: either)."""
    # one source per game, so that a game's share of the episodes is its weight over the sum
    sources = [{"env": "openspiel", "games": [game], "config_ids": (variants or {}).get(game, [0]),
                "weight": (weights or {}).get(game, 1.0), "seat": seat} for game in games]
    stages = json.dumps([{"name": "bench", "opponent": opponent, "min_episodes": 10**6, "tasks": sources}])
    presets = ["--preset", "cpu"] + (["--preset", WARM_START_PRESET] if init_adapter is not None else [])
    args = [*presets, "--output-dir", str(out), "--max-steps", str(steps), "--set", "run.name=ppo",
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


def play(config, games: list[str], episodes: dict[str, int], opponent: str, adapter: Path | None, label: str,
         with_base: bool, episodes_path: Path | None = None, skip: int = 0, block: str = "tuning") -> list[dict]:
    """evaluate.py's episodes (greedy, full context, held-out seeds of `block`, both seats) for one model (+ the
    base), less each game's first `skip`; each record is also appended to `episodes_path`."""
    tasks = eval_tasks(games, episodes, opponent, skip, block)
    specs = evaluate.eval_env_specs(config, {"openspiel"})
    adapter_dir = adapter_folder(adapter) if adapter else None
    records = asyncio.run(evaluate.evaluate(config, tasks, specs, adapter_dir, with_base and adapter is not None,
                                            None))
    for record in records:
        record["model"] = record["model"] if record["model"] == "base" else label
        record["block"] = block
    if episodes_path is not None:
        append_records(episodes_path, records)
    return records


def append_records(path: Path, records: list[dict]) -> None:
    with open(path, "a") as sink:
        sink.writelines(json.dumps(record) + "\n" for record in records)


def split_source(source: str) -> tuple[str, str, str]:
    """`--tables-from`'s FILE or FILE:OLD=NEW as (FILE, OLD, NEW); OLD and NEW are empty for a bare FILE."""
    path, _, rename = source.partition(":")
    old, _, new = rename.partition("=")
    return path, old, new


def merged_records(sources: list[str]) -> list[dict]:
    """The episode records of earlier runs' eval-<opponent>.jsonl files, FILE or FILE:OLD=NEW (model OLD
    relabelled NEW); a later file's record of the same model, game, task, seed and opponent replaces an earlier's.
    Files of both evaluation blocks are refused together: their seeds never pair, and one table is one block."""
    merged: dict[tuple, dict] = {}
    blocks: dict[str, str] = {}
    for source in sources:
        path, old, new = split_source(source)
        opponent = Path(path).stem.removeprefix("eval-")  # records from before 'opponent' was in each of them
        for line in Path(path).read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                record.setdefault("opponent", opponent)
                record.setdefault("block", "tuning")  # records from before there were two blocks
                blocks.setdefault(record["block"], path)
                if len(blocks) > 1:
                    sys.exit(f"--tables-from: {blocks['tuning']} holds tuning-block episodes and "
                             f"{blocks['confirmation']} confirmation-block ones; give one block's files")
                if old and record["model"] == old:
                    record["model"] = new
                key = (record["model"], record["game"], record["task_id"], record["seed"], record["opponent"])
                merged[key] = record
    return list(merged.values())


def print_tables_from(sources: list[str], args: argparse.Namespace) -> None:
    """`--tables-from`: one table over earlier runs' recorded episodes (e.g. a model's first 64 seeds and a
    later --eval-skip 64 run of the rest), with each model's paired differences sized."""
    records = merged_records(sources)
    results, rows = {}, []
    for opponent in sorted({r["opponent"] for r in records}):
        played = [r for r in records if r["opponent"] == opponent]
        results[opponent], opponent_rows = table(played, opponent, table_order({r["model"] for r in played}))
        rows += opponent_rows
    moves = None
    if args.teacher_moves:
        moves = teacher_moves(records, args, load_config(presets=["cpu"], overrides=[*opponent_overrides(args),
                                                                                    *args.set]))
    print(json.dumps({"sources": sources, "results": results, "teacher_moves": moves}, indent=1))
    print_table(rows, results)
    if moves:
        print_teacher_moves(moves)


def table_order(models: set[str]) -> list[str]:
    """Model labels in the tables' order: the bench's own rows first, then other labels by name."""
    known = (*MODELS, "ppo", "ceiling")
    return [m for m in known if m in models] + sorted(models - set(known))


def print_table(rows: list[str], results: dict) -> None:
    """The markdown table, then per paired difference: how many pairs differ, and how many would decide it."""
    print("\n| game | opponent | model | legal-move rate [95% CI] | mean score [95% CI] | score - base [95% CI] "
          "| score - SFT [95% CI] |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for opponent, games in results.items():
        for game, by_model in games.items():
            for model, row in by_model.items():
                for baseline in ("base", "sft"):
                    pairs = row.get(f"score_minus_{baseline}_pairs")
                    if pairs:
                        needed = row[f"score_minus_{baseline}_pairs_to_decide"]
                        print(f"{game} vs {opponent}, {model} - {baseline}: {row[f'score_minus_{baseline}_changed']} "
                              f"of {pairs} pairs scored differently; "
                              + (f"{needed} pairs with this mean and spread decide it" if needed else
                                 "a mean difference of 0: no number of pairs decides it"))


def teacher_moves(records: list[dict], args: argparse.Namespace, config) -> dict:
    """`--teacher-moves`: per opponent, game and model, at how many of its turns the model played its teacher's
    move. Each recorded game is replayed with the teacher answering at every turn (sft_warmstart's DAgger
    replay: same task, seed and opponent), so a student that never leaves one move shows as a rate a score
    hides. Games without a teacher, and rows without conversations (teachers, ceiling), are left out."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if isinstance(r.get("conversation"), list) and not r.get("error") and has_expert(r["game"]):
            groups.setdefault((r["opponent"], r["game"], r["model"]), []).append(r)
    rank = {model: i for i, model in enumerate(table_order({model for *_, model in groups}))}
    keys = sorted(groups, key=lambda key: (*key[:2], rank[key[2]]))
    # every group's games replayed in one pool
    sources = [{**r, "source": f"{model}'s {game} game (task {r['task_id']}, seed {r['seed']})"}
               for opponent, game, model in keys for r in groups[(opponent, game, model)]]
    try:
        # each game's teacher (--experts) at its default budget, ID-only replies, every turn kept
        teachers = WarmStartConfig.from_options(experts=args.expert_choices, workers=args.workers)
        per_game = iter(relabel_each(sources, teachers, expert_play.OpponentSetup.of(config), "--teacher-moves"))
    except ConfigError as exc:
        sys.exit(str(exc))
    result: dict = {}
    for opponent, game, model in keys:
        played = groups[(opponent, game, model)]
        relabelled = [record for _ in played for record in next(per_game)]
        matched, turns = expert_moves_played(played, relabelled)
        result.setdefault(opponent, {}).setdefault(game, {})[model] = {
            "teacher": expert_kind(game, args.expert_choices), "turns": turns, "teacher_moves": matched,
            "rate": matched / turns if turns else None, "ci95": list(report.wilson_interval(matched, turns))}
    return result


def print_teacher_moves(moves: dict) -> None:
    print("\n| game | opponent | model | teacher | teacher's move played [95% CI] | turns |")
    print("|---|---|---|---|---|---|")
    for opponent, games in moves.items():
        for game, by_model in games.items():
            for model, row in by_model.items():
                print(f"| {game} | {opponent} | {model} | {row['teacher']} | {_ci(row['rate'], row['ci95'])} "
                      f"| {row['turns']} |")


def expert_records(games: list[str], episodes: dict[str, int], opponent: str, config, workers: int,
                   experts: dict[str, str], label: str = "expert", skip: int = 0, block: str = "tuning") -> list[dict]:
    """The experts themselves on the same tasks and seeds, as evaluation records labelled `label`, against the
    opponent the models' rows meet: `config`'s game env (its MCTS budgets, search and file of recorded moves)
    and model.cache_dir (where the best response keeps its opponent model)."""
    setup = expert_play.OpponentSetup.of(config)
    expert_play.warn_teachers_aimed_elsewhere(games, experts, opponent)
    jobs = [expert_play.ExpertJob(game_name_of(t.task_id), t.task_id, t.seed, opponent,
                                  expert_play.Teacher.for_game(game_name_of(t.task_id), experts), setup)
            for t in eval_tasks(games, episodes, opponent, skip, block)]
    played = expert_play.generate(jobs, workers, None)
    return [{"model": label, "game": r["game"], "task_id": r["task_id"], "seed": r["seed"], "opponent": opponent,
             "block": block,
             "llm_player_id": r["llm_player_id"], "score": r["score"],
             "outcome": "win" if r["score"] > 0.5 else "draw" if r["score"] == 0.5 else "loss",
             "turns": sum(m["role"] == "assistant" for m in r["messages"]), "illegal_moves": 0,
             "parse_failed_game": False, "generated_tokens": 0, "error": None} for r in played]


def table(records: list[dict], opponent: str, models: list[str]) -> tuple[dict, list[str]]:
    """Per game and model: legal-move rate, mean score and paired differences to base and to SFT, with intervals."""
    summary = report.summarize(records)
    to_base = {m: report.paired_differences(records, m, "base") for m in models if m != "base"}
    to_sft = {m: report.paired_differences(records, m, "sft") for m in models if m not in ("base", "sft")}
    rows, result = [], {}
    seat_scores: dict[tuple, list[float]] = {}  # (model, game, seat) -> scores; seat 0 moves first
    for r in records:
        if not r["error"] and r.get("llm_player_id") is not None:
            seat_scores.setdefault((r["model"], r["game"], r["llm_player_id"]), []).append(r["score"])
    for game in sorted({r["game"] for r in records}):
        for model in models:
            s = summary.get(model, {}).get(game)
            if s is None:
                continue
            base_pair = to_base.get(model, {}).get(game)
            sft_pair = to_sft.get(model, {}).get(game)
            legal = None if s["illegal_rate"] is None else 1 - s["illegal_rate"]
            legal_ci = None if s["illegal_rate_ci95"] is None else [1 - s["illegal_rate_ci95"][1],
                                                                    1 - s["illegal_rate_ci95"][0]]
            seats = sorted(seat for m, g, seat in seat_scores if (m, g) == (model, game))
            result.setdefault(game, {})[model] = {
                "episodes": s["episodes"], "errors": s["errors"], "legal_move_rate": legal, "legal_ci95": legal_ci,
                "mean_score": s["mean_score"], "score_ci95": s["score_ci95"],
                "score_by_seat": {seat: sum(seat_scores[model, game, seat]) / len(seat_scores[model, game, seat])
                                  for seat in seats},
                "episodes_by_seat": {seat: len(seat_scores[model, game, seat]) for seat in seats},
                "score_minus_base": base_pair and base_pair["score_diff"],
                "score_minus_base_ci95": base_pair and base_pair["score_diff_ci95"],
                "score_minus_sft": sft_pair and sft_pair["score_diff"],
                "score_minus_sft_ci95": sft_pair and sft_pair["score_diff_ci95"],
                **{f"score_minus_{name}_{key}": pair and pair[key]
                   for name, pair in (("base", base_pair), ("sft", sft_pair))
                   for key in ("pairs", "changed", "pairs_to_decide")},
            }
            cells = [_ci(pair and pair["score_diff"], pair and pair["score_diff_ci95"], signed=True)
                     for pair in (base_pair, sft_pair)]
            rows.append(f"| {game} | {opponent} | {model} | {_ci(legal, legal_ci)} | "
                        f"{_ci(s['mean_score'], s['score_ci95'])} | {cells[0]} | {cells[1]} |")
    return result, rows


def training_signal(metrics_path: Path) -> dict:
    """How PPO's updates moved each reply's log-probability against its advantage, per step and overall."""
    steps = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    corr = [m["signal/advantage_logprob_corr"] for m in steps if "signal/advantage_logprob_corr" in m]
    return {"advantage_logprob_corr_by_step": [round(c, 3) for c in corr],
            "advantage_logprob_corr_mean": round(sum(corr) / len(corr), 3) if corr else None,
            "steps_with_positive_corr": sum(c > 0 for c in corr)}


def parse_simulations(text: str) -> int | dict[str, int]:
    """'300' (every game) or 'liars_dice=300,leduc_poker=1000' (the games named; the others keep the env's)."""
    if "=" not in text:
        return int(text)
    budgets = {}
    for item in text.split(","):
        game, _, number = item.partition("=")
        budgets[game.strip()] = int(number)
    return budgets


def has_mcts_opponent(game: str) -> bool:
    """False where the env plays a uniform random opponent whatever the opponent setting (goofspiel,
    as in Affine's env): `mcts` episodes there would repeat the random ones."""
    from ppo_affine.envs.games import GAMES
    from ppo_affine.envs.openspiel_episode import has_search_opponent, load_game

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


VALIDATOR_GAMES = "leduc_poker,liars_dice,goofspiel,gin_rummy"
PROFILES = {
    "random": {"games": "goofspiel,leduc_poker", "opponents": "random", "train_opponent": "random",
               "max_new_tokens": 40, "eval_episodes": "16", "sft_episodes": "32", "sft_reason": "*",
               "mcts_simulations": "300"},
    "validator": {"games": VALIDATOR_GAMES, "opponents": "mcts", "train_opponent": "mcts", "steps": 20,
                  "max_new_tokens": 6, "eval_episodes": "32,goofspiel=16,gin_rummy=4",
                  "sft_episodes": "48,goofspiel=16,gin_rummy=4",
                  "sft_reason": "", "experts": "leduc_poker=best_response,liars_dice=true_bids",
                  "game_weights": "gin_rummy=0.05"},
    "ci": {"games": VALIDATOR_GAMES, "opponents": "mcts", "train_opponent": "mcts", "steps": 1,
           "max_new_tokens": 4, "eval_episodes": "2", "sft_episodes": "2", "sft_reason": "",
           "mcts_simulations": "20", "experts": "liars_dice=true_bids", "sft_epochs": 1},
}
MODELS = ("base", "sft", "sft+ppo", "expert")
CEILING_EXPERTS = {"leduc_poker": "best_response"}  # the best response to the MCTS opponent: the most one can score


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="random",
                        help="defaults for the flags below (module docstring)")
    parser.add_argument("--games", help="comma-separated games")
    parser.add_argument("--steps", type=int, help="PPO steps (random: 4 after a warm start, 10 without; validator: "
                        "20); 0 with a warm start: no PPO, the SFT rows alone (--models without sft+ppo)")
    parser.add_argument("--game-weights",
                        help="GAME=W,...: a game's share of the PPO episodes relative to 1 for the others")
    parser.add_argument("--experts", help="GAME=KIND,...: teachers other than a game's default (sft_warmstart --expert)")
    parser.add_argument("--max-new-tokens", type=int, help="reply length (random: 40, room for a short reason)")
    parser.add_argument("--eval-episodes", help="per game and opponent, both seats: N, or N then GAME=M items")
    parser.add_argument("--eval-skip", type=int, default=0, metavar="N",
                        help="leave out each game's first N of those episodes: extends an earlier run's evaluation "
                        "on new seeds (episode i's seed does not depend on the count)")
    parser.add_argument("--eval-block", choices=sorted(EVALUATION_BLOCKS), default="tuning",
                        help="which held-out seeds judge the models: the tuning block (compare recipes on it) or the "
                        "confirmation block (judge a chosen recipe once, on seeds no choice has seen)")
    parser.add_argument("--opponents", help="comma-separated evaluation opponents: random, mcts")
    parser.add_argument("--train-opponent", choices=["random", "mcts"],
                        help="the opponent PPO trains against and the SFT data's expert games meet")
    parser.add_argument("--train-seat", type=int, choices=[0, 1],
                        help="PPO plays only this seat (0 = moves first); evaluation still plays both")
    parser.add_argument("--mcts-simulations", type=parse_simulations,
                        help="the MCTS opponent's simulations in SFT data, training and evaluation: a number, or "
                        "'game=N,...' for the games named (the others keep the validators' budget)")
    parser.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True,
                        help="SFT on expert play first, PPO from its adapter; SFT and expert rows in the table")
    parser.add_argument("--models",
                        help="rows to evaluate (default all): " + ",".join(MODELS) + " after a warm start, base,ppo "
                        "without; e.g. sft,sft+ppo for an ablation. Only what a row plays is trained: no "
                        "SFT without sft or sft+ppo, no PPO without sft+ppo")
    parser.add_argument("--sft-episodes", help="expert episodes per game for SFT: N, or N then GAME=M items")
    parser.add_argument("--sft-epochs", type=int)
    parser.add_argument("--sft-batch-size", type=int, default=4, help="conversations per SFT optimizer step")
    parser.add_argument("--sft-learning-rate", type=float, default=1e-3)
    parser.add_argument("--goofspiel-expert", choices=GOOFSPIEL_EXPERTS,
                        help=f"the goofspiel expert for SFT data and the expert rows (default {DEFAULT_GOOFSPIEL_EXPERT})")
    parser.add_argument("--sft-reason", nargs="?", const="*", metavar="GAMES",
                        help="SFT replies '<think>reason</think>ID' (sft_warmstart --reason) in every game, or only in "
                        f"the comma-separated GAMES; replies get at least {REASON_REPLY_TOKENS} "
                        "tokens unless --max-new-tokens says otherwise")
    parser.add_argument("--no-sft-reason", dest="sft_reason", action="store_const", const="",
                        help="every SFT reply is the ID alone")
    parser.add_argument("--sft-explore", type=float, default=0.0, metavar="P",
                        help="chance that a turn of an SFT expert game is a random legal move, not trained on "
                        "(sft_warmstart --explore)")
    parser.add_argument("--sft-openings", metavar="N",
                        help="more SFT expert episodes per game cut after the expert's first reply: N, or N then "
                        "GAME=M items (sft_warmstart --openings)")
    parser.add_argument("--sft-checkpoint", type=Path,
                        help="with --warm-start: start PPO from this SFT checkpoint instead of training one")
    parser.add_argument("--sft-dagger-rounds", type=int, default=0, metavar="N",
                        help="after the SFT (or from --sft-checkpoint), N DAgger rounds against the training "
                        "opponent (sft_warmstart --dagger-rounds); the last round's adapter is the SFT row")
    parser.add_argument("--sft-dagger-episodes", default="128", metavar="N",
                        help="games per game and DAgger round: N, or N then GAME=M items (sft_warmstart "
                        "--dagger-episodes)")
    parser.add_argument("--sft-dagger-data", type=Path, metavar="FILE",
                        help="with --sft-checkpoint: expert conversations (e.g. that student's sft_data.jsonl) every "
                        "DAgger round trains on beside its relabelled games (sft_warmstart --dagger-data)")
    parser.add_argument("--sft-dagger-aggregate", choices=DAGGER_AGGREGATES,
                        help="what each DAgger round trains on beside its relabelled games: the SFT's data (sft, "
                        "the default) or also every earlier round's relabelled games (all; sft_warmstart "
                        "--dagger-aggregate)")
    parser.add_argument("--workers", type=int, default=2, help="processes playing expert episodes")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench-learning"),
                        help=f"cleared at start if this bench made it (its {OUTPUT_MARKER} file), made if new or "
                        "empty; any other folder is refused")
    parser.add_argument("--set", action="append", default=[], help="extra train_ppo --set overrides")
    parser.add_argument("--teacher-moves", action="store_true",
                        help="also replay every evaluated game with its game's teacher (--experts) answering at each "
                        "turn, and print at how many of its turns each model played the teacher's move (with "
                        "--tables-from too; costs the opponent's searches again)")
    parser.add_argument("--tables-from", nargs="+", metavar="FILE[:OLD=NEW]",
                        help="train and play nothing: print the table of earlier runs' eval-<opponent>.jsonl files "
                        "together (a later file's episode replaces an earlier one's); :OLD=NEW relabels model OLD")
    args = parser.parse_args(argv)
    for source in args.tables_from or []:
        path, old, new = split_source(source)
        if not Path(path).is_file() or (":" in source and not (old and new)):
            parser.error(f"--tables-from: expected FILE or FILE:OLD=NEW with an existing FILE, got {source!r}")
    games = (args.games or PROFILES[args.profile]["games"]).split(",")
    tokens_given = args.max_new_tokens is not None
    steps_given = args.steps is not None
    for name, value in PROFILES[args.profile].items():
        if getattr(args, name, None) is None:
            if name in ("experts", "game_weights") or (name == "sft_reason" and value != "*"):
                # a profile's items for games left out of this run go
                value = ",".join(item for item in value.split(",") if item.split("=")[0] in games)
            setattr(args, name, parse_simulations(value) if name == "mcts_simulations" else value)
    args.sft_epochs = 2 if args.sft_epochs is None else args.sft_epochs
    try:
        args.reason_games = sorted(parse_reason_games(args.sft_reason, games))
        if args.reason_games and not tokens_given:
            args.max_new_tokens = max(args.max_new_tokens, REASON_REPLY_TOKENS)
        args.eval_counts = parse_game_counts(args.eval_episodes, "--eval-episodes")
        args.sft_counts = parse_game_counts(args.sft_episodes, "--sft-episodes")
        args.opening_counts = parse_game_counts(args.sft_openings or "0", "--sft-openings")
        args.expert_choices = parse_experts(args.experts or "")
        weights = parse_experts(args.game_weights or "")
        args.weights = {game: float(weight) for game, weight in weights.items()}
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    if args.goofspiel_expert:
        args.expert_choices["goofspiel"] = args.goofspiel_expert
    unknown = [g for g in [*args.expert_choices, *args.weights] if g not in games]
    if unknown:
        parser.error(f"--experts/--game-weights name games not in this run: {unknown}")
    named_rows = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    if args.warm_start and named_rows is not None and "sft+ppo" not in named_rows:
        # no row plays the PPO adapter: its steps would cost their minutes for nothing
        if steps_given and args.steps > 0:
            parser.error(f"--steps {args.steps} trains a PPO adapter that no row of --models {args.models} plays; "
                         "add sft+ppo to --models or leave --steps out")
        args.steps = 0
    if args.steps is None:
        args.steps = 4 if args.warm_start else 10
    if args.steps < (0 if args.warm_start else 1):
        parser.error(f"--steps must be at least {0 if args.warm_start else 1}, got {args.steps}")
    allowed = MODELS if args.warm_start else ("base", "ppo")
    if args.steps == 0:
        allowed = tuple(m for m in allowed if m != "sft+ppo")
    args.model_rows = named_rows if named_rows is not None else list(allowed)
    unknown = [m for m in args.model_rows if m not in allowed]
    if unknown:
        parser.error(f"--models: {unknown} are not rows of this run; expected some of {','.join(allowed)}")
    # a student is trained only for a row that plays it (sft, or sft+ppo started from it): the teacher's row
    # alone (`--models expert`) would otherwise wait half an hour for an SFT nothing uses
    args.train_sft = args.warm_start and bool({"sft", "sft+ppo"} & set(args.model_rows))
    too_few = [g for g in games if count(args.eval_counts, g) <= args.eval_skip]
    if args.eval_skip < 0 or too_few:
        parser.error(f"--eval-skip must be at least 0 and below each game's --eval-episodes, got {args.eval_skip} "
                     f"(games with no episodes left: {too_few})")
    if args.sft_dagger_rounds < 0 or (args.sft_dagger_rounds and not args.warm_start):
        parser.error(f"--sft-dagger-rounds must be at least 0, and needs --warm-start; got {args.sft_dagger_rounds}")
    if args.sft_dagger_rounds and not args.train_sft:
        parser.error(f"--sft-dagger-rounds {args.sft_dagger_rounds} trains a student that no row of --models "
                     f"{args.models} plays; add sft or sft+ppo to --models or leave the rounds out")
    if args.sft_dagger_data is not None and not (args.sft_dagger_rounds and args.sft_checkpoint):
        parser.error("--sft-dagger-data needs --sft-dagger-rounds and --sft-checkpoint (an SFT run here keeps its "
                     f"own expert games in every round); got {args.sft_dagger_data}")
    if args.sft_dagger_aggregate is not None and not args.sft_dagger_rounds:
        parser.error(f"--sft-dagger-aggregate needs --sft-dagger-rounds; got {args.sft_dagger_aggregate}")
    if args.sft_dagger_data is not None and not args.sft_dagger_data.is_file():
        parser.error(f"--sft-dagger-data: no such file {args.sft_dagger_data}")
    if not 0 <= args.sft_explore < 1:
        parser.error(f"--sft-explore must be in [0, 1), got {args.sft_explore}")
    if args.sft_checkpoint is not None and not (args.warm_start and (args.sft_checkpoint / "adapter").is_dir()):
        parser.error(f"--sft-checkpoint needs --warm-start and a checkpoint folder with adapter/: "
                     f"{args.sft_checkpoint}")
    for option, path in (("--sft-checkpoint", args.sft_checkpoint), ("--sft-dagger-data", args.sft_dagger_data)):
        if path is not None and args.output_dir.resolve() in path.resolve().parents:
            parser.error(f"{option} lies inside --output-dir, which the bench clears first: {path}")
    return args


def run_overrides(args: argparse.Namespace, games: list[str]) -> list[str]:
    """The config overrides SFT, PPO and evaluation share, the user's `--set` items last so that they win."""
    overrides = [*TRAIN_OVERRIDES, f"generation.max_new_tokens={args.max_new_tokens}", *opponent_overrides(args)]
    overrides += [item for game in games for item in GAME_OVERRIDES.get(game, [])]
    return overrides + args.set


def opponent_overrides(args: argparse.Namespace) -> list[str]:
    """One MCTS strength for SFT data, training, evaluation and the teachers' rows (default: the validators');
    random opponents ignore it."""
    if args.mcts_simulations is None:
        return []
    return [f"env.envs.openspiel.mcts_simulations={json.dumps(args.mcts_simulations)}"]


def claim_output_dir(folder: Path) -> None:
    """`folder` emptied for this run and marked as the bench's: one the bench made earlier (its OUTPUT_MARKER inside)
    is cleared, a new or empty one is made; any other folder is refused, before anything runs or is touched."""
    marker = folder / OUTPUT_MARKER
    if marker.is_file():
        shutil.rmtree(folder)
    elif folder.exists() and not (folder.is_dir() and not any(folder.iterdir())):
        sys.exit(f"--output-dir {folder} exists and was not made by this bench (no {OUTPUT_MARKER} file in it), which "
                 "clears its output folder at start: give a new or empty folder, or delete this one yourself")
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text("bench/learning.py made this folder and clears it when a run names it as --output-dir\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tables_from:
        print_tables_from(args.tables_from, args)
        return
    games = args.games.split(",")
    opponents = args.opponents.split(",")
    overrides = run_overrides(args, games)
    claim_output_dir(args.output_dir)
    timings: dict[str, float] = {}
    variants = eval_variants(games, args.eval_counts)

    sft_checkpoint = args.sft_checkpoint
    if args.train_sft and (sft_checkpoint is None or args.sft_dagger_rounds):
        started = time.perf_counter()
        every_variant = sorted({c for ids in variants.values() for c in ids})
        # from a given checkpoint only the DAgger rounds run
        start = ["--episodes", "0", "--init-adapter", str(sft_checkpoint)] if sft_checkpoint else [
            "--episodes", args.sft_episodes]
        sft_args = ["--preset", "cpu", "--games", ",".join(games), *start,
                    "--config-ids", ",".join(map(str, every_variant)),
                    "--expert", ",".join(f"{g}={k}" for g, k in args.expert_choices.items()),
                    "--opponent", args.train_opponent, "--epochs", str(args.sft_epochs), "--workers", str(args.workers),
                    "--batch-size", str(args.sft_batch_size), "--learning-rate", str(args.sft_learning_rate),
                    "--output-dir", str(args.output_dir / "sft"),
                    *(["--reason", ",".join(args.reason_games)] if args.reason_games else []),
                    *(["--explore", str(args.sft_explore)] if args.sft_explore else []),
                    *(["--openings", args.sft_openings] if args.sft_openings else []),
                    *(["--dagger-rounds", str(args.sft_dagger_rounds), "--dagger-episodes", args.sft_dagger_episodes]
                      if args.sft_dagger_rounds else []),
                    *(["--dagger-data", str(args.sft_dagger_data)] if args.sft_dagger_data else []),
                    *(["--dagger-aggregate", args.sft_dagger_aggregate] if args.sft_dagger_aggregate else [])]
        for override in overrides:
            sft_args += ["--set", override]
        if sft_warmstart.main(sft_args) != 0:
            sys.exit("warm start failed")
        last_round = f"dagger-{args.sft_dagger_rounds}" if args.sft_dagger_rounds else ""
        sft_checkpoint = find_resumable(args.output_dir / "sft" / last_round / "checkpoints")
        timings["sft_seconds"] = time.perf_counter() - started
    trained, curves, metrics_path = None, [], args.output_dir / "ppo" / "metrics.jsonl"
    if args.steps:
        started = time.perf_counter()
        trained = train(games, args.steps, args.output_dir, overrides, sft_checkpoint, args.train_opponent, variants,
                        args.weights, args.train_seat)
        timings["ppo_seconds"] = time.perf_counter() - started
        curves = [str(path) for path in visualize.plot_run(metrics_path, args.output_dir / "plots")]

    # every model meets the same seeds: each records the opponent's moves that the next replays where games repeat
    moves_file = f"env.envs.openspiel.opponent_moves={json.dumps(str(args.output_dir / 'opponent-moves.sqlite'))}"
    config = load_config(presets=["cpu"], overrides=[moves_file, *overrides, "generation.temperature=0"])
    trained_label = "sft+ppo" if args.warm_start else "ppo"
    models = [m for m in (MODELS if args.warm_start else ("base", "ppo")) if m in args.model_rows]
    results, rows, ceilings, evaluated = {}, [], {}, []
    timings["eval_seconds"] = timings["teacher_seconds"] = 0.0
    for opponent in opponents:
        # a game whose opponent is random whatever is asked (goofspiel) plays once when both opponents are evaluated
        played = [g for g in games if opponent == "random" or "random" not in opponents or has_mcts_opponent(g)]
        if not played:
            continue
        episodes_path = args.output_dir / f"eval-{opponent}.jsonl"
        records = []
        started = time.perf_counter()
        if trained_label in models:
            records += play(config, played, args.eval_counts, opponent, trained, trained_label,
                            with_base="base" in models, episodes_path=episodes_path, skip=args.eval_skip,
                            block=args.eval_block)
        elif "base" in models:
            records += play(config, played, args.eval_counts, opponent, None, "base", with_base=False,
                            episodes_path=episodes_path, skip=args.eval_skip, block=args.eval_block)
        if sft_checkpoint is not None and "sft" in models:
            records += play(config, played, args.eval_counts, opponent, sft_checkpoint, "sft", with_base=False,
                            episodes_path=episodes_path, skip=args.eval_skip, block=args.eval_block)
        timings["eval_seconds"] += time.perf_counter() - started
        started = time.perf_counter()
        if args.warm_start and "expert" in models:
            experts_played = expert_records(played, args.eval_counts, opponent, config, args.workers,
                                            args.expert_choices, skip=args.eval_skip, block=args.eval_block)
            append_records(episodes_path, experts_played)
            records += experts_played
        table_models = list(models)
        if opponent == "mcts":
            ceiling = ceiling_records(played, args, records, config)
            append_records(episodes_path, ceiling)
            records += ceiling
            table_models += sorted({r["model"] for r in records if r["model"] == "ceiling"})
        timings["teacher_seconds"] += time.perf_counter() - started
        results[opponent], opponent_rows = table(records, opponent, table_models)
        rows += opponent_rows
        evaluated += records
        for game, row in results[opponent].items():
            if "ceiling" in row and row.get(trained_label) and row["ceiling"]["mean_score"]:
                ceilings[f"{game}_{trained_label}_over_best_response_vs_{opponent}"] = round(
                    row[trained_label]["mean_score"] / row["ceiling"]["mean_score"], 3)
    if "leduc_poker" in games and "random" in opponents:
        ceilings["leduc_poker_best_mean_score_vs_random"] = round(leduc_best_response_vs_random(), 4)
    moves = None
    if args.teacher_moves:
        started = time.perf_counter()
        moves = teacher_moves(evaluated, args, config)
        timings["teacher_moves_seconds"] = time.perf_counter() - started
    print(json.dumps({"model": "SmolLM2-135M-Instruct (cpu preset)", "profile": args.profile, "games": games,
                      "ppo_steps": args.steps, "train_opponent": args.train_opponent, "train_seat": args.train_seat,
                      "variants": variants,
                      "game_weights": args.weights,
                      "train_episodes": args.steps * config.train.ppo.batch_size, "max_new_tokens": args.max_new_tokens,
                      "ppo_presets": ["cpu", WARM_START_PRESET] if args.warm_start else ["cpu"],
                      "ppo_overrides": overrides, "extra_overrides": args.set,
                      "eval_episodes_per_game": args.eval_counts, "eval_skip": args.eval_skip,
                      "eval_block": args.eval_block,
                      "mcts_simulations": game_env(config).mcts_simulations,
                      "opponent_search": game_env(config).opponent_search,
                      "experts": {g: expert_kind(g, args.expert_choices) for g in games if has_expert(g)},
                      "sft": sft_settings(args, sft_checkpoint),
                      "checkpoint": str(trained) if trained else None,
                      "minutes": {k.replace("_seconds", ""): round(v / 60, 1) for k, v in timings.items()},
                      "total_minutes": round(sum(timings.values()) / 60, 1),
                      "signal": training_signal(metrics_path) if trained else None, "curves": curves,
                      "ceilings": ceilings, "results": results, "teacher_moves": moves}, indent=1))
    print_table(rows, results)
    if moves:
        print_teacher_moves(moves)


def sft_settings(args: argparse.Namespace, sft_checkpoint: Path | None) -> dict | None:
    """The JSON's account of the student: a given checkpoint or the SFT recipe, then any DAgger rounds."""
    if not args.train_sft:
        return None
    settings = ({"checkpoint": str(args.sft_checkpoint)} if args.sft_checkpoint else
                {"episodes_per_game": args.sft_counts, "epochs": args.sft_epochs, "opponent": args.train_opponent,
                 "reason": args.reason_games, "explore": args.sft_explore, "openings_per_game": args.opening_counts,
                 "batch_size": args.sft_batch_size, "learning_rate": args.sft_learning_rate})
    if args.sft_dagger_rounds:
        settings |= {"dagger_rounds": args.sft_dagger_rounds, "dagger_episodes": args.sft_dagger_episodes,
                     "dagger_aggregate": args.sft_dagger_aggregate or DAGGER_AGGREGATES[0],
                     "dagger_checkpoint": str(sft_checkpoint)}
        if args.sft_dagger_data:
            settings["dagger_data"] = str(args.sft_dagger_data)
    return settings


def ceiling_records(games: list[str], args: argparse.Namespace, records: list[dict], config) -> list[dict]:
    """The best response's own games vs MCTS where one is known (leduc_poker): the teacher's records when
    the teacher is that best response, else played on the same tasks against `config`'s opponent."""
    ceiling = []
    for game, kind in CEILING_EXPERTS.items():
        if game not in games:
            continue
        if has_expert(game) and expert_kind(game, args.expert_choices) == kind:
            ceiling += [{**r, "model": "ceiling"} for r in records if r["model"] == "expert" and r["game"] == game]
        else:
            ceiling += expert_records([game], args.eval_counts, "mcts", config, args.workers, {game: kind},
                                      label="ceiling", skip=args.eval_skip, block=args.eval_block)
    return ceiling


def has_expert(game: str) -> bool:
    return bool(expert_choices(game))


if __name__ == "__main__":
    main()
