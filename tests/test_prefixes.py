"""prefixes.py: which sequences run together so that each common prefix is computed once."""
from ppo_affine.prefixes import CALL_OVERHEAD, common_prefix, padded_cost, partition


def test_common_prefix_counts_leading_equal_tokens():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_padded_cost_counts_a_long_enough_shared_prefix_once():
    assert padded_cost(4, 100, 150) == 100 + 4 * 50
    assert padded_cost(4, 10, 150) == 4 * 150  # too short to be worth its own forward call
    assert padded_cost(1, 150, 150) == 150


def test_two_groups_of_one_game_stay_apart_rather_than_share_only_the_rules():
    rules = [1] * 300
    group_a, group_b = rules + [2] * 150, rules + [3] * 150
    sequences = [group_a + [7, 7], group_b + [8], group_a + [9], group_b + [6, 6], group_a + [5], group_b + [4]]
    # apart: 2 x (450 + 3 x 2) + 2 calls = 912 + 256; together: 300 + 6 x 152 = 1212 + 128
    groups = partition(sequences, padded_cost)
    assert sorted((sorted(rows), shared) for rows, shared in groups) == [([0, 2, 4], 450), ([1, 3, 5], 450)]


def test_unrelated_rows_of_similar_length_batch_together_and_a_budget_splits_them():
    sequences = [[1] * 100, [2] * 95, [3] * 98]
    # one call: 3 x 100 = 300 + 128; three calls: 293 + 3 x 128
    assert partition(sequences, padded_cost) == [([0, 1, 2], 0)]
    at_most_200 = lambda rows, shared, longest: padded_cost(rows, shared, longest) if rows * longest <= 200 else None  # noqa: E731
    # in token order 0, 1, 2: [0] [1, 2] costs 100 + 2 x 98 = 296, [0, 1] [2] costs 200 + 98 = 298
    groups = partition(sequences, at_most_200)
    assert [rows for rows, _ in groups] == [[0], [1, 2]]
    assert sum(padded_cost(len(r), s, max(len(sequences[i]) for i in r)) + CALL_OVERHEAD for r, s in groups) == 296 + 256
