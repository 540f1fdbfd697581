"""Data-parallel training over torch.distributed: who samples, who writes, what the ranks exchange.

`torchrun --nproc-per-node N train_ppo.py ...` or `accelerate launch --multi_gpu --num_processes N
train_ppo.py ...` start N processes (ranks) and set WORLD_SIZE, RANK and LOCAL_RANK. Every rank runs
the whole loop on its own device (the GPU of its local rank over NCCL, or the CPU over gloo) and the
ranks meet at fixed points:
- sample: rank 0 draws the step's `ppo.batch_size` tasks from the run's one curriculum (`from_main`);
  rank r plays the r-th contiguous share (`share`), so a group never straddles two ranks.
- rollout: every rank gets every episode back (`gather_lists`), so the curriculum, the metrics and
  decisions such as "most of the batch failed" are the same on every rank.
- learn: rank r scores and trains the r-th share of the usable episodes. Each rank's loss is divided
  by the whole batch's weight and gradients are summed (`sum_gradients`), advantage moments and
  statistics too (`sum`, `sum_stats`), so every rank takes the step one process would take on the
  whole batch.
- write: rank 0 alone writes checkpoints, metrics, samples and wandb; the others wait for it.
- fail: `all_succeed` raises on every rank when one fails; a rank that vanishes mid-exchange becomes
  a `RankFailed` on the others, so no rank waits for one that has given up. CUDA out of memory in
  the forward and backward passes is agreed on (`agree_on_memory`): every rank raises it together,
  and all retry the step with half the token budget.
Without a launcher (`python train_ppo.py`) `ONE_PROCESS` stands in and nothing is exchanged.

Why not DistributedDataParallel: DDP expects every rank to run the same number of forward/backward
passes through the wrapped module's `forward`. Here micro-batches are packed by a token budget (ranks
run different numbers, a rank may have none), scoring goes through `Policy.score`, and the critic
warm-up leaves the adapter without gradients. One all-reduce of the trainable gradients per optimizer
step is what DDP's reducer would do for LoRA's few million parameters, without those constraints.
"""
from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, TypeVar

import torch
import torch.distributed as dist

from ppo_affine.config import ConfigError, PPOConfig
from ppo_affine.seeds import derive_seed

log = logging.getLogger(__name__)
T = TypeVar("T")


class RankFailed(RuntimeError):
    """Another rank failed; rank 0 reports it."""


class RankLost(RankFailed):
    """Another rank disappeared mid-exchange (crashed, killed); its own output says why."""


class OutOfMemoryOnRanks(torch.cuda.OutOfMemoryError):
    """CUDA ran out of memory on `ranks` in work every rank had to finish first (`Ranks.agree_on_memory`); raised
    on every rank at the same point, so that all of them can retry the step together."""

    def __init__(self, ranks: list[int], blamed: tuple[int, int] | None = None):
        super().__init__(f"CUDA ran out of memory on rank {', '.join(map(str, ranks))}")
        self.ranks = ranks
        # this rank's (episode, tokens) when its error named the episode whose sequence raised it
        # (oom_recovery.EpisodeOutOfMemory); the other ranks' are not known here
        self.blamed = blamed


def check_world_size(ppo: PPOConfig, world_size: int) -> None:
    """Every rank plays an equal share of the batch, and a group stays on one rank: one-line ConfigError otherwise."""
    if world_size == 1:
        return
    if ppo.batch_size % world_size:
        raise ConfigError(f"ppo.batch_size={ppo.batch_size} episodes cannot be shared equally by {world_size} ranks "
                          f"(WORLD_SIZE={world_size}): set ppo.batch_size to a multiple of {world_size}.")
    if ppo.advantage == "group" and (ppo.batch_size // world_size) % ppo.group_size:
        raise ConfigError(f"ppo.batch_size={ppo.batch_size} holds {ppo.batch_size // ppo.group_size} group(s) of "
                          f"ppo.group_size={ppo.group_size} episodes, which {world_size} ranks cannot share without a "
                          f"group straddling two ranks: set ppo.batch_size to a multiple of "
                          f"{ppo.group_size * world_size} (ppo.group_size x ranks).")


@dataclass
class Ranks:
    """This process's place among the run's ranks, and every exchange between them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1  # ranks on this machine
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where exchanged tensors live

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "Ranks":
        """The launcher's WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE (one process without them); no
        exchange yet."""
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        try:
            rank, world_size, local_rank, local_world_size = (int(environ.get(name, default))
                                                              for name, default in zip(names, "0101"))
        except ValueError:
            given = ", ".join(f"{name}={environ.get(name)!r}" for name in names)
            raise ConfigError(f"RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers, got {given}; "
                              "start the ranks with torchrun or accelerate launch.") from None
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def local_device(self, device: torch.device) -> torch.device:
        """The GPU of this rank's local rank when training on CUDA; any other device as it is."""
        if self.world_size == 1 or device.type != "cuda":
            return device
        # a launcher that shows each process only its own GPU leaves one visible device
        return torch.device("cuda", self.local_rank % torch.cuda.device_count())

    def start(self, device: torch.device, timeout_minutes: float) -> None:
        """Join the other ranks: NCCL between GPUs, gloo between CPU processes."""
        if self.world_size == 1:
            return
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        with self._exchange("starting (is every rank launched with the same torchrun/accelerate command?)"):
            dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
        log.info("rank %d of %d on %s (%s)", self.rank, self.world_size, device, backend)

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def seed(self, seed: int) -> int:
        """This rank's own seed for what each rank draws apart (its generation waves); rank 0 keeps the run's."""
        return seed if self.rank == 0 else derive_seed(seed, "rank", self.rank)

    def share(self, count: int, unit: int = 1) -> range:
        """This rank's contiguous share of `count` items, cut between whole units (groups), as even as they allow."""
        units = count // unit
        start = self.rank * units // self.world_size * unit
        stop = count if self.rank == self.world_size - 1 else (self.rank + 1) * units // self.world_size * unit
        return range(start, stop)

    # ------------------------------------------------------------------ exchanges
    @contextmanager
    def _exchange(self, doing: str) -> Iterator[None]:
        try:
            yield
        except RankFailed:
            raise
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection, or the timeout passed
            # its first sentence, without gloo's [source:line] tag
            reason = re.sub(r"^\[[^\]]*\]\s*", "", (str(exc).splitlines() or [""])[0]).split(". ")[0][:300]
            raise RankLost(
                f"rank {self.rank} lost contact with another rank while {doing} ({reason}). The other rank's "
                "own output says why; every checkpoint written so far is intact: fix the cause and continue "
                "with --resume latest."
            ) from None

    def gather(self, value: T) -> list[T]:
        """Every rank's `value`, by rank, on every rank."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        with self._exchange("gathering results"):
            dist.all_gather_object(values, value)
        return values

    def gather_lists(self, items: list | None) -> list | None:
        """Every rank's list concatenated in rank order; None on every rank when any rank had None (interrupted)."""
        parts = self.gather(items)
        if any(part is None for part in parts):
            return None
        return [item for part in parts for item in part]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the ranks (the identity for one process)."""
        if self.world_size == 1:
            return values
        total = values.detach().to(self.device, copy=True)
        with self._exchange("summing batch statistics"):
            dist.all_reduce(total)
        return total.to(values.device)

    def any(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank."""
        return bool(self.sum(torch.tensor([float(flag)]))[0] > 0)

    def offset(self, count: int) -> tuple[int, int]:
        """Where this rank's `count` items start in the rank-ordered whole, and the whole's size."""
        counts = self.sum(torch.nn.functional.one_hot(torch.tensor(self.rank), self.world_size).double() * count)
        counts = [int(c) for c in counts.tolist()]
        return sum(counts[: self.rank]), sum(counts)

    def agree_on_memory(self, work: Callable[[], T]) -> T:
        """`work()`: this rank's own computation, with no exchange inside. When CUDA runs out of memory in it on
        any rank, every rank raises OutOfMemoryOnRanks here once all have finished their part, instead of the
        others waiting for that rank in their next exchange."""
        blamed = None
        try:
            result, ran_out = work(), False
        except torch.cuda.OutOfMemoryError as exc:
            result, ran_out = None, True
            if hasattr(exc, "episode"):  # numbers only: the error's traceback holds the failed pass's tensors
                blamed = (exc.episode, exc.tokens)
        # past the except block: the failed pass's tensors are freed before the exchange allocates
        flags = self.sum(torch.nn.functional.one_hot(torch.tensor(self.rank), self.world_size).float() * ran_out)
        ranks = [rank for rank, flag in enumerate(flags.tolist()) if flag]
        if ranks:
            raise OutOfMemoryOnRanks(ranks, blamed)
        return result

    def sum_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """Each statistic summed over the ranks that have it, in rank order (the same floats on every rank)."""
        if self.world_size == 1:
            return stats
        totals: dict[str, float] = {}
        for part in self.gather(stats):
            for key, value in part.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Replace each gradient by its sum over the ranks, in one all-reduce. A parameter that has a gradient on
        no rank keeps none (the optimizer then leaves it alone, as it would in one process)."""
        if self.world_size == 1:
            return
        parameters = list(parameters)
        has_grad = torch.tensor([float(p.grad is not None) for p in parameters], device=self.device)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float().to(self.device)
                          for p in parameters] + [has_grad])
        with self._exchange("summing gradients"):
            dist.all_reduce(flat)
        position = 0
        for index, parameter in enumerate(parameters):
            size = parameter.numel()
            summed = flat[position:position + size]
            position += size
            present = bool(flat[-len(parameters) + index] > 0)
            parameter.grad = summed.view_as(parameter).to(parameter.device, parameter.dtype) if present else None

    def broadcast_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Rank 0's values of `parameters` on every rank (initialisations may have drawn different numbers)."""
        if self.world_size == 1:
            return
        with self._exchange("sharing the initial weights"), torch.no_grad():
            for parameter in parameters:
                value = parameter.data.to(self.device)
                dist.broadcast(value, src=0)
                parameter.data.copy_(value.to(parameter.device))

    # ------------------------------------------------------------------ one rank acts, every rank knows
    def from_main(self, compute: Callable[[], T]) -> T:
        """`compute()` on rank 0 alone (drawing tasks, writing a checkpoint); its result on every rank, or its
        failure raised on every rank. The other ranks wait here until rank 0 is done."""
        outcome: tuple[bool, Any] | None = None
        if self.is_main:
            try:
                outcome = (True, compute())
            except Exception as exc:
                self._tell_the_others_rank_0_failed(exc)
                raise
        return self._delivered(outcome)

    async def from_main_async(self, compute: Callable[[], Awaitable[T]]) -> T:
        """`from_main` for a coroutine function."""
        outcome: tuple[bool, Any] | None = None
        if self.is_main:
            try:
                outcome = (True, await compute())
            except Exception as exc:
                self._tell_the_others_rank_0_failed(exc)
                raise
        return self._delivered(outcome)

    def _tell_the_others_rank_0_failed(self, exc: Exception) -> None:
        if self.world_size > 1:  # the other ranks wait in _delivered for rank 0's outcome
            self._share((False, f"{type(exc).__name__}: {exc}"), "waiting for rank 0")

    def _delivered(self, outcome: tuple[bool, Any] | None) -> Any:
        if self.world_size == 1:
            return outcome[1]
        ok, value = self._share(outcome, "waiting for rank 0")
        if not ok:
            raise RankFailed(f"rank 0 failed: {value}")
        return value

    def _share(self, outcome: Any, doing: str) -> Any:
        box = [outcome]
        with self._exchange(doing):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_succeed(self, compute: Callable[[], T]) -> T:
        """`compute()` on every rank; when any rank fails, every rank raises (that rank its own error, the others
        a RankFailed naming it), so a start-up failure on one rank stops all of them instead of leaving them waiting."""
        try:
            result = compute()
        except Exception as exc:
            self._agree(exc)
            raise
        self._agree(None)
        return result

    async def all_succeed_async(self, awaitable: Awaitable[T]) -> T:
        """`all_succeed` for an awaitable."""
        try:
            result = await awaitable
        except Exception as exc:
            self._agree(exc)
            raise
        self._agree(None)
        return result

    def _agree(self, error: Exception | None) -> None:
        if self.world_size == 1:
            return
        failures = self.gather(None if error is None else f"{type(error).__name__}: {error}")
        if error is None:
            for rank, failure in enumerate(failures):
                if failure is not None:
                    raise RankFailed(f"rank {rank} failed: {failure}")


ONE_PROCESS = Ranks()


def rng_state_of(ranks: Ranks, saved: Any) -> dict[str, Any] | None:
    """This rank's RNG state from a checkpoint (a list by rank; older checkpoints hold one process's state);
    None for a rank the checkpoint has no state for (the run now has more ranks than the one that saved)."""
    states = saved if isinstance(saved, list) else [saved]
    return states[ranks.rank] if ranks.rank < len(states) else None


class SilentLogger:
    """The run logger of every rank but 0: rank 0 alone writes metrics.jsonl, samples.jsonl and wandb."""

    wandb_id = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def log_sample(self, step: int, episode: Any, index: int = 0) -> None:
        pass

    def close(self) -> None:
        pass
