"""oom_recovery.py: which episode an out-of-memory error names, what the trainer does about it, and the token budget
that halves and grows back. The whole loop under injected errors is in tests/test_train.py."""
from types import SimpleNamespace

import pytest
import torch

from ppo_affine.batching import TrainSequence
from ppo_affine.oom_recovery import EpisodeOutOfMemory, TokenBudget, blamed_on, drop_too_long


def _batch(*lengths_and_episodes):
    return SimpleNamespace(sequences=[TrainSequence(episode=e, input_ids=[0] * n, spans=[(0, 1)], turns=[0])
                                      for n, e in lengths_and_episodes])


def test_out_of_memory_in_a_micro_batch_names_the_episode_of_its_longest_sequence():
    with pytest.raises(EpisodeOutOfMemory) as raised:
        with blamed_on(_batch((300, 0), (900, 2), (500, 1))):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert (raised.value.episode, raised.value.tokens) == (2, 900)
    assert isinstance(raised.value, torch.cuda.OutOfMemoryError)  # every existing handler still catches it
    with pytest.raises(ValueError):  # anything else passes through untouched
        with blamed_on(_batch((10, 0))):
            raise ValueError("not memory")


def test_episodes_over_the_sequence_limit_are_dropped_with_their_group_ids_and_counted():
    episodes = [SimpleNamespace(task=SimpleNamespace(task_id=i)) for i in range(4)]
    kept, groups, metrics = drop_too_long(episodes, [0, 0, 1, 1], [900, 2000, 4096, 4097], limit=4096)
    assert [e.task.task_id for e in kept] == [0, 1, 2] and groups == [0, 0, 1]
    assert metrics == {"train/episodes_too_long": 1.0, "train/longest_dropped_tokens": 4097.0}
    kept, groups, metrics = drop_too_long(episodes, None, [900, 2000, 4096, 4097], limit=None)
    assert len(kept) == 4 and groups is None and metrics["train/episodes_too_long"] == 0.0


def test_the_first_error_of_a_step_drops_a_later_one_halves_where_that_splits_the_micro_batch():
    budget = TokenBudget(configured=8192, regrow_after=3, tokens=8192)
    assert budget.after_out_of_memory(longest=3000, errors_this_step=1) == "drop" and budget.tokens == 8192
    assert budget.after_out_of_memory(longest=3000, errors_this_step=2) == "halve" and budget.tokens == 4096
    assert budget.after_out_of_memory(longest=3000, errors_this_step=3) == "halve" and budget.tokens == 2048
    # a micro-batch of one 3000-token sequence: halving cannot split it, so its episode goes
    assert budget.after_out_of_memory(longest=3000, errors_this_step=4) == "drop" and budget.tokens == 2048


def test_a_halved_budget_doubles_back_after_the_given_clean_steps_up_to_the_configured_one():
    budget = TokenBudget(configured=8192, regrow_after=3, tokens=2048)
    grew = [budget.step_finished(ran_out=False) for _ in range(3)]
    assert grew == [False, False, True] and budget.tokens == 4096
    assert not budget.step_finished(ran_out=False) and not budget.step_finished(ran_out=True)  # the count restarts
    assert [budget.step_finished(ran_out=False) for _ in range(3)] == [False, False, True] and budget.tokens == 8192
    assert not any(budget.step_finished(ran_out=False) for _ in range(6)) and budget.tokens == 8192  # no further
