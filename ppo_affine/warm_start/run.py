"""The warm start from start to end: the options' files read, the expert games played (or --data read), the played
games relabelled, the SFT, then the DAgger rounds."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ppo_affine.config import Config
from ppo_affine.run_log import console
from ppo_affine.warm_start import dagger, expert_play, sft, trace_teacher
from ppo_affine.warm_start.config import WarmStartConfig
from ppo_affine.warm_start.relabel import RELABEL_FILE, read_played, relabel

DATA_FILE = "sft_data.jsonl"  # the expert games' conversations, in the shape logging.log_samples_every writes


@dataclass(frozen=True)
class Inputs:
    """What the options' files hold: data, not options, so a checkpoint keeps the options alone."""
    played: list[dict[str, Any]]  # --relabel's finished games, each with its `source`
    dagger_data: list[dict[str, Any]]  # --dagger-data's conversations


def load_inputs(settings: WarmStartConfig) -> Inputs:
    """The files the options name, read and checked before experts play or the model loads, so that a wrong file
    fails at once."""
    dagger_data = sft.read_records(settings.dagger_data, "--dagger-data") if settings.dagger_data else []
    played = [game for source in settings.relabel for game in read_played(source, settings.opponent)]
    if settings.init_adapter is not None:
        from ppo_affine.checkpoint import checkpoint_holding
        from ppo_affine.policy import adapter_folder

        adapter_folder(settings.init_adapter)  # a wrong path or a corrupt checkpoint
        checkpoint_holding(settings.init_adapter)
    return Inputs(played, dagger_data)


def run_warm_start(settings: WarmStartConfig, config: Config, inputs: Inputs,
                   play_student: dagger.StudentPlay) -> Path | None:
    """Every step the options ask for; returns the last checkpoint (None when nothing trained)."""
    if settings.data is None or inputs.played or settings.dagger_rounds:  # the teachers play or replay games
        expert_play.warn_teachers_aimed_elsewhere(settings.games, settings.experts, settings.opponent)
    settings.output_dir.mkdir(parents=True, exist_ok=True)
    setup = expert_play.OpponentSetup.of(config, settings.opponent_simulations)  # the opponent training will meet
    records = expert_conversations(settings, config, inputs, setup)
    relabelled = []
    if inputs.played:
        relabelled = relabel(inputs.played, settings, setup, settings.output_dir / RELABEL_FILE)
    checkpoint = settings.init_adapter  # DAgger rounds from that adapter alone, with no SFT before them
    if records or relabelled:
        checkpoint = sft.fine_tune(config, records + relabelled, settings, settings.init_adapter, settings.output_dir)
    kept = dagger.KeptRecords.of_run(records, relabelled, inputs.dagger_data)
    (settings.output_dir / dagger.DAGGER_LOG).unlink(missing_ok=True)  # this run's rounds only
    for round_number in range(1, settings.dagger_rounds + 1):
        checkpoint, kept = dagger.dagger_round(settings, config, round_number, checkpoint, kept, setup, play_student)
    return checkpoint


def expert_conversations(settings: WarmStartConfig, config: Config, inputs: Inputs,
                         setup: expert_play.OpponentSetup) -> list[dict[str, Any]]:
    """--data's conversations, else the expert games the options ask for, played and written to DATA_FILE."""
    if settings.data is not None:
        return sft.read_records(settings.data)
    games_asked = settings.games and (any(settings.episodes.values()) or any(settings.openings.values()))
    if not games_asked and not settings.trace and not inputs.played:
        return []  # DAgger rounds from --init-adapter alone
    # expert games meet seeds of their own: a file of recorded opponent moves would only grow
    jobs = expert_play.plan_jobs(settings, config.train.run.seed, replace(setup, moves=None)) if games_asked else []
    started = time.perf_counter()
    path = settings.output_dir / DATA_FILE
    records = expert_play.generate(jobs, settings.workers, None)
    records += trace_teacher.interpreter_records(config, settings.trace_levels, settings.trace, config.train.run.seed)
    expert_play.write_records(path, records)
    console.print(f"{len(records)} expert episodes in {time.perf_counter() - started:.0f} s -> {path}",
                  highlight=False)
    return records
