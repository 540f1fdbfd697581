"""The validators' Pareto rule on hand-made score tables.

Every expected bucket and winner below is what affine-cortex's own `WindowComparator.compare` (commit c2d7ec8,
2026-07-24; tables cut to the shared task ids as `scheduler/flow.py` does, min_dominant_envs 1) returned on the same
tables, run in a side environment; the "unknown" cases are ours (a local run that skipped a scored env).
"""
import pytest

from ppo_affine.config import ValidatorRuleConfig
from ppo_affine.validator_rule import (DOMINANT, NOT_WORSE, UNKNOWN, VERDICT_UNKNOWN, WORSE, WOULD_DETHRONE,
                                       WOULD_NOT, buckets_across, judge)

# our own envs only: the validators' scored envs would otherwise be 'unknown' in every case
OURS = ValidatorRuleConfig(sampling_counts={"DISTILL-V2": 100})


def same(score, n):
    return {task: score for task in range(n)}


def buckets(verdict):
    return {j.env: j.bucket for j in verdict.envs}


def test_dominant_needs_more_than_the_margin():
    at_margin = judge({"game": {0: 0.53}}, {"game": {0: 0.5}}, OURS, ["game"])
    above = judge({"game": {0: 0.5301}}, {"game": {0: 0.5}}, OURS, ["game"])
    assert buckets(at_margin) == {"game": NOT_WORSE}
    assert at_margin.outcome == WOULD_NOT
    assert at_margin.reasons == ["dominant in 0 env(s), 1 needed"]
    assert buckets(above) == {"game": DOMINANT}
    assert above.outcome == WOULD_DETHRONE


def test_not_worse_reaches_down_to_98_percent_of_the_champion():
    at_edge = judge({"game": {0: 0.49}, "trace": {0: 1.0}}, {"game": {0: 0.5}, "trace": {0: 0.5}}, OURS)
    below = judge({"game": {0: 0.4899}, "trace": {0: 1.0}}, {"game": {0: 0.5}, "trace": {0: 0.5}}, OURS,
                  ["game", "trace"])
    assert buckets(at_edge) == {"game": NOT_WORSE, "trace": DOMINANT, "DISTILL-V2": UNKNOWN}
    assert buckets(below) == {"game": WORSE, "trace": DOMINANT}
    assert below.outcome == WOULD_NOT
    assert below.reasons == ["game is worse (0.4899 < 0.4900)"]


def test_a_gain_on_one_env_and_a_3_percent_loss_on_another_does_not_win():
    verdict = judge({"game": {0: 0.8}, "trace": {0: 0.485}}, {"game": {0: 0.5}, "trace": {0: 0.5}}, OURS,
                    ["game", "trace"])
    assert buckets(verdict) == {"game": DOMINANT, "trace": WORSE}
    assert verdict.text == "would not, because trace is worse (0.4850 < 0.4900)"


def test_distill_v2_band_is_additive_because_its_score_crosses_zero():
    # champion -0.05: multiplicatively -0.049 would be the floor; additively it is -0.15
    at_band = judge({"DISTILL-V2": same(-0.15, 100), "game": {0: 1.0}},
                    {"DISTILL-V2": same(-0.05, 100), "game": {0: 0.5}}, OURS)
    below = judge({"DISTILL-V2": same(-0.1501, 100), "game": {0: 1.0}},
                  {"DISTILL-V2": same(-0.05, 100), "game": {0: 0.5}}, OURS)
    assert buckets(at_band) == {"DISTILL-V2": NOT_WORSE, "game": DOMINANT}
    assert at_band.outcome == WOULD_DETHRONE
    assert buckets(below) == {"DISTILL-V2": WORSE, "game": DOMINANT}
    assert below.envs[0].not_worse_from == pytest.approx(-0.15)


def test_distill_v2_dominant_margin_is_0_1():
    at_margin = judge({"DISTILL-V2": same(0.05, 100)}, {"DISTILL-V2": same(-0.05, 100)}, OURS)
    above = judge({"DISTILL-V2": same(0.0501, 100)}, {"DISTILL-V2": same(-0.05, 100)}, OURS)
    assert buckets(at_margin) == {"DISTILL-V2": NOT_WORSE}
    assert buckets(above) == {"DISTILL-V2": DOMINANT}
    assert above.outcome == WOULD_DETHRONE


def test_fewer_samples_than_the_sampling_count_is_worse_whatever_the_scores():
    short = judge({"DISTILL-V2": same(0.5, 99)}, {"DISTILL-V2": same(0.0, 100)}, OURS)
    enough = judge({"DISTILL-V2": same(0.5, 100)}, {"DISTILL-V2": same(0.0, 100)}, OURS)
    assert buckets(short) == {"DISTILL-V2": WORSE}
    assert short.envs[0].reason == "too few samples: 99 < 100"
    assert (short.envs[0].shared_tasks, short.envs[0].required_tasks) == (99, 100)
    assert buckets(enough) == {"DISTILL-V2": DOMINANT}


def test_a_tie_everywhere_is_not_worse_and_does_not_dethrone():
    verdict = judge({"game": {0: 1.0, 1: 0.0}, "trace": {0: 0.5}}, {"game": {0: 0.0, 1: 1.0}, "trace": {0: 0.5}},
                    OURS, ["game", "trace"])
    assert buckets(verdict) == {"game": NOT_WORSE, "trace": NOT_WORSE}
    assert verdict.outcome == WOULD_NOT


@pytest.mark.parametrize("candidate, champion", [
    ({"game": {0: 1.0}, "trace": {0: 1.0}}, {"trace": {0: 0.0}}),  # only the candidate played game
    ({"trace": {0: 1.0}}, {"game": {0: 0.0}, "trace": {0: 0.0}}),  # only the champion played game
])
def test_an_env_only_one_side_has_is_worse(candidate, champion):
    verdict = judge(candidate, champion, OURS, ["game", "trace"])
    assert buckets(verdict) == {"game": WORSE, "trace": DOMINANT}
    assert verdict.outcome == WOULD_NOT
    assert verdict.envs[0].shared_tasks == 0


def test_means_are_over_the_task_ids_both_models_played():
    verdict = judge({"game": {0: 1.0, 1: 1.0, 2: 0.0}}, {"game": {0: 0.5, 1: 0.5}}, OURS, ["game"])
    assert (verdict.envs[0].candidate_mean, verdict.envs[0].champion_mean, verdict.envs[0].shared_tasks) == (
        1.0, 0.5, 2)
    assert verdict.outcome == WOULD_DETHRONE


def test_a_scored_env_the_run_skipped_makes_the_verdict_unknown_never_dethrone():
    verdict = judge({"game": {0: 1.0}}, {"game": {0: 0.0}}, ValidatorRuleConfig(), ["game", "SWE-INFINITE"])
    assert buckets(verdict) == {"game": DOMINANT, "SWE-INFINITE": UNKNOWN}
    assert verdict.outcome == VERDICT_UNKNOWN
    assert verdict.reasons == ["SWE-INFINITE was not run here and the validators score it"]


def test_a_worse_env_says_would_not_even_with_unknown_envs():
    verdict = judge({"game": {0: 0.0}}, {"game": {0: 1.0}}, ValidatorRuleConfig())
    assert [j.bucket for j in verdict.envs] == [WORSE, UNKNOWN, UNKNOWN, UNKNOWN]
    assert verdict.outcome == WOULD_NOT


def test_strict_pareto_needs_every_env_dominant():
    strict = OURS.model_copy(update={"min_dominant_envs": 0})
    verdict = judge({"game": {0: 1.0}, "trace": {0: 0.5}}, {"game": {0: 0.0}, "trace": {0: 0.5}}, strict,
                    ["game", "trace"])
    assert verdict.outcome == WOULD_NOT
    assert verdict.reasons == ["trace is not dominant (0.4900 <= 0.5000 <= 0.5300)"]


def test_the_interval_says_which_buckets_the_run_cannot_tell_apart():
    judged = judge({"game": {0: 0.54}}, {"game": {0: 0.5}}, OURS, ["game"]).envs[0]
    assert judged.bucket == DOMINANT
    # candidate - champion in [-0.02, 0.10]: candidate mean in [0.48, 0.60], from worse (< 0.49) to dominant
    assert buckets_across(judged, [-0.02, 0.10], OURS) == [WORSE, NOT_WORSE, DOMINANT]
    # in [0.035, 0.05]: dominant whichever end is true
    assert buckets_across(judged, [0.035, 0.05], OURS) == [DOMINANT]
    assert buckets_across(judged, None, OURS) == [DOMINANT]
