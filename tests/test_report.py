"""report.py: rates, intervals and summaries on hand-written episode records (numbers worked out by hand)."""
import math

import pytest
from rich.console import Console

from ppo_affine import report


def game_record(outcome, score, turns=4, illegal=0, parse_failed=False, tokens=10, error=None, model="adapter",
                game="leduc_poker", task_id=0, seed=0):
    return {"model": model, "game": game, "task_id": task_id, "seed": seed, "opponent": "random",
            "llm_player_id": seed % 2, "score": score, "success": score > 0.5, "outcome": outcome, "turns": turns,
            "illegal_moves": illegal, "parse_failed_game": parse_failed, "generated_tokens": tokens, "error": error}


def ten_leduc_episodes():
    """4 wins, 3 draws, 3 losses (two lost to failed parses), plus one errored episode."""
    records = [game_record("win", 1.0, turns=3, tokens=12, task_id=i) for i in range(4)]
    records += [game_record("draw", 0.5, turns=4, illegal=1, tokens=8, task_id=4 + i) for i in range(3)]
    records += [game_record("loss", 0.0, turns=5, illegal=3, parse_failed=True, tokens=5, task_id=7),
                game_record("loss", 0.0, turns=5, illegal=3, parse_failed=True, tokens=5, task_id=8),
                game_record("loss", 0.0, turns=4, illegal=0, tokens=10, task_id=9)]
    records.append(game_record("error", 0.0, turns=30, illegal=9, tokens=99, task_id=10,
                               error="cut off after 30 model turns (generation.max_turns)"))
    return records


def test_wilson_interval_of_3_in_10():
    low, high = report.wilson_interval(3, 10)
    assert low == pytest.approx(0.107791, abs=1e-6)
    assert high == pytest.approx(0.603222, abs=1e-6)


def test_wilson_interval_of_0_in_4_starts_at_0_and_is_not_empty():
    low, high = report.wilson_interval(0, 4)
    assert low == 0.0
    assert high == pytest.approx(0.489891, abs=1e-6)


def test_wilson_interval_of_all_successes_ends_at_1():
    low, high = report.wilson_interval(4, 4)
    assert low == pytest.approx(0.510109, abs=1e-6)
    assert high == pytest.approx(1.0)


@pytest.mark.parametrize("df,expected,tolerance", [
    (1, 12.7062, 1e-4), (2, 4.3027, 1e-4), (3, 3.1824, 0.012), (4, 2.7764, 2e-3), (9, 2.2622, 2e-4),
    (30, 2.0423, 1e-4), (120, 1.9799, 1e-4),
])
def test_t_quantile_matches_the_table(df, expected, tolerance):
    assert report.t_quantile_975(df) == pytest.approx(expected, abs=tolerance)


def test_mean_interval_is_a_t_interval():
    # mean 0.55; squared deviations 4*0.2025 + 3*0.0025 + 3*0.3025 = 1.725; s = sqrt(1.725/9) = 0.437798
    # half width = t(9) 2.262157 * 0.437798 / sqrt(10) = 0.313182
    mean, (low, high) = report.mean_interval([1, 1, 1, 1, 0.5, 0.5, 0.5, 0, 0, 0], 0.0, 1.0)
    assert mean == pytest.approx(0.55)
    assert low == pytest.approx(0.236818, abs=1e-5)
    assert high == pytest.approx(0.863182, abs=1e-5)


def test_mean_interval_is_clipped_to_the_score_range():
    # mean 0.5, s = 0.5, half width = t(2) 4.302653 * 0.5 / sqrt(3) = 1.242070 -> [-0.742, 1.742] -> [0, 1]
    mean, interval = report.mean_interval([1.0, 0.5, 0.0], 0.0, 1.0)
    assert mean == 0.5 and interval == [0.0, 1.0]


def test_mean_interval_of_one_value_has_no_interval():
    assert report.mean_interval([0.25]) == (0.25, None)
    assert report.mean_interval([]) == (None, None)


def test_game_summary_rates_leave_errored_episodes_out():
    summary = report.game_summary(ten_leduc_episodes())
    assert summary["episodes"] == 11
    assert summary["errors"] == 1
    assert summary["win_rate"] == pytest.approx(0.4)
    assert summary["win_rate_ci95"] == pytest.approx([0.168180, 0.687326], abs=1e-5)
    assert summary["draw_rate"] == pytest.approx(0.3)
    assert summary["loss_rate"] == pytest.approx(0.3)
    assert summary["mean_score"] == pytest.approx(0.55)
    assert summary["score_ci95"] == pytest.approx([0.236818, 0.863182], abs=1e-5)
    # illegal: (3*1 + 3 + 3) unusable replies / (4*3 + 3*4 + 5 + 5 + 4) replies = 9 / 38
    assert summary["illegal_rate"] == pytest.approx(9 / 38)
    # Wilson 9/38: centre (0.236842 + 1.96^2/76) / (1 + 1.96^2/38) = 0.260998, half width 0.131061
    assert summary["illegal_rate_ci95"] == pytest.approx([0.129937, 0.392068], abs=1e-5)
    # parse errors: 2 of the 10 scored episodes were lost to three failed parses
    assert summary["parse_error_rate"] == pytest.approx(0.2)
    assert summary["mean_turns"] == pytest.approx(3.8)
    # tokens: (4*12 + 3*8 + 5 + 5 + 10) / 10 = 9.2
    assert summary["mean_generated_tokens"] == pytest.approx(9.2)


def test_game_summary_with_only_errors_has_no_rates():
    summary = report.game_summary([game_record("error", 0.0, error="env failed")])
    assert summary["episodes"] == 1 and summary["errors"] == 1
    assert summary["win_rate"] is None and summary["win_rate_ci95"] is None
    assert summary["mean_score"] is None and summary["score_ci95"] is None
    assert summary["illegal_rate"] is None and summary["parse_error_rate"] is None


def test_trace_summary_gives_accuracy_with_a_wilson_interval():
    records = [game_record("correct" if i < 3 else "incorrect", 1.0 if i < 3 else 0.0, turns=1, tokens=40,
                           game="trace", task_id=i) for i in range(10)]
    summary = report.trace_summary(records)
    assert summary["accuracy"] == pytest.approx(0.3)
    assert summary["accuracy_ci95"] == pytest.approx([0.107791, 0.603222], abs=1e-5)
    assert summary["mean_score"] == pytest.approx(0.3)
    assert summary["mean_generated_tokens"] == 40


def test_summarize_groups_by_model_and_game_and_pools_games_but_not_trace():
    records = ten_leduc_episodes()
    records += [game_record("win", 1.0, game="liars_dice", task_id=i) for i in range(2)]
    records += [game_record("correct", 1.0, game="trace", task_id=0)]
    records += [game_record("loss", 0.0, model="base", task_id=0)]
    summary = report.summarize(records)
    assert list(summary) == ["adapter", "base"]
    assert list(summary["adapter"]) == ["leduc_poker", "liars_dice", "trace", "all_games"]
    # all games: 11 + 2 episodes, 6 wins of 12 scored
    assert summary["adapter"]["all_games"]["episodes"] == 13
    assert summary["adapter"]["all_games"]["win_rate"] == pytest.approx(0.5)
    assert summary["adapter"]["trace"]["accuracy"] == 1.0
    assert list(summary["base"]) == ["leduc_poker"]  # one game: nothing to pool


def scored(model, score, task_id, seed):
    outcome = "win" if score > 0.5 else "draw" if score == 0.5 else "loss"
    return game_record(outcome, score, model=model, task_id=task_id, seed=seed)


def test_paired_differences_match_task_and_seed_and_skip_errors():
    records = [
        scored("adapter", 1.0, 1, 7), scored("base", 0.0, 1, 7),
        scored("adapter", 1.0, 2, 8), scored("base", 0.5, 2, 8),
        scored("adapter", 0.5, 3, 9), scored("base", 0.5, 3, 9),
        scored("adapter", 1.0, 3, 10), scored("base", 0.0, 3, 11),  # same task, other seed: not a pair
        scored("adapter", 1.0, 4, 12),  # its base episode failed: not a pair
        game_record("error", 0.0, model="base", task_id=4, seed=12, error="env failed"),
    ]
    pairs = report.paired_differences(records)["leduc_poker"]
    # differences 1, 0.5, 0: mean 0.5, s = 0.5, half width 4.302653 * 0.5 / sqrt(3) = 1.242070
    assert pairs["pairs"] == 3
    assert pairs["score_diff"] == pytest.approx(0.5)
    assert pairs["score_diff_ci95"] == pytest.approx([-0.742070, 1.0], abs=1e-5)
    # two pairs changed; t(n-1) * 0.5 / sqrt(n) first falls below 0.5 at n = 7 (2.4469 * 0.5 / 2.6458 = 0.462;
    # n = 6 gives 2.5706 * 0.5 / 2.4495 = 0.525)
    assert pairs["changed"] == 2 and pairs["pairs_to_decide"] == 7


def test_pairs_to_decide_is_the_evaluation_size_whose_interval_leaves_zero_out():
    # one win gained in 8 pairs: mean 0.125, s = sqrt(0.125) = 0.35355; t(32) * s / sqrt(33) = 2.0369 * 0.06155
    # = 0.12536 still holds 0, t(33) * s / sqrt(34) = 2.0345 * 0.06063 = 0.12336 does not
    assert report.pairs_to_decide([1, 0, 0, 0, 0, 0, 0, 0]) == 34
    assert report.pairs_to_decide([0.25, 0.25, 0.25]) == 2  # no spread: two pairs decide
    assert report.pairs_to_decide([1, -1]) is None  # a mean of 0: no size decides
    assert report.pairs_to_decide([1]) is None  # one pair has no spread to size from


def render(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_game_table_shows_rates_with_their_intervals():
    records = ten_leduc_episodes() + [game_record("loss", 0.0, model="base", task_id=i) for i in range(10)]
    summary = report.summarize(records)
    comparison = report.paired_differences(records)
    text = render(report.game_table(summary, comparison))
    adapter_row = next(line for line in text.splitlines() if "leduc_poker" in line and "adapter" in line)
    assert "40% (17-69)" in adapter_row  # win rate and its Wilson interval, in percent
    assert "0.550 (0.24-0.86)" in adapter_row  # mean score and its t interval
    assert "24%" in adapter_row  # illegal 9/38
    assert "+0.550" in adapter_row and "n=10" in adapter_row  # paired difference to base
    assert report.trace_table(summary) is None  # no trace episodes, no trace table


def test_an_undecided_difference_says_how_many_pairs_would_decide_it():
    records = [scored("adapter", float(i == 0), 1, i) for i in range(4)] + [scored("base", 0.0, 1, i) for i in range(4)]
    text = render(report.game_table(report.summarize(records), report.paired_differences(records)))
    adapter_row = next(line for line in text.splitlines() if "adapter" in line)
    # differences 1, 0, 0, 0 (test_bench_learning); the df-3 quantile is 0.4 % short of 3.1824: -0.54, not -0.55
    assert "+0.250 (-0.54 to +1.00) n=4, needs 18" in adapter_row


def test_trace_table_shows_accuracy():
    records = [game_record("correct" if i < 3 else "incorrect", float(i < 3), game="trace", task_id=i)
               for i in range(10)]
    text = render(report.trace_table(report.summarize(records)))
    assert "30% (11-60)" in text
    assert report.game_table(report.summarize(records)) is None


def test_rates_are_plain_floats_for_json():
    summary = report.game_summary(ten_leduc_episodes())
    assert all(value is None or isinstance(value, (int, float, list)) for value in summary.values())
    assert not any(isinstance(v, float) and math.isnan(v) for v in summary.values())
