"""Warm start from expert play: expert episodes in the env's evaluate() conversation, then supervised
fine-tuning of the LoRA adapter on the expert's replies, written as a checkpoint PPO starts from.

1. Generate: for every game, `--episodes` episodes against the env's opponent, both seats (seed
   parity), the model's moves chosen by the game's expert (experts.py: CFR+ for leduc_poker, MCTS
   for sequential games, prize matching or Monte Carlo search for goofspiel). Every core plays
   episodes; the conversations go to `sft_data.jsonl` in the shape `logging.log_samples_every` writes.
   `--explore P` makes a P share of the turns random legal moves, which stay in the conversation
   untrained: the expert's later replies show how to recover from a slip. `--openings N` adds N
   episodes per game cut after the expert's first reply: more of the decision that decides short
   games (a liars_dice opening bid) at the cost of one prompt each. `--relabel FILE` adds DAgger data:
   games a model played (evaluate.py's episodes.jsonl) replayed with the expert answering at every turn,
   so SFT also sees the expert's move at the states the student's own play reaches.
   `--dagger-rounds N` does that N times after the SFT: the newest adapter plays `--dagger-episodes`
   games of each game greedily on seeds of their own (as evaluate.py plays), the expert relabels them,
   and SFT goes on from that adapter on them beside what this call's SFT trained on and `--dagger-data`'s
   conversations, which hold the turns the student already plays in place (`--dagger-aggregate all`:
   and every earlier round's relabelled games, DAgger's full aggregate); each round's games, records and
   checkpoint go to `dagger-<round>/`, its student's score and expert agreement to `dagger.jsonl`.
2. Train: each conversation becomes token sequences exactly as a rollout builds them (the chat
   template, the configured context strategy, continued sequences); the loss is the mean negative
   log-likelihood of the assistant tokens (EOS included), everything else masked. `--init-adapter
   CHECKPOINT` trains that adapter on (more epochs) instead of a fresh LoRA.
3. Save `checkpoints/checkpoint-<optimizer steps>` (adapter + a zero value head).

Run:  python sft_warmstart.py --preset cpu --games leduc_poker,goofspiel --episodes 200
      python train_ppo.py --preset cpu --preset warm_start --init-adapter runs/sft-warmstart/checkpoints/checkpoint-50
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import time
import uuid
from concurrent.futures import ProcessPoolExecutor, as_completed
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_affine.run_log import console, report_failure, rollout_progress, setup_logging
from ppo_affine.config import DEFAULT_CACHE_DIR, ConfigError, EnvSpec, derive_seed
from utils import add_config_arguments, config_from_arguments, program_parser

log = logging.getLogger("sft_warmstart")

DEFAULT_GAMES = "leduc_poker,liars_dice,goofspiel"
DATA_FILE = "sft_data.jsonl"
RELABEL_FILE = "relabelled.jsonl"  # --relabel's records
DAGGER_LOG = "dagger.jsonl"  # one line per --dagger-rounds round
# what check_args and main load or derive from the files the options name: checkpoints keep the options, not the data
LOADED = ("played", "dagger_records", "dagger_expert_records")
SFT_STATE_KIND = "sft-warmstart"
DAGGER_AGGREGATES = ("sft", "all")  # --dagger-aggregate: what rounds keep; the first is the default


@dataclass(frozen=True)
class ExpertJob:
    game: str
    kind: str  # experts.KINDS
    task_id: int
    seed: int
    opponent: str
    budget: int  # MCTS simulations, or Monte Carlo playouts per bid
    cfr_iterations: int
    with_reason: bool
    opponent_simulations: int | None = None
    opponent_search: str = "fast"  # the MCTS opponent's implementation (openspiel_episode.SEARCHES)
    cache_dir: str = DEFAULT_CACHE_DIR  # where the best-response expert keeps its opponent model
    explore: float = 0.0  # chance that a turn plays a uniformly random legal move (not trained on)
    max_replies: int | None = None  # the record ends after this many expert replies (None: the whole game)
    opponent_moves: str | None = None  # a file of recorded opponent moves to replay (EnvSpec.opponent_moves)


# MCTS simulations / playouts per bid / unused (the other experts)
DEFAULT_BUDGET = {"mcts": 300, "montecarlo": 20, "cfr": 0, "best_response": 0, "true_bids": 0, "count_bids": 0,
                  "prize": 0, "simple_gin": 0}


def expert_job(game: str, task_id: int, seed: int, opponent: str, budget: int | None = None,
               cfr_iterations: int = 300, with_reason: bool = False,
               opponent_simulations: int | None = None, *, experts: dict[str, str] | None = None,
               opponent_search: str = "fast", cache_dir: str = DEFAULT_CACHE_DIR,
               explore: float = 0.0, max_replies: int | None = None, opponent_moves: str | None = None) -> ExpertJob:
    """`experts`: game -> expert kind for the games that do not play their default expert."""
    from ppo_affine.experts import expert_kind

    kind = expert_kind(game, experts)
    return ExpertJob(game, kind, task_id, seed, opponent, budget or DEFAULT_BUDGET[kind], cfr_iterations,
                     with_reason, opponent_simulations, opponent_search, cache_dir, explore, max_replies,
                     opponent_moves)


def warn_teachers_aimed_elsewhere(games: list[str], experts: dict[str, str] | None, opponent: str) -> None:
    """One warning when a game's teacher is aimed at the MCTS opponent (experts.AIMED_AT_MCTS) but meets another."""
    from ppo_affine.experts import AIMED_AT_MCTS, expert_choices, expert_kind

    if opponent == "mcts":
        return
    aimed = [f"{game}={kind}" for game in games
             if expert_choices(game) and (kind := expert_kind(game, experts)) in AIMED_AT_MCTS]
    if aimed:
        log.warning("%s: teachers aimed at the MCTS opponent meet the %s one here, so their moves answer a player "
                    "that is not there (the mcts opponent, or another teacher, fits)", ", ".join(aimed), opponent)


def game_count(counts: int | dict[str, int], game: str) -> int:
    """A per-game count (`parse_game_counts`' {game: n} with "*" for the others, or one number) for `game`."""
    return counts.get(game, counts["*"]) if isinstance(counts, dict) else counts


def plan_jobs(games: list[str], episodes: int | dict[str, int], seed: int, opponent: str, config_ids: list[int],
              budget: int | None,
              cfr_iterations: int, reason_games: Collection[str],
              opponent_simulations: int | dict[str, int] | None = None, *,
              experts: dict[str, str] | None = None, opponent_search: str = "fast",
              cache_dir: str = DEFAULT_CACHE_DIR, explore: float = 0.0,
              openings: int | dict[str, int] = 0) -> list[ExpertJob]:
    """`episodes` jobs per game (one number, or {game: number} with "*" for the others) over the config ids;
    consecutive seeds alternate the model's seat. `reason_games`: the games whose replies carry a reason;
    `explore`: the chance a turn plays a random legal move instead of the expert's (`play_expert_episode`).
    `opponent_simulations` is one MCTS budget for every game or {game: budget} (unnamed games: the env's).
    `openings` (counted like `episodes`): more jobs per game, on seeds of their own, that end after the
    expert's first reply and play no random moves."""
    from ppo_affine.envs.tasks import game_task_id

    def simulations(game: str) -> int | None:
        return opponent_simulations.get(game) if isinstance(opponent_simulations, dict) else opponent_simulations

    def job(game: str, i: int, stream: str, explore: float, max_replies: int | None) -> ExpertJob:
        return expert_job(game, game_task_id(game, config_ids[i % len(config_ids)]),
                          (derive_seed(seed, stream, game, i) & ~1) | (i % 2),  # parity = the model's seat
                          opponent, budget, cfr_iterations, game in reason_games, simulations(game),
                          experts=experts, opponent_search=opponent_search, cache_dir=cache_dir, explore=explore,
                          max_replies=max_replies)

    return ([job(game, i, "sft", explore, None) for game in games for i in range(game_count(episodes, game))]
            + [job(game, i, "sft-opening", 0.0, 1) for game in games for i in range(game_count(openings, game))])


def play_expert_episode(job: ExpertJob) -> dict[str, Any]:
    """One episode of the env's evaluate() game with the expert in the model's seat, as a conversation.

    With `job.explore` > 0 a turn plays a uniformly random legal move at that chance, and the record lists
    those replies (`explored_replies`, their places among the assistant replies): SFT does not train on
    them, but on the expert's answers from the states they lead to, which the expert's own games never
    reach (a goofspiel prize whose matching card is gone) and a student's slips do.

    With `job.max_replies` the record stops after that many expert replies, before the game ends: its
    `score` is None and `max_replies` says where it was cut."""
    import random

    from ppo_affine.envs.openspiel_episode import Episode
    from ppo_affine.experts import Expert

    episode = Episode(uuid.uuid4().hex, task_id=job.task_id, seed=job.seed, opponent=job.opponent,
                      observation_format="evaluate", max_parse_attempts=3, mcts_simulations=job.opponent_simulations,
                      opponent_search=job.opponent_search, opponent_moves=job.opponent_moves)
    expert = Expert(job.kind, episode.game, episode.player, job.seed, job.budget, job.cfr_iterations, job.cache_dir,
                    job.opponent_simulations)
    result = episode.start()
    messages = [{"role": "system", "content": episode.system_prompt},
                {"role": "user", "content": result["observation"]}]
    explorer = random.Random(derive_seed(job.seed, "explore"))
    explored = []
    while not result["done"]:
        if job.explore and explorer.random() < job.explore:
            explored.append(sum(m["role"] == "assistant" for m in messages))
            reply = str(explorer.choice(episode.legal))
        else:
            reply = expert_reply(expert, episode, job.with_reason)[1]
        messages.append({"role": "assistant", "content": reply})
        if job.max_replies is not None and sum(m["role"] == "assistant" for m in messages) == job.max_replies:
            break
        result = episode.step(reply)
        if not result["done"]:
            messages.append({"role": "user", "content": result["observation"]})
    record = {"step": 0, "env": "openspiel", "task_id": job.task_id, "seed": job.seed, "game": job.game,
              "score": episode.score if result["done"] else None, "error": None, "messages": messages,
              "expert": expert.kind, "opponent": job.opponent, "llm_player_id": episode.player,
              "explored_replies": explored}
    if job.max_replies is not None:
        record["max_replies"] = job.max_replies
    return record


@dataclass(frozen=True)
class RelabelJob:
    """One game a model played (an evaluate.py / bench episode record) to replay with an expert answering."""
    played: dict[str, Any]
    kind: str  # experts.KINDS
    budget: int
    cfr_iterations: int
    with_reason: bool
    opponent_simulations: int | None
    opponent_search: str
    cache_dir: str
    source: str  # "FILE line N", for errors
    opponent_moves: str | None = None  # the file of opponent moves its evaluation recorded: no search again


class ReplayMismatch(ValueError):
    """A played game does not replay to the same conversation (another opponent budget or search)."""


def relabel_played_episode(job: RelabelJob) -> list[dict[str, Any]]:
    """The expert's answers at the states a model's own game reached (DAgger's data): the game is replayed
    move by move (same task, seed and opponent, so the same deal and opponent moves), and at every model
    turn the expert says what it would play.

    A turn where the model played the expert's move stays trained in the whole game's record (with the
    expert's reply text); a turn where it did not becomes a record of its own, cut after the expert's
    answer (its earlier replies context only: the game's record trains them), and stays in the game's record
    as untrained context (`explored_replies`), as the model's move is what the game went on from. Each turn
    is trained once. Raises ReplayMismatch when a replayed observation differs from the one
    recorded."""
    from ppo_affine.envs.openspiel_episode import Episode
    from ppo_affine.envs.openspiel_text import parse_evaluate_action, strip_think
    from ppo_affine.experts import Expert

    played = job.played
    recorded = played["conversation"]
    episode = Episode(uuid.uuid4().hex, task_id=played["task_id"], seed=played["seed"], opponent=played["opponent"],
                      observation_format="evaluate", max_parse_attempts=3, mcts_simulations=job.opponent_simulations,
                      opponent_search=job.opponent_search, opponent_moves=job.opponent_moves)
    expert = Expert(job.kind, episode.game, episode.player, played["seed"], job.budget, job.cfr_iterations,
                    job.cache_dir, job.opponent_simulations)
    result = episode.start()
    messages = [{"role": "system", "content": episode.system_prompt},
                {"role": "user", "content": result["observation"]}]
    base = {"step": 0, "env": "openspiel", "task_id": played["task_id"], "seed": played["seed"],
            "game": episode.game_name, "error": None, "expert": expert.kind, "opponent": played["opponent"],
            "llm_player_id": episode.player, "relabelled": True}
    records, explored, replies = [], [], 0
    # the replay grows `messages` in step with the recorded conversation: message i is the recorded message i
    for position, message in enumerate(recorded):
        if message["role"] != "assistant":
            if position >= len(messages) or messages[position]["content"] != message["content"]:
                raise ReplayMismatch(f"{job.source}: the replayed game differs from the recorded one at message "
                                     f"{position} (was it played against another opponent budget or search?)")
            continue
        if result["done"]:
            raise ReplayMismatch(f"{job.source}: the replayed game ended before the recorded reply {position}")
        action, answer = expert_reply(expert, episode, job.with_reason)
        chosen = parse_evaluate_action(strip_think(message["content"]), episode.legal, episode.labels)
        if chosen == action:
            messages.append({"role": "assistant", "content": answer})
        else:
            records.append({**base, "score": None, "messages": [*messages, {"role": "assistant", "content": answer}],
                            "explored_replies": list(range(replies)), "max_replies": replies + 1})
            messages.append({"role": "assistant", "content": message["content"]})
            explored.append(replies)
        replies += 1
        result = episode.step(message["content"])
        if not result["done"]:
            messages.append({"role": "user", "content": result["observation"]})
    if replies > len(explored):  # some move of the model's was the expert's
        records.append({**base, "score": episode.score if result["done"] else None, "messages": messages,
                        "explored_replies": explored})
    return records


def expert_reply(expert, episode, with_reason: bool) -> tuple[int, str]:
    """The expert's move at the episode's pending decision and the reply that plays it (ID, or reason + ID)."""
    action, reason = expert.choose(episode.state, dict(zip(episode.legal, episode.labels)))
    return action, f"<think>{reason}</think>{action}" if with_reason else str(action)


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """JSONL, replaced whole: a crash mid-write leaves the earlier file."""
    staging = path.with_suffix(".jsonl.tmp")
    staging.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(staging, path)


def run_jobs(function, jobs: list, workers: int, what: str) -> list:
    """`function(job)` for every job on `workers` processes, with a progress bar; results in job order."""
    if not jobs:  # no pool to start (e.g. --teacher-moves over rows without conversations)
        return []
    results: list = [None] * len(jobs)
    with rollout_progress(len(jobs), f"{what} ({workers} processes)") as advance:
        # spawn, not fork: the caller may hold a loaded model, threads (torch) and open SQLite connections
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(function, job): i for i, job in enumerate(jobs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                advance()
    return results


def generate(jobs: list[ExpertJob], workers: int, path: Path | None) -> list[dict[str, Any]]:
    """Play every job on `workers` processes; records in job order, also written to `path` as JSONL."""
    records = run_jobs(play_expert_episode, jobs, workers, "expert episodes")
    if path is not None:
        write_records(path, records)
    return [r for r in records if r is not None]


def read_played(source: str, default_opponent: str, option: str = "--relabel") -> list[dict[str, Any]]:
    """`--relabel FILE[:MODEL]`: the finished games in an evaluate.py episodes.jsonl or a bench eval-*.jsonl
    (all of them, or MODEL's), each with a `source` naming its line. Trace records and games that ended in
    an error (cut off, unfinished) are left out. Errors name `option`, the flag that asked for the file."""
    path_text, _, model = source.partition(":")
    path = Path(path_text)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{option} {source}: cannot read played games ({exc}).") from None
    played = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            usable = isinstance(record, dict) and {"task_id", "seed"} <= record.keys()
        except ValueError:
            usable = False
        if not usable:
            raise ConfigError(f"{option} {path} line {number}: expected an episode record with 'task_id', 'seed' "
                              "and a 'conversation' (evaluate.py's episodes.jsonl, bench/learning.py's eval-*.jsonl).")
        conversation = record.get("conversation") or record.get("messages")
        # a teacher's records in a bench file carry no conversation: nothing the model played
        if (record.get("error") or record.get("game") == "trace" or not isinstance(conversation, list)
                or (model and record.get("model") != model)):
            continue
        played.append({**record, "conversation": conversation, "opponent": record.get("opponent") or default_opponent,
                       "source": f"{path} line {number}"})
    if not played:
        raise ConfigError(f"{option} {source}: no finished game with a conversation"
                          f"{' of model ' + repr(model) if model else ''} in it.")
    return played


def replay_options(experts: dict[str, str] | None, workers: int) -> argparse.Namespace:
    """The options `relabel` reads, for callers that replay games only to ask the teachers (`--teacher-moves`):
    each game's expert (`experts` names the others) at its default budget, ID-only replies, every turn kept."""
    return argparse.Namespace(experts=experts, expert_budget=None, cfr_iterations=300, reason="", workers=workers,
                              relabel_missed_only=False)


def relabel_each(played: list[dict[str, Any]], args: argparse.Namespace, simulations, opponent_search: str,
                 cache_dir: str, option: str, opponent_moves: str | None = None) -> list[list[dict[str, Any]]]:
    """`relabel`'s replays, in one pool: per played game (in order), its records."""
    from ppo_affine.envs.tasks import game_name_of
    from ppo_affine.experts import ExpertUnavailable, expert_kind

    reasoned = {game.strip() for game in args.reason.split(",")}  # --reason: "*" or games, as for expert games
    jobs = []
    for game in played:
        name = game.get("game") or game_name_of(game["task_id"])
        try:
            kind = expert_kind(name, args.experts)
        except ExpertUnavailable as exc:
            raise ConfigError(f"{option} {game['source']}: {exc}.") from None
        jobs.append(RelabelJob({k: v for k, v in game.items() if k != "source"}, kind,
                               args.expert_budget or DEFAULT_BUDGET[kind], args.cfr_iterations,
                               name in reasoned or "*" in reasoned,
                               simulations.get(name) if isinstance(simulations, dict) else simulations,
                               opponent_search, cache_dir, game["source"], opponent_moves))
    try:
        return [records or [] for records in run_jobs(relabel_played_episode, jobs, args.workers, "relabelled games")]
    except ReplayMismatch as exc:
        raise ConfigError(f"{option} {exc}") from None


def relabel(played: list[dict[str, Any]], args: argparse.Namespace, simulations, opponent_search: str,
            cache_dir: str, path: Path | None, option: str = "--relabel", opponent_moves: str | None = None
            ) -> list[dict[str, Any]]:
    """DAgger records of the played games on `args.workers` processes (`relabel_played_episode`), also
    written to `path`; prints how often the model played the expert's move. Errors name `option`.
    `opponent_moves`: the file of opponent moves recorded while the games were played, which the replay
    reads instead of searching again."""
    records = relabel_each(played, args, simulations, opponent_search, cache_dir, option, opponent_moves)
    flat = [record for game in records for record in game
            if not args.relabel_missed_only or record.get("max_replies") is not None]
    if path is not None:
        write_records(path, flat)
    matched, turns = expert_moves_played(played, flat)
    console.print(f"{len(played)} played games relabelled by their experts: the model played the expert's move at "
                  f"{matched} of {turns} turns; {len(flat)} records -> {path}", highlight=False)
    return flat


def expert_moves_played(played: list[dict[str, Any]], relabelled: list[dict[str, Any]]) -> tuple[int, int]:
    """(turns where the model played its expert's move, all its turns) over played games and their relabelled
    records: each missed turn is a record of its own, the one kind with `max_replies`."""
    turns = sum(m["role"] == "assistant" for game in played for m in game["conversation"])
    return turns - sum(r.get("max_replies") is not None for r in relabelled), turns


def records_not_in(records: list[dict[str, Any]], present: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`records` less those equal to one in `present`: a conversation in both --data and --dagger-data trains
    once; a repeat within one file stays, as it trained in the SFT."""
    seen = {json.dumps(record, sort_keys=True) for record in present}
    return [record for record in records if json.dumps(record, sort_keys=True) not in seen]


def read_records(path: Path, option: str = "--data") -> list[dict[str, Any]]:
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{option} {path}: cannot read conversations ({exc}).") from None
    if not records or not all(isinstance(r.get("messages"), list) for r in records):
        raise ConfigError(f"{option} {path}: expected JSONL lines with a 'messages' list (as sft_data.jsonl holds).")
    return records


def conversations_to_episodes(records: list[dict[str, Any]], builder, strategy: str, eos_ids: set[int]):
    """Rollout-shaped episodes (token sequences + turns) of recorded conversations, built the way a rollout
    prompts: the same context strategy, and each reply's ids followed by an EOS. A record's
    `explored_replies` (random moves) stay in the context and are not trained on."""
    from ppo_affine.envs.tasks import Task
    from ppo_affine.prompts import TokenHistory
    from ppo_affine.rollout import Episode, Turn, build_messages

    eos = builder.tokenizer.eos_token_id  # the token that ends an assistant turn in the chat template
    episodes = []
    for record in records:
        messages = record["messages"]
        explored = set(record.get("explored_replies", ()))
        replies_seen = 0
        has_system = bool(messages) and messages[0]["role"] == "system"
        history = TokenHistory(builder, eos_ids)
        episode = Episode(task=Task("openspiel", record.get("task_id", 0), record.get("seed", 0), None, "sft", False),
                          env_kind="openspiel", sequences=history.sequences, game_name=record.get("game", ""),
                          done=True, score=float(record.get("score") or 0.0))  # None: a cut record
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            shown = build_messages(messages[:i], i - 1, strategy, None)
            prompt = history.prompt(shown, i - 1 if strategy != "last" else int(has_system))
            if prompt is None:
                break  # longer than generation.max_prompt_tokens: the rest of this game is not trained on
            _, sequence, start = prompt
            reply_ids = builder.tokenize(message["content"]) + [eos]
            history.add_reply(reply_ids, message["content"])
            if replies_seen not in explored:  # a random move stays in the context, untrained
                episode.turns.append(Turn(reply_ids, message["content"], None, sequence=sequence, start=start))
            replies_seen += 1
        episodes.append(episode)
    return episodes


def train_sft(policy, sequences, epochs: int, learning_rate: float, batch_size: int, token_budget: int,
              seed: int, max_grad_norm: float = 1.0) -> list[dict[str, float]]:
    """Masked SFT: minibatches of `batch_size` sequences, micro-batches by `token_budget`; per-epoch stats."""
    import torch

    from ppo_affine.batching import micro_batches

    optimizer = torch.optim.AdamW(policy.adapter_parameters(), lr=learning_rate, weight_decay=0.0)
    order_rng = torch.Generator().manual_seed(seed)
    pad_id = policy.tokenizer.pad_token_id
    policy.train()
    history = []
    steps = 0
    for epoch in range(epochs):
        order = torch.randperm(len(sequences), generator=order_rng).tolist()
        total_loss = total_tokens = 0.0
        batches = (len(order) + batch_size - 1) // batch_size
        with rollout_progress(batches, f"SFT epoch {epoch + 1}/{epochs}") as advance:
            for first in range(0, len(order), batch_size):
                minibatch = [sequences[i] for i in order[first:first + batch_size]]
                tokens = sum(s.response_len for s in minibatch)
                optimizer.zero_grad(set_to_none=True)
                for batch in micro_batches(minibatch, token_budget, pad_id, policy.device,
                                           policy.shares_prefixes_with_gradients()):
                    scored = policy.score(batch.input_ids, None, batch.response_mask, with_values=False)
                    loss = -(scored.logprobs * batch.response_mask).sum() / tokens
                    loss.backward()
                    total_loss += loss.item() * tokens
                torch.nn.utils.clip_grad_norm_(policy.adapter_parameters(), max_grad_norm)
                optimizer.step()
                steps += 1
                total_tokens += tokens
                advance()
        history.append({"epoch": epoch + 1, "loss": total_loss / max(1.0, total_tokens), "optimizer_steps": steps})
        console.print(f"SFT epoch {epoch + 1}: mean NLL per reply token {history[-1]['loss']:.4f}", highlight=False)
    optimizer.zero_grad(set_to_none=True)
    policy.eval()
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ppo_affine.experts import CHOICES

    parser = program_parser(__doc__)
    parser.add_argument("--games", default=DEFAULT_GAMES, help="comma-separated games with an expert")
    parser.add_argument("--episodes", default="100",
                        help="expert episodes per game: a number, or a number then GAME=N for the games that differ "
                        "(e.g. 64,gin_rummy=8)")
    parser.add_argument("--config-ids", default="0", help="comma-separated game variants to cycle through")
    parser.add_argument("--opponent", choices=("random", "mcts"), default="random", help="the env's opponent")
    parser.add_argument("--opponent-simulations", type=int,
                        help="MCTS opponent's simulations (default: the config's env.envs.<openspiel env>.mcts_simulations, "
                        "else each game's validator budget)")
    parser.add_argument("--expert-budget", type=int,
                        help="MCTS simulations (default 300) or Monte Carlo playouts per bid (default 20)")
    parser.add_argument("--expert", default="", metavar="GAME=KIND,...",
                        help="experts other than a game's default (the first listed): "
                        + "; ".join(f"{game}: {', '.join(kinds)}" for game, kinds in CHOICES.items()))
    parser.add_argument("--cfr-iterations", type=int, default=300, help="CFR+ iterations for leduc_poker")
    parser.add_argument("--reason", nargs="?", const="*", default="", metavar="GAMES",
                        help="replies '<think>one-line reason</think>ID': in every game, or only in the "
                        "comma-separated GAMES (e.g. --reason goofspiel); the others reply with the ID alone")
    parser.add_argument("--explore", type=float, default=0.0, metavar="P",
                        help="chance that a turn of an expert game plays a random legal move, not trained on: "
                        "SFT then also sees the expert recover from states its own play never reaches (e.g. 0.2)")
    parser.add_argument("--openings", default="0", metavar="N",
                        help="more expert episodes per game, cut after the expert's first reply (a number, or a "
                        "number then GAME=N items): the decision that decides short games, such as a liars_dice "
                        "opening bid, at one prompt each")
    parser.add_argument("--data", type=Path, help="train on this JSONL instead of generating episodes")
    parser.add_argument("--relabel", action="append", default=[], metavar="FILE[:MODEL]",
                        help="also train on the games a model played (evaluate.py's episodes.jsonl, "
                        "bench/learning.py's eval-*.jsonl; :MODEL keeps that model's records), replayed with each "
                        "game's expert answering at every turn (DAgger): the expert's moves at the states the model's "
                        "own play reaches. Repeatable; with --episodes 0 and no --data, the only data")
    parser.add_argument("--relabel-missed-only", action="store_true",
                        help="of the relabelled games keep only the turns where the model missed the expert's move "
                        "(about half the sequences). Measured worse on leduc_poker: 0.496 against 0.543 with every "
                        "turn relabelled (docs/warm_start.md); kept to compare the two")
    parser.add_argument("--dagger-rounds", type=int, default=0, metavar="N",
                        help="after the SFT, N rounds of DAgger: the newest adapter plays --dagger-episodes games "
                        "greedily against --opponent on seeds of their own, each game's expert relabels them "
                        "(as --relabel), and SFT goes on from that adapter on them and on this call's SFT "
                        "conversations (and --dagger-data's) for --epochs. With --init-adapter "
                        "and --episodes 0 the rounds start from that adapter, with no SFT before them: also the way "
                        "to go on after an interrupted run, from its last round's checkpoint (new deals). "
                        "--dagger-aggregate all adds earlier rounds' relabelled games")
    parser.add_argument("--dagger-episodes", default="128", metavar="N",
                        help="games per game and round for --dagger-rounds: a number, or a number then GAME=N items")
    parser.add_argument("--dagger-data", type=Path, metavar="FILE",
                        help="expert conversations (an sft_data.jsonl) that every --dagger-rounds round trains on "
                        "beside its relabelled games, e.g. the games an --init-adapter learned from: the turns it "
                        "plays right stay held in place (an SFT in the same call keeps its own data this way; a "
                        "conversation in both trains once)")
    parser.add_argument("--dagger-aggregate", choices=DAGGER_AGGREGATES, default=DAGGER_AGGREGATES[0],
                        help="what each --dagger-rounds round trains on beside its own relabelled games: 'sft', this "
                        "call's SFT data (expert games, --data, --relabel) and --dagger-data's (measured on "
                        "leduc_poker); 'all', also every earlier round's relabelled games, as DAgger aggregates "
                        "(on leduc_poker a worse student: it forfeited games by raising past the cap)")
    parser.add_argument("--init-adapter", type=Path, metavar="CHECKPOINT",
                        help="go on training this adapter (an earlier SFT checkpoint, or an adapter folder) "
                        "instead of a fresh LoRA, e.g. for more epochs")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes playing episodes")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the expert conversations")
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="the LoRA adapter's AdamW learning rate")
    parser.add_argument("--batch-size", type=int, default=16, help="conversations per optimizer step")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/sft-warmstart"),
                        help="where the expert data (sft_data.jsonl), the SFT metrics and checkpoints/ go")
    add_config_arguments(parser, set_example="generation.context_strategy=full")
    return parser.parse_args(argv)


def parse_game_counts(text: str, option: str) -> dict[str, int]:
    """'64' or '64,gin_rummy=8' -> {"*": 64, "gin_rummy": 8}; ConfigError naming `option` otherwise."""
    head, *rest = [part.strip() for part in str(text).split(",")]
    try:
        counts = {"*": int(head)}
        for item in rest:
            game, equals, number = item.partition("=")
            if not equals:
                raise ValueError
            counts[game.strip()] = int(number)
    except ValueError:
        raise ConfigError(f"{option}: expected a number, then GAME=N items separated by commas, got {text!r}.") from None
    return counts


def parse_experts(text: str) -> dict[str, str]:
    """'leduc_poker=best_response,gin_rummy=mcts' -> {game: kind}; ConfigError naming --expert otherwise."""
    experts = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        game, equals, kind = item.partition("=")
        if not equals or not game or not kind:
            raise ConfigError(f"--expert: expected GAME=KIND items separated by commas, got {item!r}.")
        experts[game.strip()] = kind.strip()
    return experts


def parse_reason_games(text: str, games: list[str]) -> set[str]:
    """--reason's value: '' -> no game, '*' -> every game, 'a,b' -> those games (ConfigError for a game not played)."""
    if text.strip() == "*":
        return set(games)
    named = {game.strip() for game in text.split(",") if game.strip()}
    if named - set(games):
        raise ConfigError(f"--reason: {sorted(named - set(games))} are not in --games ({','.join(games)}).")
    return named


def check_args(args: argparse.Namespace) -> list[str]:
    """The games to play; ConfigError naming the option for anything that cannot work."""
    from ppo_affine.experts import ExpertUnavailable, expert_kind

    games = [g.strip() for g in args.games.split(",") if g.strip()]
    args.experts = parse_experts(args.expert)
    for game in args.experts:
        try:
            expert_kind(game, args.experts)
        except ExpertUnavailable as exc:
            raise ConfigError(f"--expert: {exc}.") from None
    args.episodes = parse_game_counts(args.episodes, "--episodes")
    args.openings = parse_game_counts(args.openings, "--openings")
    args.dagger_episodes = parse_game_counts(args.dagger_episodes, "--dagger-episodes")
    if min(args.openings.values()) < 0:
        raise ConfigError(f"--openings must be at least 0 for every game, got {args.openings}.")
    if args.dagger_rounds < 0:
        raise ConfigError(f"--dagger-rounds must be at least 0, got {args.dagger_rounds}.")
    if min(args.dagger_episodes.values()) < 1:
        raise ConfigError(f"--dagger-episodes must be at least 1 for every game, got {args.dagger_episodes}.")
    if args.dagger_aggregate == "all" and not args.dagger_rounds:
        raise ConfigError("--dagger-aggregate all keeps earlier rounds' games, but --dagger-rounds is 0.")
    if args.dagger_data is not None and not args.dagger_rounds:
        raise ConfigError("--dagger-data trains in every --dagger-rounds round, but --dagger-rounds is 0.")
    args.dagger_records = read_records(args.dagger_data, "--dagger-data") if args.dagger_data else []
    # DAgger rounds may start from --init-adapter alone: then no expert game needs playing first
    starts_elsewhere = args.relabel or (args.dagger_rounds and args.init_adapter is not None)
    if args.data is None or args.dagger_rounds:
        if args.data is None and min(args.episodes.values()) < (0 if starts_elsewhere else 1):
            raise ConfigError(f"--episodes must be at least 1 for every game, got {args.episodes}.")
        if not games:
            raise ConfigError("--games is empty; name games with an expert, e.g. --games leduc_poker,goofspiel.")
        for game in games:
            try:
                expert_kind(game, args.experts)
            except ExpertUnavailable as exc:
                raise ConfigError(f"--games: {exc}.") from None
    args.reason_games = parse_reason_games(args.reason, games) if args.data is None else set()
    # played games are read before experts play or the model loads, so that a wrong file fails at once
    args.played = [game for source in args.relabel for game in read_played(source, args.opponent)]
    if args.init_adapter is not None:
        from ppo_affine.checkpoint import checkpoint_holding
        from ppo_affine.policy import adapter_folder

        adapter_folder(args.init_adapter)  # a wrong path or a corrupt checkpoint fails before experts play or
        checkpoint_holding(args.init_adapter)  # the model loads
    for name in ("epochs", "batch_size", "workers", "cfr_iterations"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
    if not 0 <= args.explore < 1:
        raise ConfigError(f"--explore must be in [0, 1), got {args.explore}.")
    if args.learning_rate <= 0:
        raise ConfigError(f"--learning-rate must be > 0, got {args.learning_rate}.")
    if args.expert_budget is not None and args.expert_budget < 1:
        raise ConfigError(f"--expert-budget must be at least 1, got {args.expert_budget}.")
    try:
        args.config_id_list = [int(c) for c in args.config_ids.split(",")]
    except ValueError:
        raise ConfigError(f"--config-ids: expected comma-separated integers, got {args.config_ids!r}.") from None
    return games


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        config = config_from_arguments(args)
        games = check_args(args)
        if args.data is None or args.played or args.dagger_rounds:  # the teachers play or replay games
            warn_teachers_aimed_elsewhere(games, args.experts, args.opponent)
        args.output_dir.mkdir(parents=True, exist_ok=True)
        game_env = next((s for s in config.env.envs.values() if s.kind == "openspiel"), EnvSpec(kind="openspiel"))
        simulations = args.opponent_simulations
        if simulations is None:  # the opponent training will meet
            simulations = game_env.mcts_simulations
        if args.data is not None:
            records = read_records(args.data)
        elif not any(args.episodes.values()) and not any(args.openings.values()) and not args.played:
            records = []  # DAgger rounds from --init-adapter alone
        else:
            jobs = plan_jobs(games, args.episodes, config.train.run.seed, args.opponent, args.config_id_list,
                             args.expert_budget, args.cfr_iterations, args.reason_games, simulations,
                             experts=args.experts, opponent_search=game_env.opponent_search,
                             cache_dir=config.train.model.cache_dir, explore=args.explore,
                             openings=args.openings)
            started = time.perf_counter()
            records = generate(jobs, args.workers, args.output_dir / DATA_FILE)
            console.print(f"{len(records)} expert episodes in {time.perf_counter() - started:.0f} s -> "
                          f"{args.output_dir / DATA_FILE}", highlight=False)
        relabelled = []
        if args.played:
            relabelled = relabel(args.played, args, simulations, game_env.opponent_search,
                                 config.train.model.cache_dir, args.output_dir / RELABEL_FILE,
                                 opponent_moves=game_env.opponent_moves)
        checkpoint = args.init_adapter  # DAgger rounds from that adapter alone, with no SFT before them
        if records or relabelled:
            checkpoint = warm_start(config, records + relabelled, args, args.init_adapter, args.output_dir)
        # aggregated DAgger: every round also trains on what this SFT trained on and on --dagger-data's
        # conversations (measured on leduc_poker: +0.011 [0.001, 0.020] over rounds on their relabelled games alone)
        dagger_data = records_not_in(args.dagger_records, records)
        args.dagger_records = records + relabelled + dagger_data
        args.dagger_expert_records = len(records) + len(dagger_data)  # the rest of dagger_records is relabelled
        (args.output_dir / DAGGER_LOG).unlink(missing_ok=True)  # this run's rounds only
        for round_number in range(1, args.dagger_rounds + 1):
            checkpoint = dagger_round(config, args, games, round_number, checkpoint, simulations)
    except ConfigError as exc:
        return report_failure("Configuration error", exc, 2)
    # PPO goes on against the opponent the experts met: trained against random, a policy loses to MCTS
    versus = " --curriculum-config config/curriculum_vs_mcts.json" if args.opponent == "mcts" else ""
    console.print(f"saved {checkpoint}\ncontinue with PPO: python train_ppo.py "
                  f"{' '.join('--preset ' + p for p in [*args.preset, 'warm_start'])}{versus} "
                  f"--init-adapter {checkpoint}", highlight=False, soft_wrap=True)
    return 0


def dagger_round(config, args: argparse.Namespace, games: list[str], round_number: int, checkpoint: Path,
                 simulations: int | dict[str, int] | None) -> Path:
    """One `--dagger-rounds` round: the adapter at `checkpoint` plays `--dagger-episodes` games of each game as
    evaluate.py plays them (greedy, both seats, the same --set items), against the opponent the experts met;
    the experts relabel them, and SFT goes on from that adapter on them and on the records kept so far
    (`args.dagger_records`: the run's expert conversations, --relabel's records and with --dagger-aggregate all
    every earlier round's). Returns the new checkpoint. The round's seeds come from run.seed, the round and the
    weights of the adapter that plays: apart from evaluate.py's and from every other round's, also when a run
    goes on from an earlier round's checkpoint, and the same in every copy of the adapter."""
    import asyncio
    import gc

    import evaluate
    from ppo_affine.policy import adapter_folder, adapter_weights_digest
    from ppo_affine.report import mean_interval

    folder = args.output_dir / f"dagger-{round_number}"
    folder.mkdir(parents=True, exist_ok=True)
    play_config = config_from_arguments(args, defaults=evaluate.VALIDATOR_SETTINGS, flags=["generation.temperature=0"])
    env_name, env_spec = evaluate.eval_env_specs(play_config, {"openspiel"})["openspiel"]
    if simulations is not None:  # the opponent's budget the relabelling replays with
        env_spec = env_spec.model_copy(update={"mcts_simulations": simulations})
    # the relabelling replays these games: it reads the opponent's moves their play recorded
    env_spec = evaluate.shared_opponent_moves(env_spec, folder / "opponent-moves.sqlite")
    seed = derive_seed(config.train.run.seed, "dagger", round_number, adapter_weights_digest(checkpoint))
    tasks = [task for game in games for task in evaluate.game_tasks(
        game, game_count(args.dagger_episodes, game), seed, args.opponent, env_name)]
    console.print(f"DAgger round {round_number}: {checkpoint} plays {len(tasks)} games", highlight=False)
    played_path = folder / "played.jsonl"
    try:
        asyncio.run(evaluate.evaluate(play_config, tasks, {"openspiel": (env_name, env_spec)},
                                      adapter_folder(checkpoint), False, played_path))
    except evaluate.VLLMError as exc:  # the student plays where generation.backend says
        raise ConfigError(f"--dagger-rounds: {exc}") from None
    gc.collect()  # the playing model goes before the training one loads
    played = read_played(str(played_path), args.opponent, "--dagger-rounds")
    records = relabel(played, args, simulations, env_spec.opponent_search, config.train.model.cache_dir,
                      folder / RELABEL_FILE, "--dagger-rounds", env_spec.opponent_moves)
    entry: dict[str, Any] = {"round": round_number, "adapter": str(checkpoint), "seed": seed, "by_game": {},
                             "records": len(records), "expert_records": args.dagger_expert_records,
                             "relabelled_records": len(args.dagger_records) - args.dagger_expert_records}
    for game in games:
        game_played = [g for g in played if g["game"] == game]
        if not game_played:
            continue
        mean, interval = mean_interval([g["score"] for g in game_played], 0.0, 1.0)
        matched, turns = expert_moves_played(game_played, [r for r in records if r["game"] == game])
        entry["by_game"][game] = {"games": len(game_played), "mean_score": mean, "score_ci95": interval,
                                  "expert_moves": matched, "turns": turns}
        console.print(f"DAgger round {round_number}, {game}: the student scored {mean:.3f}"
                      + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")
                      + f" over {len(game_played)} games and played the expert's move at {matched} of {turns} turns",
                      highlight=False)
    if records:
        checkpoint = warm_start(config, records + args.dagger_records, args, checkpoint, folder)
    else:  # --relabel-missed-only and not one miss: no new record, so no new step of DAgger
        console.print("the student played the expert's move at every turn: no new record, this round trains nothing",
                      highlight=False)
    if args.dagger_aggregate == "all":
        args.dagger_records = args.dagger_records + records
    with open(args.output_dir / DAGGER_LOG, "a") as log_file:
        log_file.write(json.dumps({**entry, "checkpoint": str(checkpoint)}) + "\n")
    return checkpoint


def warm_start(config, records: list[dict[str, Any]], args: argparse.Namespace, init_adapter: Path | None,
               output_dir: Path) -> Path:
    """SFT on `records` (from the adapter at `init_adapter`, else a fresh LoRA), then a checkpoint in
    `output_dir/checkpoints`; returns its path."""
    import torch

    from ppo_affine.checkpoint import save_checkpoint
    from ppo_affine.batching import build_sequences
    from ppo_affine.generation import eos_token_ids
    from ppo_affine.allocator import return_freed_memory_to_the_os, training_allocations
    from ppo_affine.model_files import pick_device
    from ppo_affine.policy import adapter_folder, load_policy
    from ppo_affine.prompts import PromptBuilder

    cfg = config.train
    device = pick_device(cfg.run.device)
    return_freed_memory_to_the_os()
    torch.manual_seed(cfg.run.seed)
    policy = load_policy(cfg.model, cfg.lora, device)
    if init_adapter is not None:
        policy.load_adapter(adapter_folder(init_adapter))
        console.print(f"SFT goes on from the adapter in {init_adapter}", highlight=False)
    builder = PromptBuilder(policy.tokenizer, cfg.generation.max_prompt_tokens, cfg.model.chat_template_kwargs)
    episodes = conversations_to_episodes(records, builder, cfg.generation.context_strategy,
                                         eos_token_ids(policy.tokenizer, policy.model.generation_config))
    sequences = build_sequences(episodes)
    if not sequences:
        raise ConfigError("no expert reply to train on: each was a random move (--explore) or its prompt is longer "
                          "than generation.max_prompt_tokens.")
    console.print(f"SFT on {sum(len(e.turns) for e in episodes)} expert replies in {len(sequences)} sequences "
                  f"({sum(s.response_len for s in sequences)} reply tokens)", highlight=False)
    with training_allocations():
        history = train_sft(policy, sequences, args.epochs, args.learning_rate, args.batch_size,
                            cfg.ppo.micro_batch_tokens, cfg.run.seed)
    state = {"kind": SFT_STATE_KIND, "step": history[-1]["optimizer_steps"], "history": history,
             "config": config.model_dump(mode="json"),
             "sft": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in LOADED}}
    (output_dir / "sft_metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    return save_checkpoint(output_dir / "checkpoints", history[-1]["optimizer_steps"], policy.save, state,
                           keep_last=1)


if __name__ == "__main__":
    sys.exit(main())
