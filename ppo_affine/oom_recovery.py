"""No single episode stops a run: what the trainer does with an episode too long for the GPU.

- Before the update, an episode with a sequence longer than `ppo.max_sequence_tokens` (the longest the memory plan
  fits, `prepare_model.py --plan`) is dropped, its length in the log and a metric (`drop_too_long`).
- CUDA out of memory in a micro-batch names the episode whose sequence raised it (`blamed_on`: the longest sequence
  of that micro-batch). The first such error of a step drops that whole episode (its returns, GAE and group baseline
  span all its sequences) and the step runs again without it; a later one in the same step halves the micro-batch
  budget when that splits the failing micro-batch, else drops that episode too (`TokenBudget.after_out_of_memory`).
- A halved budget grows back, doubling up to the configured one, after `ppo.micro_batch_regrow_steps` steps in a row
  without running out of memory.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class EpisodeOutOfMemory(torch.cuda.OutOfMemoryError):
    """CUDA ran out of memory on a micro-batch whose longest sequence, of `tokens` tokens, belongs to `episode` (an
    index into the episodes the sequences were built from). An OutOfMemoryError, so every handler of one sees it."""

    def __init__(self, episode: int, tokens: int):
        super().__init__(f"CUDA ran out of memory on a micro-batch whose longest sequence ({tokens} tokens) is "
                         f"episode {episode}'s")
        self.episode, self.tokens = episode, tokens


@contextlib.contextmanager
def blamed_on(batch) -> Iterator[None]:
    """Run one micro-batch's pass; CUDA out of memory in it becomes an EpisodeOutOfMemory naming its longest
    sequence's episode (`batch`: a batching.Batch)."""
    try:
        yield
    except EpisodeOutOfMemory:
        raise
    except torch.cuda.OutOfMemoryError:
        longest = max(batch.sequences, key=lambda sequence: len(sequence.input_ids))
        raise EpisodeOutOfMemory(longest.episode, len(longest.input_ids)) from None


def longest_sequences(episodes: list) -> list[int]:
    """Each episode's longest training sequence in tokens (0 for one with no reply)."""
    from ppo_affine.batching import build_sequences

    longest = [0] * len(episodes)
    for sequence in build_sequences(episodes):
        longest[sequence.episode] = max(longest[sequence.episode], len(sequence.input_ids))
    return longest


def drop_too_long(episodes: list, group_ids: list[int] | None, lengths: list[int], limit: int | None
                  ) -> tuple[list, list[int] | None, dict[str, float]]:
    """The episodes (and their group ids) whose longest sequence (`lengths`) is at most `limit` tokens, and the
    metrics of the ones dropped; None keeps them all."""
    too_long = [i for i, length in enumerate(lengths) if limit is not None and length > limit]
    for i in too_long:
        log.warning("episode of task %s dropped before the update: a sequence of %d tokens, over "
                    "ppo.max_sequence_tokens=%d", getattr(episodes[i].task, "task_id", "?"), lengths[i], limit)
    kept = [i for i in range(len(episodes)) if i not in set(too_long)]
    return ([episodes[i] for i in kept], [group_ids[i] for i in kept] if group_ids is not None else None,
            {"train/episodes_too_long": float(len(too_long)),
             "train/longest_dropped_tokens": float(max((lengths[i] for i in too_long), default=0))})


@dataclass
class TokenBudget:
    """The update's micro-batch token budget: halved after running out of memory, grown back after clean steps."""
    configured: int  # ppo.micro_batch_tokens
    regrow_after: int  # ppo.micro_batch_regrow_steps
    tokens: int  # the budget now
    clean_steps: int = 0  # steps in a row without running out of memory

    def after_out_of_memory(self, longest: int, errors_this_step: int) -> str:
        """What to do about the `errors_this_step`-th out-of-memory error of a step (1 = the first) in a micro-batch
        whose longest sequence has `longest` tokens: "drop" the episode that raised it, or "halve" the budget (done
        here) where that splits the failing micro-batch."""
        self.clean_steps = 0
        if errors_this_step > 1 and self.tokens > longest:  # its micro-batch holds more than one sequence
            self.tokens = max(self.tokens // 2, 1)
            return "halve"
        return "drop"

    def step_finished(self, ran_out: bool) -> bool:
        """Count a finished step; returns whether the budget grew back (doubled, at most to the configured one)."""
        self.clean_steps = 0 if ran_out else self.clean_steps + 1
        if self.tokens >= self.configured or self.clean_steps < self.regrow_after:
            return False
        self.tokens, self.clean_steps = min(self.tokens * 2, self.configured), 0
        return True
