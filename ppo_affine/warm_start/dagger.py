"""DAgger rounds (`--dagger-rounds`): the newest adapter plays, the teachers relabel its games, and SFT goes on
from that adapter on them beside the records every round keeps."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from ppo_affine.config import Config, EnvSpec
from ppo_affine.seeds import derive_seed
from ppo_affine.run_log import console
from ppo_affine.warm_start import sft
from ppo_affine.warm_start.config import WarmStartConfig, game_count
from ppo_affine.warm_start.expert_play import OpponentSetup
from ppo_affine.warm_start.relabel import RELABEL_FILE, expert_moves_played, read_played, relabel

DAGGER_LOG = "dagger.jsonl"  # one line per round: its student's score and expert agreement


class StudentPlay(Protocol):
    def __call__(self, checkpoint: Path, seed: int, simulations: int | dict[str, int] | None,
                 played_path: Path) -> EnvSpec:
        """Play the adapter at `checkpoint` as evaluate.py plays (greedy, both seats), --dagger-episodes games of each
        game on tasks derived from `seed`, against the MCTS opponent at `simulations` (None: the env's); write the
        episode records to `played_path` and return the game env they were played in."""


@dataclass(frozen=True)
class KeptRecords:
    """What every round trains on beside its own relabelled games."""
    records: list[dict[str, Any]]
    expert_records: int  # how many of them are expert conversations; the rest are relabelled games

    @classmethod
    def of_run(cls, expert: list[dict[str, Any]], relabelled: list[dict[str, Any]],
               dagger_data: list[dict[str, Any]]) -> KeptRecords:
        """The run's SFT data (expert conversations, then relabelled games) and --dagger-data's conversations, less
        those the SFT trained on. Aggregated DAgger: measured on leduc_poker, +0.011 [0.001, 0.020] over rounds
        on their relabelled games alone."""
        extra = records_not_in(dagger_data, expert)
        return cls(expert + relabelled + extra, len(expert) + len(extra))


def records_not_in(records: list[dict[str, Any]], present: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`records` less those equal to one in `present`: a conversation in both --data and --dagger-data trains
    once; a repeat within one file stays, as it trained in the SFT."""
    seen = {json.dumps(record, sort_keys=True) for record in present}
    return [record for record in records if json.dumps(record, sort_keys=True) not in seen]


def dagger_round(settings: WarmStartConfig, config: Config, round_number: int, checkpoint: Path, kept: KeptRecords,
                 setup: OpponentSetup, play_student: StudentPlay) -> tuple[Path, KeptRecords]:
    """One round: the adapter at `checkpoint` plays (`play_student`) against the opponent the experts met; the
    experts relabel its games, and SFT goes on from that adapter on them and on `kept`. Returns the new checkpoint
    and what the next round keeps (with --dagger-aggregate all, this round's records too). The round's seeds come
    from run.seed, the round and the weights of the adapter that plays: apart from evaluate.py's and from every
    other round's, also when a run goes on from an earlier round's checkpoint, and the same in every copy of the
    adapter."""
    import gc

    from ppo_affine.policy import adapter_weights_digest

    folder = settings.output_dir / f"dagger-{round_number}"
    folder.mkdir(parents=True, exist_ok=True)
    seed = derive_seed(config.train.run.seed, "dagger", round_number, adapter_weights_digest(checkpoint))
    games = sum(game_count(settings.dagger_episodes, game) for game in settings.games)
    console.print(f"DAgger round {round_number}: {checkpoint} plays {games} games", highlight=False)
    spec = play_student(checkpoint, seed, setup.simulations, folder / "played.jsonl")
    gc.collect()  # the playing model goes before the training one loads
    played = read_played(str(folder / "played.jsonl"), settings.opponent, "--dagger-rounds")
    # the replay reads the opponent's moves the play recorded
    records = relabel(played, settings, replace(setup, search=spec.opponent_search, moves=spec.opponent_moves),
                      folder / RELABEL_FILE, "--dagger-rounds")
    entry: dict[str, Any] = {"round": round_number, "adapter": str(checkpoint), "seed": seed,
                             "by_game": student_scores(settings.games, played, records, round_number),
                             "records": len(records), "expert_records": kept.expert_records,
                             "relabelled_records": len(kept.records) - kept.expert_records}
    if records:
        checkpoint = sft.fine_tune(config, records + kept.records, settings, checkpoint, folder)
    else:  # --relabel-missed-only and not one miss: no new record, so no new step of DAgger
        console.print("the student played the expert's move at every turn: no new record, this round trains nothing",
                      highlight=False)
    if settings.dagger_aggregate == "all":
        kept = replace(kept, records=kept.records + records)
    with open(settings.output_dir / DAGGER_LOG, "a") as log_file:
        log_file.write(json.dumps({**entry, "checkpoint": str(checkpoint)}) + "\n")
    return checkpoint, kept


def student_scores(games: list[str], played: list[dict[str, Any]], records: list[dict[str, Any]],
                   round_number: int) -> dict[str, dict[str, Any]]:
    """Per game: the student's mean score over its games with a 95 % interval, and at how many of its turns it
    played the expert's move; each also printed."""
    from ppo_affine.report import mean_interval

    by_game = {}
    for game in games:
        game_played = [g for g in played if g["game"] == game]
        if not game_played:
            continue
        mean, interval = mean_interval([g["score"] for g in game_played], 0.0, 1.0)
        matched, turns = expert_moves_played(game_played, [r for r in records if r["game"] == game])
        by_game[game] = {"games": len(game_played), "mean_score": mean, "score_ci95": interval,
                         "expert_moves": matched, "turns": turns}
        console.print(f"DAgger round {round_number}, {game}: the student scored {mean:.3f}"
                      + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")
                      + f" over {len(game_played)} games and played the expert's move at {matched} of {turns} turns",
                      highlight=False)
    return by_game
