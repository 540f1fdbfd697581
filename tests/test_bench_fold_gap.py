"""bench/fold_gap.py at CI size: in bfloat16 the folded copy loses most of a small adapter delta and the sampler's
log-prob gap grows, which is why local generation folds only float32 weights; in float32 the fold changes nothing."""
import pytest

from bench import fold_gap


@pytest.fixture(scope="module")
def bf16_run():
    return fold_gap.main(["--tiny", "--dtype", "bfloat16", "--episodes", "2", "--scales", "1e-4"])


def test_in_bfloat16_a_small_delta_is_mostly_lost_and_the_folded_sampler_drifts_from_the_trainer(bf16_run):
    row = bf16_run["by_b_std"]["0.0001"]
    assert row["tokens_fold"] > 0 and row["tokens_no_fold"] > 0
    assert row["delta_lost"] > 0.5  # measured 0.95: bfloat16 keeps about 5 % of a delta with |B| ~ 1e-4 here
    assert row["fold_over_no_fold"] > 1.1  # measured 35: the fold fails the rule that would keep it on


def test_in_float32_the_fold_keeps_the_delta_and_samples_what_the_trainer_scores():
    row = fold_gap.main(["--tiny", "--dtype", "float32", "--episodes", "2", "--scales", "1e-4"])["by_b_std"]["0.0001"]
    assert row["delta_lost"] < 1e-3
    assert row["gap_fold"] < 1e-4 and row["gap_no_fold"] < 1e-4
