"""bench/random_model_step.py at a tiny size: the full-size GPU row's own code, every field present and finite."""
import argparse
import math

import pytest

from bench import random_model_step


@pytest.mark.slow
@pytest.mark.parametrize("model,use_4bit", [("tiny-qwen3_5_moe", False), ("tiny-qwen3", True)])
def test_one_step_of_a_random_model_built_in_memory_reports_its_time_and_plan(model, use_4bit):
    args = argparse.Namespace(model=model, use_4bit=use_4bit, device="cpu", episodes=2, max_new_tokens=4,
                              micro_batch_tokens=1024)
    row = random_model_step.run(args)
    assert row["exit_code"] == 0 and row["peak_gb"] is None  # no allocator to read on a CPU
    for key in ("wall_s", "step_s", "rollout_s", "update_s", "generated_tokens_per_s", "planned_trainer_gb"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    weights = "weights (NF4)" if use_4bit else "weights"
    assert weights in row["planned_terms_gb"] and "local generation caches" in row["planned_terms_gb"]
