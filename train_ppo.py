"""PPO + LoRA training of a chat model on the Affine game and trace environments.

Algorithm (one step = sample -> rollout -> score -> advantages -> update -> curriculum -> log):
- Episodes are multi-turn conversations kept as token ids: a turn's prompt is the previous
  prompt + the exact sampled reply ids + the chat template's glue + the new observation, so one
  sequence per episode is scored and trained (prompt tokens masked) when the template renders
  the conversation append-only; otherwise a turn starts a new sequence (prompts.py).
- Old log-probs, values, reference log-probs and the rollout policy's entropy are computed by the
  training model after the rollout; the reference is the same model with the LoRA adapter off, or,
  when the run starts from an adapter (`--init-adapter`, e.g. an SFT warm start), a frozen copy of it.
- Rewards: -beta * KL(policy || reference) per generated token (k1 by default), env step rewards
  and an illegal-move penalty at the end of each turn, the final score (in [0, 1], optionally
  centred) at the episode's last turn. Episodes cut off by `generation.max_turns` have no outcome:
  they are left out of the update and of the curriculum's statistics.
- `gae` (default): a scalar value head on the last hidden state. With `ppo.credit` turn (default)
  one value per turn and GAE(gamma, lambda) over turns, the turn's advantage on every token of
  its reply; `token` runs GAE over reply tokens. Advantages whitened over the batch, clipped value
  loss. `group`: GRPO-style, `group_size` episodes of one task+seed, advantage = the episode
  return normalised within its group, no critic, and the KL moves from the reward into the loss
  (beta * k3).
- Clipped surrogate loss; each episode's tokens weigh one unit (`ppo.loss_weighting`), so long
  games do not drown short ones. Micro-batches packed by a token budget with gradient
  accumulation; grad-norm clipping; a non-finite loss skips the update; a minibatch whose
  approx KL per token to the rollout policy passes `ppo.kl_stop` is not stepped and ends the epochs.
- beta follows the adaptive KL controller (target KL per generated token, horizon in episodes).
Departures from the textbook: LoRA dropout is off during PPO (the ratio must start at exactly 1);
sampled tokens are scored at the sampling temperature; for `value_head.warmup_steps` steps only
the value head trains, on a detached trunk (the policy does not move); with
`ppo.sampler_correction` each token's surrogate is weighted by min(pi_old / pi_sampler, C) (truncated
importance sampling), since the sampler's kernels (vLLM's, or the local decode loop's with its cache and
batch) give the sampled tokens other probabilities than the trainer's scoring pass.

Run:  python train_ppo.py --preset cpu                  (offline CPU demo with SmolLM2-135M)
      python train_ppo.py                               (Qwen3-4B, 4-bit, vLLM at localhost:8000)
      python train_ppo.py --resume latest --output-dir runs
      torchrun --nproc-per-node 8 train_ppo.py --set ppo.batch_size=64   (data-parallel, docs/distributed.md)
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ppo_affine.checkpoint import (
    PPO_KIND, check_checkpoint, checkpoint_kind, find_resumable, list_checkpoints, load_trainer_state, rng_state,
    save_checkpoint, set_aside_newer, set_rng_state,
)
from curriculum import Curriculum
from ppo_affine.envs.tasks import Task
from ppo_affine.distributed import (ONE_PROCESS, OutOfMemoryOnRanks, RankFailed, RankLost, Ranks, SilentLogger,
                                    check_world_size, rng_state_of)
from ppo_affine.envs.factory import make_envs, playable_filter
from ppo_affine.advantages import assign_advantages, final_reward, turn_rewards
from ppo_affine.architectures import served_by_vllm_cpu, tree_scoring_mode
from ppo_affine.batching import build_sequences, scoring_sequences
from ppo_affine.endpoint import EndpointUnused, endpoint_for
from ppo_affine.experience import correct_for_the_sampler, sampler_gap, score_sequences
from ppo_affine.allocator import return_freed_memory_to_the_os, training_allocations
from ppo_affine.adapter_probe import check_engine_applies_adapters
from ppo_affine.generation import VLLMError, VLLMServers, eos_token_ids
from ppo_affine.local_generation import LocalGenerator
from ppo_affine.model_files import check_4bit_support, model_source, pick_device
from ppo_affine.policy import VALUE_HEAD_FILE, adapter_folder, load_policy
from ppo_affine.ppo import AdaptiveKLController, FixedKLController
from ppo_affine.model_files import served_folder, write_served_folder
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import Episode, RolloutRunner
from ppo_affine.run_log import (RunLogger, close_run_log, episode_summary, hold_lines_for_the_run_log, open_run_log,
                                report_failure, rollout_progress, say, setup_logging, steps_behind)
from ppo_affine.file_writes import WriteFailed, probe_writable, writing
from ppo_affine.vllm_server import ManagedVLLMServer, VLLMServerError
from ppo_affine.phase_costs import PlannedPhases, phase_peak, planned_against_measured
from ppo_affine.oom_recovery import EpisodeOutOfMemory, TokenBudget, drop_too_long, longest_sequences
from ppo_affine.update import (TooManySkips, TrainingSnapshot, UpdateSettings, UpdateState, build_optimizer, ppo_update,
                               update_signal)
from ppo_affine.config import Config, ConfigError, TrainConfig
from ppo_affine.anchor import AnchorTraining
from ppo_affine.distill.training import CellTraining
from ppo_affine.seeds import derive_seed
from utils import add_config_arguments, config_for_adapter, config_for_checkpoint, config_from_arguments, program_parser

log = logging.getLogger("train_ppo")


class StopRequested:
    """SIGINT/SIGTERM set a flag that the loop checks at phase boundaries and the update before each
    minibatch (an interrupted step is undone); a second signal exits at once."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, _frame) -> None:
        if self.signal is not None:
            os._exit(128 + signum)  # safe: checkpoints are atomic
        self.signal = signum
        # say() prints with emoji=False: the signal may land while the loop's first print imports rich's emoji table
        say(f"{signal.Signals(signum).name}: stopping at the next phase boundary or minibatch, saving the last "
            "finished step, exiting (send again to exit at once)", style="yellow")

    def __bool__(self) -> bool:
        return self.signal is not None


class StepInterrupted(Exception):
    """A stop signal arrived mid-update: the step is abandoned and the last finished one is saved."""


class OutOfMemory(RuntimeError):
    """CUDA ran out of memory on a micro-batch of one sequence: halving the token budget cannot help."""


class BatchFailed(RuntimeError):
    """Most episodes of a step failed: something outside the trainer is broken."""


@dataclass
class PlayedStep:
    """A step's episodes, played and not trained on yet; under `async_steps: 1` the next step's wait here
    through the update and go into every checkpoint, so that a resumed run trains on the very same episodes."""
    episodes: list[Episode]
    group_ids: list[int] | None
    rollout_seconds: float
    costs: dict[str, float] = field(default_factory=dict)  # the rollout's peak memory (phase_costs.phase_peak)


class StartupError(RuntimeError):
    """Something the run depends on cannot be reached; the message says how to fix it."""


class Trainer:
    """Everything one run owns; `train()` is the loop."""

    def __init__(self, config: Config, run_dir: Path, resume_from: Path | None, init_adapter: Path | None = None,
                 ranks: Ranks = ONE_PROCESS):
        self.config, self.run_dir, self.ranks = config, run_dir, ranks
        cfg = config.train
        self.device = ranks.local_device(pick_device(cfg.run.device))
        # DISTILL-V2 cells (distill.*) are read before the model loads: a bad folder or URL is one line, not a wait
        self.cells = CellTraining(cfg.distill, seed=derive_seed(cfg.run.seed, "distill")) if cfg.distill.cells else None
        # so are the anchor's recorded episodes (anchor.*)
        self.anchor = AnchorTraining(cfg.anchor, seed=derive_seed(cfg.run.seed, "anchor")) if cfg.anchor.episodes \
            else None
        return_freed_memory_to_the_os()
        self.policy = load_policy(cfg.model, cfg.lora, self.device)
        if cfg.ppo.disable_dropout:
            for module in self.policy.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        self.optimizer = build_optimizer(self.policy, cfg.ppo, cfg.value_head.learning_rate)
        self.kl_ctl = (AdaptiveKLController(cfg.ppo.init_kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
                       if cfg.ppo.adaptive_kl else FixedKLController(cfg.ppo.init_kl_coef))
        self.curriculum = Curriculum(config.curriculum, seed=cfg.run.seed, is_playable=playable_filter(config.env))
        try:
            self.envs = make_envs(config.env, seed=cfg.run.seed, meets_search=config.curriculum.meets_search_opponent,
                                  ranks_on_machine=ranks.local_world_size)
        except (ConnectionError, RuntimeError) as exc:  # an env server that is down, a container that won't start
            raise StartupError(f"Could not start the environments: {exc}") from None
        self.update_state = UpdateState()
        # halved after CUDA runs out of memory twice in a step, grown back after clean steps (oom_recovery.py)
        self.token_budget = TokenBudget(cfg.ppo.micro_batch_tokens, cfg.ppo.micro_batch_regrow_steps,
                                        cfg.ppo.micro_batch_tokens)
        self._warned_cut_off = False
        self.step = self.saved_step = 0
        self.saved_path: Path | None = None  # the newest checkpoint this run wrote or resumed from
        self.saved_at = time.monotonic()  # rank 0's clock: when the run started or last saved
        self.branch_point: Path | None = None  # the checkpoint resumed from, until the first save sets newer ones aside
        self.totals = {"episodes": 0, "episodes_failed": 0, "generated_tokens": 0}
        self.pending: PlayedStep | None = None  # the next step's episodes, played ahead (async_steps: 1)
        # async_steps: every update runs on this one thread (asyncio's default executor may pick another each
        # time, and each thread that computes gets torch's OpenMP team of its own)
        self.update_thread = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="update")
                              if cfg.async_steps else None)
        self.checkpoint_dir = run_dir / "checkpoints"
        wandb_id = self._resume(resume_from) if resume_from else None
        if init_adapter is not None:
            self._init_adapter(init_adapter)
        self.logger = (RunLogger(run_dir, cfg.logging, config.model_dump(mode="json"), wandb_id, self.step,
                                 fresh=resume_from is None)
                       if ranks.is_main else SilentLogger())
        self.generator = self._make_generator()
        # a CPU run's resident memory is what the memory plan describes: its figures go beside each phase's
        self.planned = PlannedPhases(self.policy.model.config, cfg) if self.policy.device.type == "cpu" else None
        prompts = PromptBuilder(self.policy.tokenizer, cfg.generation.max_prompt_tokens, cfg.model.chat_template_kwargs)
        # envs that run the conversation themselves call this endpoint (served from the generator)
        self.endpoint = endpoint_for(config, self.generator, prompts, self.policy.model.config.model_type)
        self.runner = RolloutRunner(self.envs, self.generator, prompts, cfg.generation, endpoint=self.endpoint,
                                    evaluate_kwargs={name: spec.evaluate_kwargs for name, spec in config.env.envs.items()})
        self.stop = StopRequested()  # last: a failed start leaves the default signal handlers alone

    # ------------------------------------------------------------------ the loop
    async def train(self) -> None:
        cfg = self.config.train
        self.ranks.broadcast_parameters(p for group in self.optimizer.param_groups for p in group["params"])
        if isinstance(self.generator, VLLMServers):
            await self.ranks.all_succeed_async(self.generator.check_server(sampler_logprobs=True))
            if cfg.generation.check_adapter:
                await self.check_adapter_reaches_engine()
            await self.push_adapter(self.step)
        take_step = (self.step_on_cells if cfg.distill.only else self.step_overlapped if cfg.async_steps
                     else self.step_in_turn)
        while self.step < cfg.run.max_steps and not self.stopping():
            if not await take_step():  # interrupted: the step is undone
                break
            if self.save_due():
                self.save()
        if self.stopping() and self.saved_step != self.step:
            self.save()

    async def step_in_turn(self) -> bool:
        """One step: rollout, then update (then the server gets the new adapter); False when interrupted."""
        before = self.curriculum.state_dict(), dict(self.totals)
        started = time.perf_counter()
        played = self.pending or await self.play(*self.sample(), self.step)
        if played is None:  # interrupted mid-rollout: forget this step's draws
            self.forget_step(*before)
            return False
        usable, usable_groups = self.usable(played.episodes, played.group_ids)
        metrics = self.episode_metrics(played)
        if usable:
            learned = self.learn_with_oom_retry(usable, usable_groups)
            if learned is None:  # interrupted mid-update: the weights are back where the step began
                self.forget_step(*before)
                return False
            metrics.update(learned)
        self.pending = None
        max_grad_norm = self.config.train.ppo.max_grad_norm
        if self.cells is not None:  # DISTILL-V2 cells beside the episodes: an optimizer step of their own
            metrics.update(self.cells.step(self.policy, self.optimizer, max_grad_norm, self.anchor))
        elif self.anchor is not None:  # the anchor alone: a step of its own after the update (anchor.py says why)
            metrics.update(self.anchor.step(self.policy, self.optimizer, max_grad_norm))
        self.step += 1
        metrics.update(self.advance_curriculum(played.episodes))
        metrics.update(self.held_out_metrics())
        if isinstance(self.generator, VLLMServers) and usable:
            await self.push_adapter(self.step)
        self.finish_step(played, metrics, started)
        return True

    async def step_on_cells(self) -> bool:
        """One step of the offline mode (`distill.only`): an optimizer step on DISTILL-V2 cells, no episode played."""
        started = time.perf_counter()
        metrics = self.cells.step(self.policy, self.optimizer, self.config.train.ppo.max_grad_norm, self.anchor)
        self.step += 1
        metrics.update(self.held_out_metrics())
        metrics["perf/step_seconds"] = time.perf_counter() - started
        self.logger.log(self.step, metrics)
        return True

    def held_out_metrics(self) -> dict[str, float]:
        """The held-out cells' DISTILL-V2 score and the anchor's held-out KL, at the steps that save a checkpoint."""
        if not self.save_due():
            return {}
        metrics = self.cells.held_out_metrics(self.policy) if self.cells is not None else {}
        return metrics | (self.anchor.held_out_metrics(self.policy) if self.anchor is not None else {})

    async def step_overlapped(self) -> bool:
        """One step under `async_steps: 1`: this step's episodes (played during the last update, by the adapter
        before it) train in a thread while the server plays the next step's with the adapter it has; the new
        adapter is loaded as soon as the update ends and serves the rollout after. The curriculum hears of this
        step's episodes before it draws the next step's tasks, as when the two take turns. False when
        interrupted: the whole step is undone, the update too if it had finished."""
        cfg = self.config.train
        before = self.curriculum.state_dict(), dict(self.totals)
        started = time.perf_counter()
        played = self.pending or await self.play(*self.sample(), self.step)  # the first step has nothing ahead
        if played is None:
            self.forget_step(*before)
            return False
        curriculum_metrics = self.advance_curriculum(played.episodes)
        usable, usable_groups = self.usable(played.episodes, played.group_ids)
        metrics = self.episode_metrics(played)
        ahead = (asyncio.ensure_future(self.play(*self.sample(), self.step + 1))
                 if self.step + 1 < cfg.run.max_steps else None)
        snapshot = TrainingSnapshot.take(self.optimizer, self.update_state)
        undo = self.kl_ctl.state_dict(), self.micro_batch_tokens
        try:
            update = functools.partial(self.learn_with_oom_retry, usable, usable_groups, snapshot)
            learned = await asyncio.get_running_loop().run_in_executor(self.update_thread, update) if usable else {}
            if learned is not None and usable:
                await self.push_adapter(self.step + 1, activate=False)
            updated = time.perf_counter()
            upcoming = await ahead if ahead is not None else None
        except BaseException:
            if ahead is not None:
                ahead.cancel()
                await asyncio.gather(ahead, return_exceptions=True)
            raise
        if learned is None or (ahead is not None and upcoming is None):  # a stop signal
            if learned is not None:
                snapshot.restore(self.optimizer, self.update_state)
                self.kl_ctl.load_state_dict(undo[0])
                self.micro_batch_tokens = undo[1]
            self.forget_step(*before)
            return False
        metrics["perf/wait_for_rollout_seconds"] = time.perf_counter() - updated  # the update's lead, unused
        metrics.update(learned)
        self.pending = upcoming
        self.step += 1
        metrics.update(curriculum_metrics)
        await self.generator.activate_staged()
        self.finish_step(played, metrics, started)
        return True

    def finish_step(self, played: PlayedStep, metrics: dict[str, Any], started: float) -> None:
        cfg = self.config.train
        if cfg.logging.log_samples_every and self.step % cfg.logging.log_samples_every == 0:
            self.logger.log_sample(self.step, played.episodes[0])
        metrics["kl/coef"] = self.kl_ctl.value
        metrics["perf/step_seconds"] = time.perf_counter() - started
        self.logger.log(self.step, metrics)

    def save_due(self) -> bool:
        """After a step: every `save_every` steps, once `save_every_minutes` have passed since the last save (rank
        0's clock, so that every rank decides alike), at the last step, and when stopping."""
        cfg = self.config.train
        minutes = cfg.checkpointing.save_every_minutes
        return (self.step % cfg.checkpointing.save_every == 0 or self.step == cfg.run.max_steps or self.stopping()
                or (minutes is not None and self.ranks.from_main(
                    lambda: time.monotonic() - self.saved_at >= 60 * minutes)))

    def stopping(self) -> bool:
        """SIGINT/SIGTERM reached this rank or another: every rank leaves the loop at the same point."""
        return self.ranks.any(bool(self.stop))

    def check_stop(self) -> None:
        if self.stopping():
            raise StepInterrupted

    def forget_step(self, curriculum_before: dict[str, Any], totals_before: dict[str, int]) -> None:
        """Undo an interrupted step's draws and counts, so that the checkpoint is the last finished step."""
        self.curriculum.load_state_dict(curriculum_before)
        self.totals = totals_before

    # ------------------------------------------------------------------ phases
    def sample(self) -> tuple[list[Task], list[int] | None]:
        """The whole step's tasks, drawn by rank 0 from the run's one curriculum."""
        ppo = self.config.train.ppo

        def draw() -> tuple[list[Task], list[int] | None]:
            if ppo.advantage == "group":
                tasks = self.curriculum.sample_groups(ppo.batch_size // ppo.group_size, ppo.group_size)
                return tasks, [i // ppo.group_size for i in range(len(tasks))]
            return self.curriculum.sample(ppo.batch_size), None

        return self.ranks.from_main(draw)

    async def play(self, tasks: list[Task], group_ids: list[int] | None, step: int) -> PlayedStep | None:
        """The rollout of step `step` (counted from 0), timed; None when it was interrupted."""
        started, costs = time.perf_counter(), {}
        with phase_peak(costs, "rollout", enabled=not self.config.train.async_steps):  # not beside an update
            episodes = await self.rollout(tasks, step)
        return None if episodes is None else PlayedStep(episodes, group_ids, time.perf_counter() - started, costs)

    async def rollout(self, tasks: list[Task], step: int) -> list[Episode] | None:
        """This rank plays its share of `tasks`; returns every rank's episodes, or None when any was interrupted."""
        mine = self.ranks.share(len(tasks))
        with rollout_progress(len(mine), f"step {step + 1} rollout", visible=self.ranks.is_main) as advance:
            play = asyncio.ensure_future(self.runner.run([tasks[i] for i in mine], step,
                                                         on_episode_done=advance, first_index=mine.start))
            while not play.done():
                await asyncio.wait({play}, timeout=0.2)
                if self.stop and not play.done():
                    play.cancel()
                    try:
                        await play
                    except asyncio.CancelledError:
                        pass
            episodes = None if play.cancelled() else play.result()
        return self.ranks.gather_lists(episodes)

    def usable(self, episodes: list[Episode], group_ids: list[int] | None):
        """Failed and cut-off episodes are dropped (a cut-off game has no outcome to learn from); in
        group mode the whole group goes with them."""
        dropped = {i for i, e in enumerate(episodes) if e.error or e.cut_off or not e.turns}
        if group_ids is not None:
            bad_groups = {group_ids[i] for i in dropped}
            dropped |= {i for i, g in enumerate(group_ids) if g in bad_groups}
        keep = [i for i in range(len(episodes)) if i not in dropped]
        errors = sum(1 for e in episodes if e.error)
        if errors > len(episodes) // 2:
            raise BatchFailed(
                f"{errors} of {len(episodes)} episodes failed this step (first error: "
                f"{next(e.error for e in episodes if e.error)}). Check the environment servers and the "
                "generation backend; the last checkpoint is intact."
            )
        cut_off = sum(e.cut_off for e in episodes)
        if cut_off > len(episodes) // 2 and not self._warned_cut_off:
            self._warned_cut_off = True
            log.warning("%d of %d episodes hit generation.max_turns=%d and are not trained on; raise it",
                        cut_off, len(episodes), self.config.train.generation.max_turns)
        return [episodes[i] for i in keep], ([group_ids[i] for i in keep] if group_ids is not None else None)

    @property
    def micro_batch_tokens(self) -> int:
        return self.token_budget.tokens

    @micro_batch_tokens.setter
    def micro_batch_tokens(self, tokens: int) -> None:
        self.token_budget.tokens = tokens

    def learn_with_oom_retry(self, episodes: list[Episode], group_ids: list[int] | None,
                             snapshot: TrainingSnapshot | None = None) -> dict[str, float] | None:
        """`score_and_update`, undone when it cannot finish (oom_recovery.py): an episode longer than
        ppo.max_sequence_tokens is dropped first; CUDA out of memory drops the episode that raised it and runs the
        step again, a second one in the step halves the token budget where that splits the micro-batch (with
        several ranks: every rank halves together, as before); a stop signal returns None, the weights back where
        the step began (as `snapshot` holds them, when the caller took it)."""
        snapshot = snapshot or TrainingSnapshot.take(self.optimizer, self.update_state)
        episodes, group_ids, dropped = drop_too_long(episodes, group_ids, longest_sequences(episodes),
                                                     self.config.train.ppo.max_sequence_tokens)
        retries = dropped_oom = 0
        while True:
            try:
                metrics = self.score_and_update(episodes, group_ids) if episodes else {}
                if self.token_budget.step_finished(ran_out=retries > 0) and self.ranks.is_main:
                    log.info("ppo.micro_batch_tokens back up to %d after %d steps without running out of memory",
                             self.micro_batch_tokens, self.token_budget.regrow_after)
                metrics.update(dropped)
                metrics.update({"train/micro_batch_tokens": self.micro_batch_tokens, "train/oom_retries": retries,
                                "train/episodes_dropped_oom": dropped_oom})
                return metrics
            except StepInterrupted:
                snapshot.restore(self.optimizer, self.update_state)
                log.info("step %d interrupted during the update; its changes are undone", self.step + 1)
                return None
            except torch.cuda.OutOfMemoryError as exc:
                # every rank raises OutOfMemoryOnRanks together; another out-of-memory error leaves the other
                # ranks waiting in an exchange, where they notice this one stopping
                if self.ranks.world_size > 1 and not isinstance(exc, OutOfMemoryOnRanks):
                    raise
                ran_out = getattr(exc, "ranks", [self.ranks.rank])
                # numbers only: the error's traceback holds the failed pass's tensors. With several ranks only this
                # rank knows its episode: they halve together instead
                blamed = None if self.ranks.world_size > 1 else (
                    (exc.episode, exc.tokens) if isinstance(exc, EpisodeOutOfMemory) else getattr(exc, "blamed", None))
                snapshot.restore(self.optimizer, self.update_state)
            # outside the except block: the traceback's references to the failed pass's tensors are gone
            retries += 1
            if blamed is None:
                self.halve_micro_batch_tokens(episodes, ran_out)
            elif self.token_budget.after_out_of_memory(blamed[1], retries) == "drop":
                log.warning("CUDA out of memory in step %d on a sequence of %d tokens: its episode (task %s) is "
                            "dropped and the step runs again", self.step + 1, blamed[1],
                            episodes[blamed[0]].task.task_id)
                episodes = [e for i, e in enumerate(episodes) if i != blamed[0]]
                group_ids = [g for i, g in enumerate(group_ids) if i != blamed[0]] if group_ids is not None else None
                dropped_oom += 1
            else:
                log.warning("CUDA out of memory again in step %d: ppo.micro_batch_tokens halved to %d until %d "
                            "steps run without it; retrying the step", self.step + 1, self.micro_batch_tokens,
                            self.token_budget.regrow_after)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def halve_micro_batch_tokens(self, episodes: list[Episode], ran_out: list[int]) -> None:
        """After CUDA ran out of memory on the ranks `ran_out` (several ranks: which episode raised it is not known
        on every rank): halve the token budget on every rank, unless the longest sequence already has a micro-batch
        of its own."""
        gen = self.config.train.generation
        longest = max(len(sequence.input_ids) for sequence in build_sequences(episodes))
        if self.micro_batch_tokens <= longest:
            raise OutOfMemory(
                f"CUDA ran out of memory on a single sequence of {longest} tokens (ppo.micro_batch_tokens is already "
                f"down to {self.micro_batch_tokens}): it cannot be split. Lower generation.max_prompt_tokens "
                f"({gen.max_prompt_tokens}) or generation.max_new_tokens ({gen.max_new_tokens}), turn on "
                "model.gradient_checkpointing, or use a GPU with more memory. The last checkpoint is intact."
            )
        self.micro_batch_tokens = max(self.micro_batch_tokens // 2, 1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        where = f" on rank {', '.join(map(str, ran_out))}" if self.ranks.world_size > 1 else ""
        if self.ranks.is_main:  # every rank halves; one line says so
            log.warning("CUDA out of memory in step %d%s: ppo.micro_batch_tokens halved to %d until %d steps run "
                        "without it; retrying the step", self.step + 1, where, self.micro_batch_tokens,
                        self.token_budget.regrow_after)

    def score_and_update(self, episodes: list[Episode], group_ids: list[int] | None) -> dict[str, float]:
        """score -> advantages -> PPO update -> adapt beta, on this rank's share of the episodes."""
        cfg = self.config.train
        started = time.perf_counter()
        # this rank's share of the batch; sums over the whole batch go through self.ranks
        mine = self.ranks.share(len(episodes), cfg.ppo.group_size if group_ids is not None else 1)
        sequences = [sequence for sequence in build_sequences(episodes) if sequence.episode in mine]
        lengths = [len(sequence.input_ids) for sequence in sequences]
        # an episode's stripped-history turns as one tree, which runs their shared history once
        sequences = scoring_sequences(sequences, self.micro_batch_tokens,
                                      tree_scoring_mode(self.policy.model.config, cfg.ppo.tree_scoring))
        settings = UpdateSettings(cfg.ppo, self.kl_ctl.value, self.temperature, self.micro_batch_tokens,
                                  shuffle_seed=derive_seed(cfg.run.seed, "minibatches", self.step),
                                  value_only=self.step < cfg.value_head.warmup_steps)
        costs: dict[str, float] = {}
        with training_allocations(), phase_peak(costs, "update", enabled=not cfg.async_steps):
            metrics = self.ranks.agree_on_memory(lambda: score_sequences(
                self.policy, sequences, self.micro_batch_tokens, self.temperature,
                with_values=cfg.ppo.advantage == "gae"))
            metrics["perf/score_seconds"] = time.perf_counter() - started
            self.check_stop()
            gap = sampler_gap(sequences, self.ranks.sum)
            if gap is not None:  # vllm/ or local/: the sampler is the server, or the folded copy in the trainer
                metrics[f"{cfg.generation.backend}/logprob_gap"] = gap
            if cfg.ppo.sampler_correction:
                metrics.update(correct_for_the_sampler(sequences, cfg.ppo.sampler_correction_cap, self.ranks.sum))
            metrics.update(assign_advantages(sequences, episodes, cfg.ppo, self.kl_ctl.value, group_ids,
                                             self.ranks.sum))
            metrics.update(ppo_update(self.policy, self.optimizer, sequences, settings, self.update_state,
                                      task_ids=[episodes[i].task.task_id for i in mine], ranks=self.ranks,
                                      check_stop=self.check_stop))
            every = cfg.logging.signal_check_every
            if every and (self.step + 1) % every == 0:
                metrics.update(update_signal(self.policy, sequences, settings, self.ranks))
        metrics["perf/update_seconds"] = time.perf_counter() - started
        metrics.update(costs)
        if self.planned is not None and lengths:  # the plan's activations and LM head at this step's sizes
            planned_against_measured(metrics, "update", self.planned.update_bytes(lengths, self.micro_batch_tokens))
        self.kl_ctl.update(metrics["reward/kl_per_token"], len(episodes))
        return metrics

    def advance_curriculum(self, episodes: list[Episode]) -> dict[str, Any]:
        stage_before = self.curriculum.stage.name
        for episode in episodes:
            if not episode.error and not episode.cut_off:  # a cut-off game is neither won nor lost
                self.curriculum.report(episode.task, episode.score, episode.success)
        stats = dict(self.curriculum.stats())
        stats["curriculum/stage"] = self.curriculum.stage.name
        if self.curriculum.stage.name != stage_before:
            stats["curriculum/promoted_to"] = self.curriculum.stage.name
            log.info("curriculum: promoted from %s to %s", stage_before, self.curriculum.stage.name)
        return stats

    def episode_metrics(self, played: PlayedStep) -> dict[str, Any]:
        ppo, episodes = self.config.train.ppo, played.episodes
        rewards = {id(e): final_reward(e, ppo) + sum(turn_rewards(e, ppo)) for e in episodes}
        metrics = episode_summary(episodes, played.rollout_seconds, rewards)
        metrics.update(played.costs)
        metrics.update(steps_behind(episodes, self.step))
        self.totals["episodes"] += len(episodes)
        self.totals["episodes_failed"] += metrics["env/episodes_failed"]
        self.totals["generated_tokens"] += sum(e.generated_tokens for e in episodes)
        metrics["totals/episodes"] = self.totals["episodes"]
        metrics["totals/episodes_failed"] = self.totals["episodes_failed"]
        metrics["dist/world_size"] = self.ranks.world_size
        if isinstance(self.generator, LocalGenerator):  # the KV budget's readings over the rollout (perf/kv_*)
            metrics.update(self.generator.memory_metrics())
            # beside perf/prefill_tokens: what the episodes hold at their end (each last sequence ends with its last
            # reply), the least a rollout that continued every turn from the last one's cache would prefill
            metrics["perf/final_tokens"] = float(sum(len(e.sequences[-1]) for e in episodes if e.sequences))
            # the rollout's wall time not spent in a generation step: the envs' and the harnesses' own
            metrics["perf/env_seconds"] = max(0.0, played.rollout_seconds - metrics["perf/generation_seconds"])
            if self.planned is not None:  # the most keys and values the caches held at once, and the folded weights
                planned_against_measured(metrics, "rollout", metrics["perf/kv_peak_tokens"] *
                                         self.generator.caches.bytes_per_token + self.generator.folded_copy_bytes())
        for name, (_, env) in self.envs.items():
            counts = self.ranks.sum_stats(env.error_counts() if hasattr(env, "error_counts") else {})
            metrics.update({f"env_errors/{name}/{k}": v for k, v in counts.items()})
        return metrics

    # ------------------------------------------------------------------ generation, checkpoints
    @property
    def temperature(self) -> float:
        return self.config.train.generation.temperature

    def _make_generator(self):
        cfg = self.config.train
        if cfg.generation.backend == "local":
            return LocalGenerator(self.policy, cfg.generation, seed=self.ranks.seed(cfg.run.seed))
        api_key = os.environ.get(self.config.env.vllm_api_key_env) if self.config.env.vllm_api_key_env else None
        return VLLMServers(self.config.env.vllm_urls, cfg.model.name_or_path, self.policy.tokenizer,
                           cfg.generation, cfg.lora.r,
                           eos_token_ids(self.policy.tokenizer, self.policy.model.generation_config), api_key=api_key,
                           served_from=served_folder(cfg.model))

    async def check_adapter_reaches_engine(self) -> None:
        """Before any sample: rank 0 loads a probe adapter (non-zero B) into every vLLM server and checks that the
        servers' log-probs of a few tokens sampled with it are the trainer's (engines with LoRA bugs serve the
        base model's and would have the run learn from base-model samples); a VLLMError stops the run."""
        await self.ranks.from_main_async(lambda: check_engine_applies_adapters(
            self.policy, self.generator, self.run_dir / "vllm_adapters" / "probe"))

    async def push_adapter(self, step: int, activate: bool = True) -> None:
        """Rank 0 saves the LoRA weights (those after `step` updates) alone and hot-loads them into every vLLM
        server under a new name; every rank then requests that name. `activate=False` stages them: requests keep
        the adapter they have until `activate_staged` (async_steps)."""

        async def save_and_load() -> list[str]:
            folder = self.run_dir / "vllm_adapters" / f"step-{step}"
            with writing("the adapter for vLLM", folder):
                self.policy.model.save_pretrained(folder)
            names = await self.generator.load_adapter(folder, f"{self.run_dir.name}-step-{step}", step, activate)
            in_use = {path.name for path in self.generator.loaded.values()}
            for old in (self.run_dir / "vllm_adapters").iterdir():
                if old.name not in in_use:
                    shutil.rmtree(old, ignore_errors=True)
            return names

        names = await self.ranks.from_main_async(save_and_load)
        if activate:
            self.generator.use_adapters(names, step)

    def save(self) -> None:
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "kl_controller": self.kl_ctl.state_dict(),
            "curriculum": self.curriculum.state_dict(),
            "update_state": vars(self.update_state),
            "totals": dict(self.totals),
            "rng": self.ranks.gather(rng_state()),  # by rank
            "config": self.config.model_dump(mode="json"),
            "wandb_id": self.logger.wandb_id,
            "micro_batch_tokens": self.micro_batch_tokens,  # below the config's after an out-of-memory error
            # async_steps: the next step's episodes, played during this step's update (a dict: the class lives here)
            "pending": vars(self.pending) if self.pending is not None else None,
            "distill": self.cells.state_dict() if self.cells is not None else None,  # the cells' draws
            "anchor": self.anchor.state_dict() if self.anchor is not None else None,  # the anchor's draws
        }
        path = self.ranks.from_main(lambda: self.write_checkpoint(state))
        self.saved_step, self.saved_path, self.saved_at = self.step, path, time.monotonic()
        log.info("saved %s", path)

    def write_checkpoint(self, state: dict[str, Any]) -> Path:
        """Rank 0's part of a save; the first save of a run resumed from an older checkpoint of this folder first sets
        the newer ones aside (their branch is left)."""
        if self.branch_point is not None and self.branch_point.parent.resolve() == self.checkpoint_dir.resolve():
            with writing("the checkpoints folder", self.checkpoint_dir):
                set_aside_newer(self.checkpoint_dir, self.branch_point)
        self.branch_point = None
        return save_checkpoint(self.checkpoint_dir, self.step, self.policy.save, state,
                               self.config.train.checkpointing.keep_last)

    def _resume(self, checkpoint: Path) -> str | None:
        """Restore everything of `checkpoint` (already checked against its manifest by `resume_checkpoint`)."""
        state = load_trainer_state(checkpoint)
        if "optimizer" not in state:
            raise ConfigError(f"--resume {checkpoint}: this checkpoint holds no PPO run to continue (e.g. an SFT "
                              f"warm start); start PPO from its adapter with --init-adapter {checkpoint}.")
        self.policy.load(checkpoint)
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.curriculum.load_state_dict(state["curriculum"])
        self.update_state = UpdateState(**state["update_state"])
        self.totals = state["totals"]
        self.step = self.saved_step = state["step"]
        self.pending = PlayedStep(**state["pending"]) if state.get("pending") else None
        if self.cells is not None and state.get("distill"):
            self.cells.load_state_dict(state["distill"])
        if self.anchor is not None and state.get("anchor"):
            self.anchor.load_state_dict(state["anchor"])
        self.saved_path = self.branch_point = checkpoint
        self._keep_a_halved_token_budget(state)
        rng = rng_state_of(self.ranks, state["rng"])
        if rng is not None:  # else: a rank the saving run did not have keeps the state its seed gave it
            set_rng_state(rng)
        log.info("resumed from %s (step %d)", checkpoint, self.step)
        return state.get("wandb_id")

    def _keep_a_halved_token_budget(self, state: dict[str, Any]) -> None:
        """A budget halved after running out of memory stays halved when the run resumes on the same setting;
        a ppo.micro_batch_tokens changed since (e.g. on a bigger GPU) is the user's choice and wins."""
        saved = state.get("micro_batch_tokens")
        configured_then = state["config"]["train"]["ppo"]["micro_batch_tokens"]
        if saved is not None and saved < configured_then == self.micro_batch_tokens:
            self.micro_batch_tokens = saved
            log.warning("ppo.micro_batch_tokens stays at %d, halved after running out of memory before the resume "
                        "(give ppo.micro_batch_tokens another value to override)", saved)

    def _init_adapter(self, path: Path) -> None:
        """Start from another run's adapter (e.g. sft_warmstart.py's), and its value head when there is one."""
        self.policy.load_adapter(adapter_folder(path))
        value_head = Path(path) / VALUE_HEAD_FILE
        if value_head.is_file():
            self.policy.value_head.load_state_dict(torch.load(value_head, map_location=self.policy.device))
        anchored_to_it = self.config.train.ppo.kl_reference == "init_adapter"
        if anchored_to_it:
            self.policy.set_reference_adapter(adapter_folder(path))
        log.info("initial adapter from %s (KL reference: %s)", path,
                 "that adapter" if anchored_to_it else "the base model")

    async def close(self) -> None:
        if self.update_thread is not None:
            self.update_thread.shutdown()
        if self.endpoint is not None:
            await self.endpoint.close()
        await self.generator.close()
        for _, env in self.envs.values():
            try:
                await env.close()
            except Exception as exc:
                log.warning("closing env failed: %s", exc)
        self.logger.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = program_parser(__doc__)
    add_config_arguments(parser, set_example="ppo.learning_rate=2e-5")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", help="continue a run: its checkpoint folder, or 'latest' (the newest checkpoint of "
                        "the configured run that verifies) (default: none: a new run, refused in a folder that holds "
                        "checkpoints)")
    resume.add_argument("--init-adapter", type=Path,
                        help="start a new run from this adapter (a checkpoint or adapter folder, e.g. "
                        "sft_warmstart.py's) (default: none: a fresh LoRA)")
    parser.add_argument("--output-dir", help="parent folder of run folders, overriding run.output_dir (default: "
                        "run.output_dir, 'runs' in the shipped configs)")
    parser.add_argument("--max-steps", type=int, help="the step to stop after, overriding run.max_steps (default: "
                        "run.max_steps)")
    return parser.parse_args(argv)


def check_can_train(cfg: TrainConfig, world_size: int) -> None:
    """What a PPO run needs beyond a valid configuration: facts of this launch (ranks, 4-bit support) and settings that
    only training rules out; evaluate.py plays at temperature 0, and bench/learning.py evaluates with the cpu
    preset's 3 steps what it trained with a 4-step critic warm-up."""
    warmup = cfg.value_head.warmup_steps
    if warmup >= cfg.run.max_steps:
        raise ConfigError(f"value_head.warmup_steps={warmup} covers every step of run.max_steps="
                          f"{cfg.run.max_steps}, so the policy would never train: lower the warm-up.")
    if cfg.generation.temperature == 0:
        raise ConfigError("generation.temperature=0 samples nothing for PPO to learn from (greedy replies): "
                          "train with a temperature > 0; evaluate.py plays greedily on its own.")
    check_world_size(cfg.ppo, world_size)
    if cfg.distill.cells and world_size > 1:
        raise ConfigError("distill.cells trains in one process (its optimizer step exchanges no gradients between "
                          "ranks): run it without torchrun, or leave distill.cells unset.")
    if cfg.anchor.episodes and world_size > 1:
        raise ConfigError("anchor.episodes trains in one process (its gradients are not exchanged between ranks): "
                          "run it without torchrun, or leave anchor.episodes empty.")
    if cfg.async_steps and world_size > 1:
        raise ConfigError("async_steps=1 runs in one process: with several ranks the update's exchanges would "
                          "interleave with the rollout's; set async_steps=0 for data-parallel runs.")
    if cfg.generation.top_p < 1 or cfg.generation.top_k:
        log.warning("generation.top_p/top_k truncate sampling, but old log-probs are scored on the full "
                    "distribution (temperature only), so the PPO ratio starts slightly off-policy; "
                    "keep top_p=1 and top_k=0 for training")
    if cfg.model.use_4bit:  # before anything is loaded or started
        check_4bit_support(pick_device(cfg.run.device))
    owned = cfg.generation.vllm_server.python
    if cfg.generation.backend == "vllm" and pick_device(cfg.run.device).type == "cpu":
        check_vllm_cpu_serves(cfg.model, owned is not None)
    if owned is not None:
        if world_size > 1:
            raise ConfigError("generation.vllm_server.python starts one vLLM server for one process; with several "
                              "ranks start one server per GPU yourself and list them in env.vllm_url.")
        if not os.access(Path(owned).expanduser(), os.X_OK):
            raise ConfigError(f"generation.vllm_server.python={owned!r} is not an executable file: give the Python of "
                              "vLLM's virtual environment (README: Training on a GPU with vLLM).")


def check_vllm_cpu_serves(model_cfg, owned: bool) -> None:
    """A CPU run's vLLM server is vllm-cpu when the run starts it; a server it is pointed at may run on a GPU."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_source(model_cfg), trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError):  # not here yet: loading the model says what is missing, with its own message
        return
    served, why = served_by_vllm_cpu(config)
    if served:
        return
    if owned:
        raise ConfigError(f"generation.backend=vllm with generation.vllm_server on a CPU: {why}. Use "
                          "generation.backend=local on a CPU.")
    log.warning("generation.backend=vllm on a CPU machine: if that server is vllm-cpu, %s", why)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    flags = [f"run.output_dir={args.output_dir}"] if args.output_dir else []
    if args.max_steps is not None:
        flags.append(f"run.max_steps={args.max_steps}")
    trainer, ranks, server = None, ONE_PROCESS, None
    try:
        ranks = Ranks.from_environment()  # torchrun / accelerate launch: one process per rank
        if ranks.is_main:  # train.log gets every line, those before the run folder is known included
            hold_lines_for_the_run_log()
        else:  # rank 0 reports the run; the others only their own trouble
            setup_logging(logging.WARNING, prefix=f"[rank {ranks.rank}] ")
        config = config_from_arguments(args, flags=flags)
        config, resume_from = run_configuration(args, config, flags, ranks.is_main)  # checkpoints checked here
        cfg = config.train
        check_can_train(cfg, ranks.world_size)
        torch.manual_seed(cfg.run.seed)
        run_dir = Path(cfg.run.output_dir) / cfg.run.name
        earlier = list_checkpoints(run_dir / "checkpoints")
        if earlier and not args.resume:
            raise ConfigError(f"{run_dir} already holds checkpoints of an earlier run (newest: {earlier[-1][1].name}); "
                              "continue it with --resume latest, or start a new run elsewhere (--set run.name=NEW "
                              "or --output-dir DIR).")
        if ranks.is_main:  # a read-only disk, a full one or a file in the way: one line now, not after the model loads
            probe_writable(run_dir, "the run folder")
            open_run_log(run_dir)
        ranks.start(ranks.local_device(pick_device(cfg.run.device)), cfg.run.rank_timeout_minutes)
        if cfg.generation.vllm_server.python is not None:  # started first: it loads while the trainer does
            device = pick_device(cfg.run.device)
            server = ManagedVLLMServer.for_run(cfg, write_served_folder(cfg.model, device), run_dir,
                                               cpu=device.type == "cpu")
            server.start()
            config = config.model_copy(update={"env": config.env.model_copy(update={"vllm_url": server.url})})
        trainer = ranks.all_succeed(lambda: Trainer(config, run_dir, resume_from, args.init_adapter, ranks))
        if server is not None:
            server.wait_ready()
        asyncio.run(_train_and_close(trainer))
        if ranks.is_main:
            for line in trainer.logger.summary(trainer.saved_path):
                say(line)
        if trainer.stop.signal is not None:  # a scheduler that preempted the run sees it did not finish
            log.info("stopped by %s after step %d%s", signal.Signals(trainer.stop.signal).name, trainer.saved_step,
                     "; continue with --resume latest" if trainer.saved_step else " (nothing to save yet)")
            return 128 + trainer.stop.signal
    except ConfigError as exc:
        return report_failure("Configuration error", exc, 2, shown=ranks.is_main)
    except (TooManySkips, VLLMError, VLLMServerError, StartupError, BatchFailed, RankFailed, WriteFailed,
            OutOfMemory, EndpointUnused) as exc:
        # rank 0 hears of every other failure
        return report_failure("Stopped", exc, 1, shown=ranks.is_main or isinstance(exc, RankLost))
    finally:
        if server is not None:
            server.stop()
        if trainer is not None:  # only now: a launcher's SIGTERM during the clean-up must not cut the report short
            trainer.stop.restore()
        ranks.close()
        close_run_log()
    return 0


def run_configuration(args: argparse.Namespace, config: Config, flags: list[str], is_main: bool
                      ) -> tuple[Config, Path | None]:
    """The run's configuration and the checkpoint it resumes from, both settled before any model loads: a
    checkpoint is checked against its manifest (a corrupt newest one is set aside under `--resume latest`), and
    its saved configuration is the base a resumed run goes on with; `--init-adapter` takes its model from it."""
    if args.resume:
        checkpoint = resume_checkpoint(args.resume, config, is_main)
        if checkpoint.parent.name == "checkpoints":  # the run goes on in the folder its checkpoint is in
            run_folder = checkpoint.parent.parent
            flags = [f"run.output_dir={run_folder.parent}", f"run.name={run_folder.name}", *flags]
        return config_for_checkpoint(args, checkpoint, flags=flags, continue_run=True), checkpoint
    if args.init_adapter is not None:
        return config_for_adapter(args, args.init_adapter, flags=flags)[0], None
    return config, None


def resume_checkpoint(resume: str, config: Config, is_main: bool) -> Path:
    """`--resume latest` (the newest checkpoint of the configured run that verifies) or a checkpoint path, checked."""
    if resume == "latest":
        checkpoint_dir = Path(config.train.run.output_dir) / config.train.run.name / "checkpoints"
        with writing("the checkpoints folder", checkpoint_dir):  # cleaning up may rename and delete
            checkpoint = find_resumable(checkpoint_dir, clean=is_main)
        if checkpoint is None:
            raise ConfigError(f"--resume latest: no complete checkpoint under {checkpoint_dir} (name the run with "
                              "--set run.name=NAME or its preset, or give the checkpoint folder: --resume PATH).")
    else:
        checkpoint = Path(resume)
        check_checkpoint(checkpoint)
    if checkpoint_kind(checkpoint) not in (None, PPO_KIND):
        raise ConfigError(f"--resume {checkpoint}: this checkpoint holds no PPO run to continue (an SFT warm "
                          f"start); start PPO from its adapter with --init-adapter {checkpoint}.")
    return checkpoint


async def _train_and_close(trainer: Trainer) -> None:
    try:
        await trainer.train()
    finally:
        await trainer.close()


if __name__ == "__main__":
    sys.exit(main())
