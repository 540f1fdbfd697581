"""experts.py's liars_dice arithmetic against brute force over explicit dice."""
import itertools

import pytest

from ppo_affine.experts import LIAR, highest_true_bid_guess_rate, true_bid_choice


def _matching(dice: tuple[int, ...], face: int) -> int:
    return sum(1 for d in dice if d == face or (d == 6 and face < 6))  # sixes are wild below six


def _highest_true_bid(dice: tuple[int, ...]) -> int:
    return max((quantity - 1) * 6 + face - 1 for face in range(1, 7)
               for quantity in range(1, len(dice) + 1) if _matching(dice, face) >= quantity)


@pytest.mark.parametrize("dice", [1, 2])
def test_the_best_guess_of_the_highest_true_bid_matches_brute_force(dice):
    hands = list(itertools.product(range(1, 7), repeat=dice))
    expected = 0.0
    for mine in hands:
        guesses: dict[int, int] = {}
        for theirs in hands:
            bid = _highest_true_bid(mine + theirs)
            guesses[bid] = guesses.get(bid, 0) + 1
        expected += max(guesses.values()) / len(hands) / len(hands)
    assert highest_true_bid_guess_rate(dice) == pytest.approx(expected, abs=1e-12)


def test_one_die_each_by_hand():
    # holding a six (wild): the highest true bid is two of the opponent's face (2x6 on a six), six equal
    # chances: 1/6. Holding f < 6: two fs when the opponent shows f or a six (1/3); else one of the
    # higher face, one f when the opponent's is lower ((f - 1)/6). Best guess max(1/3, (f - 1)/6):
    # 1/3, 1/3, 1/3, 1/2, 2/3 for f = 1..5.
    assert highest_true_bid_guess_rate(1) == pytest.approx((1 / 6 + 3 / 3 + 1 / 2 + 2 / 3) / 6)


def test_true_bids_opens_with_the_likeliest_highest_bid_and_challenges_what_cannot_hold():
    # five 2s each way up: the highest true bid is (5 + k) x 2 with k of the opponent's dice 2s or 6s,
    # k ~ Binomial(5, 1/3): k = 1 and k = 2 both 80/243 (six 2s: action 31, seven 2s: action 37)
    action, p_win = true_bid_choice([2, 2, 2, 2, 2], [], list(range(60)))
    assert action in (31, 37) and p_win == pytest.approx(80 / 243)
    # five 1s stand only if all five of the opponent's dice are 1s or 6s
    assert true_bid_choice([2, 2, 2, 2, 2], [(5, 1)], list(range(24, 60)) + [LIAR]) == (
        LIAR, pytest.approx(1 - 1 / 243))
    assert true_bid_choice([2, 2, 2, 2, 2], [(10, 1)], [LIAR]) == (LIAR, pytest.approx(1.0))
