"""Relabelled games (DAgger's data): games a model played, replayed move by move with its game's teacher
answering at every turn, so SFT also sees the teacher's move at the states the model's own play reaches."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_affine.config import ConfigError
from ppo_affine.run_log import console
from ppo_affine.warm_start.config import WarmStartConfig
from ppo_affine.warm_start.expert_play import OpponentSetup, Teacher, expert_reply, run_jobs, write_records
from ppo_affine.warm_start.sft import refuse_evaluation_game

RELABEL_FILE = "relabelled.jsonl"  # the relabelled records of --relabel's games, and of each DAgger round's


@dataclass(frozen=True)
class RelabelJob:
    """One game a model played (an evaluate.py / bench episode record) to replay with a teacher answering."""
    played: dict[str, Any]
    teacher: Teacher
    setup: OpponentSetup  # its `moves`: the file of opponent moves its evaluation recorded, so no search again
    source: str  # "FILE line N", for errors


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
    from ppo_affine.envs.openspiel_text import parse_evaluate_action, strip_think
    from ppo_affine.envs.tasks import game_name_of

    played = job.played
    episode = job.setup.episode(played["task_id"], played["seed"], played["opponent"],
                                played.get("game") or game_name_of(played["task_id"]))
    expert = job.setup.expert(job.teacher, episode, played["seed"])
    result = episode.start()
    messages = [{"role": "system", "content": episode.system_prompt},
                {"role": "user", "content": result["observation"]}]
    base = {"step": 0, "env": "openspiel", "task_id": played["task_id"], "seed": played["seed"],
            "game": episode.game_name, "error": None, "expert": expert.kind, "opponent": played["opponent"],
            "llm_player_id": episode.player, "relabelled": True}
    records, explored, replies = [], [], 0
    # the replay grows `messages` in step with the recorded conversation: message i is the recorded message i
    for position, message in enumerate(played["conversation"]):
        if message["role"] != "assistant":
            if position >= len(messages) or messages[position]["content"] != message["content"]:
                raise ReplayMismatch(f"{job.source}: the replayed game differs from the recorded one at message "
                                     f"{position} (was it played against another opponent budget or search?)")
            continue
        if result["done"]:
            raise ReplayMismatch(f"{job.source}: the replayed game ended before the recorded reply {position}")
        action, answer = expert_reply(expert, episode, job.teacher.with_reason)
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
        refuse_evaluation_game(record, f"{option} {path} line {number}")
        played.append({**record, "conversation": conversation, "opponent": record.get("opponent") or default_opponent,
                       "source": f"{path} line {number}"})
    if not played:
        raise ConfigError(f"{option} {source}: no finished game with a conversation"
                          f"{' of model ' + repr(model) if model else ''} in it.")
    return played


def relabel_each(played: list[dict[str, Any]], settings: WarmStartConfig, setup: OpponentSetup,
                 option: str) -> list[list[dict[str, Any]]]:
    """`relabel`'s replays, in one pool of `settings.workers` processes: per played game (in order), its records.
    Each game's teacher is the one --expert, --expert-budget, --cfr-iterations and --reason set."""
    from ppo_affine.envs.tasks import game_name_of
    from ppo_affine.experts import ExpertUnavailable

    jobs = []
    for game in played:
        try:
            teacher = Teacher.of(game.get("game") or game_name_of(game["task_id"]), settings)
        except ExpertUnavailable as exc:
            raise ConfigError(f"{option} {game['source']}: {exc}.") from None
        jobs.append(RelabelJob({k: v for k, v in game.items() if k != "source"}, teacher, setup, game["source"]))
    try:
        return [records or [] for records in run_jobs(relabel_played_episode, jobs, settings.workers,
                                                      "relabelled games")]
    except ReplayMismatch as exc:
        raise ConfigError(f"{option} {exc}") from None


def relabel(played: list[dict[str, Any]], settings: WarmStartConfig, setup: OpponentSetup, path: Path | None,
            option: str = "--relabel") -> list[dict[str, Any]]:
    """DAgger records of the played games (`relabel_played_episode`), also written to `path`; with
    --relabel-missed-only the missed turns' records alone. Prints how often the model played the expert's move.
    Errors name `option`. `setup.moves`: the file of opponent moves recorded while the games were played, which
    the replay reads instead of searching again."""
    records = relabel_each(played, settings, setup, option)
    flat = [record for game in records for record in game
            if not settings.relabel_missed_only or record.get("max_replies") is not None]
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
