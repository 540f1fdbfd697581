"""bench/long_update.py at a tiny size on the CPU: the GPU row's own code (`bash bench/gpu_rows.sh long-update`)."""
import argparse
import math

import pytest

from bench import long_update


def test_a_long_episode_is_turns_of_observation_then_reply():
    import torch

    sequence = long_update.long_episode(1000, 10, vocab=64, generator=torch.Generator().manual_seed(0))
    assert len(sequence.input_ids) == 1000 and len(sequence.spans) == 10
    assert sequence.spans[0] == (75, 100) and sequence.spans[-1] == (975, 1000)  # the last quarter of each turn
    assert sequence.response_len == 250


@pytest.mark.slow
def test_one_update_of_a_long_episode_reports_its_seconds_and_peak_beside_the_plan():
    args = argparse.Namespace(model="tiny-qwen3_5_moe", device="cpu", tokens=[1024, 2048], turns=8,
                              micro_batch_tokens=512)
    rows = long_update.run(args)
    assert [row["tokens"] for row in rows] == [1024, 2048]
    for row in rows:
        for key in ("score_s", "update_s", "peak_gb", "planned_gb", "planned_over_peak"):
            assert math.isfinite(row[key]) and row[key] > 0, key
        # the plan counts every token a reply token (a quarter are here): an upper bound
        assert row["planned_over_peak"] >= 0.85, row
