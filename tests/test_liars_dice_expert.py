"""experts.py's liars_dice arithmetic against brute force over explicit dice, and the counting teacher's rule."""
import itertools

import pytest

from bench.teacher_score import highest_true_bid_guess_rate
from ppo_affine.experts import (LIAR, OFF_MODEL_WEIGHT, action_bid, bid_action, counting_bid, highest_true_bid,
                                opponent_hand_posterior, true_bid_choice)


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
    # five 1s stand only if all five of the opponent's dice are 1s or 6s (1/243); an opponent that sees
    # every die opens true, so the other 242/243 keep only the off-model weight
    off = 242 * OFF_MODEL_WEIGHT
    assert true_bid_choice([2, 2, 2, 2, 2], [(5, 1)], list(range(24, 60)) + [LIAR]) == (
        LIAR, pytest.approx(off / (1 + off)))
    assert true_bid_choice([2, 2, 2, 2, 2], [(10, 1)], [LIAR]) == (LIAR, pytest.approx(1.0))


def test_the_opening_is_taken_as_true_so_a_likely_false_one_is_raised_not_challenged():
    # three 1s hold when at least three of the opponent's five dice are 1s or 6s: P(Bin(5, 1/3) >= 3) =
    # (10 * 4 + 5 * 2 + 1) / 243 = 51/243. Taken at face value it fails 192/243 of the time, but an
    # opponent that sees every die opens only with a true bid (the validators' MCTS: 400 of 400).
    totals, _, weights = opponent_hand_posterior([2, 2, 2, 2, 2], [(3, 1)])
    p_fails = float(weights @ (totals[:, 0] < 3))
    off = 192 * OFF_MODEL_WEIGHT
    assert p_fails == pytest.approx(off / (51 + off))
    action, p_win = true_bid_choice([2, 2, 2, 2, 2], [(3, 1)], list(range(13, 60)) + [LIAR])
    assert action != LIAR and p_win > p_fails


def _posterior_by_brute_force(mine: tuple[int, ...], bids: list[tuple[int, int]]) -> dict[tuple[int, ...], float]:
    """Every ordered opponent hand, weighted 1 when each of its bids is true exactly when a true raise
    was left over the bid it answered (always for the opening), else OFF_MODEL_WEIGHT."""
    weights = {}
    for theirs in itertools.product(range(1, 7), repeat=len(mine)):
        highest = _highest_true_bid(mine + theirs)
        weight = 1.0
        for i in range(len(bids) - 1, -1, -2):
            quantity, face = bids[i]
            holds = _matching(mine + theirs, face) >= quantity
            raise_left = i == 0 or (bids[i - 1][0] - 1) * 6 + bids[i - 1][1] - 1 < highest
            weight *= 1.0 if holds == raise_left else OFF_MODEL_WEIGHT
        weights[theirs] = weight
    total = sum(weights.values())
    return {hand: weight / total for hand, weight in weights.items()}


@pytest.mark.parametrize("mine, bids", [
    ((2, 5), [(1, 3)]),                  # the opponent opened
    ((1, 6), [(2, 1), (3, 1)]),          # we opened, it raised
    ((3, 3), [(1, 2), (2, 3), (3, 3)]),  # it opened, we raised, it raised again
])
def test_the_opponent_hand_posterior_matches_brute_force(mine, bids):
    expected = _posterior_by_brute_force(mine, bids)
    totals, highest, weights = opponent_hand_posterior(list(mine), bids)
    quantity, face = bids[-1]
    p_fails = sum(w for hand, w in expected.items() if _matching(mine + hand, face) < quantity)
    assert float(weights @ (totals[:, face - 1] < quantity)) == pytest.approx(p_fails, abs=1e-12)
    for bid in set(highest.tolist()):
        p_highest = sum(w for hand, w in expected.items() if _highest_true_bid(mine + hand) == bid)
        assert float(weights[highest == bid].sum()) == pytest.approx(p_highest, abs=1e-12)


def test_counting_bid_opens_at_two_more_than_the_commonest_face_holds():
    assert counting_bid([1, 3, 3, 6, 6]) == (32, "6s: 2; 1s: 1; 3s: 2; best 3s: 2+2=4; bid 6-3: 6-1 30, 6-2 31, 6-3 32")
    assert counting_bid([1, 3, 3, 6, 6], id_steps=False) == (32, "6s: 2; 1s: 1; 3s: 2; best 3s: 2+2=4; bid 6-3")
    # a tie between 1s and 4s goes to the higher face; five sixes bid on fives, which the sixes count for
    assert counting_bid([1, 1, 2, 4, 4], id_steps=False) == (21, "6s: 0; 1s: 2; 2s: 1; 4s: 2; best 4s: 2+0=2; bid 4-4")
    assert counting_bid([6, 6, 6, 6, 6], id_steps=False) == (40, "6s: 5; best 5s: 0+5=5; bid 7-5")


def test_counting_bid_raises_its_bid_above_a_standing_one_to_the_lowest_quantity_that_ranks_above():
    steps = "6s: 2; 1s: 1; 3s: 2; best 3s: 2+2=4"
    assert counting_bid([1, 3, 3, 6, 6], (6, 2), id_steps=False) == (32, f"{steps}; bid 6-3")  # 6-3 already ranks above
    assert counting_bid([1, 3, 3, 6, 6], (6, 3), id_steps=False) == (38, f"{steps}; 6-3 not above 6-3; bid 7-3")
    assert counting_bid([1, 3, 3, 6, 6], (7, 1)) == (38, f"{steps}; 6-3 not above 7-1; bid 7-3: 7-1 36, 7-2 37, 7-3 38")
    assert counting_bid([1, 3, 3, 6, 6], (7, 4), id_steps=False) == (44, f"{steps}; 6-3 not above 7-4; bid 8-3")
    assert counting_bid([6, 6, 6, 6, 6], (10, 5)) == (LIAR,
                                                      "6s: 5; best 5s: 0+5=5; 7-5 not above 10-5; none left: Liar")


def test_counting_bid_opens_as_well_as_true_bids_for_every_hand():
    differ = []
    for hand in itertools.combinations_with_replacement(range(1, 7), 5):
        counted, _ = counting_bid(list(hand))
        best, chance = true_bid_choice(list(hand), [], list(range(LIAR)))
        assert true_bid_choice(list(hand), [], [counted])[1] == pytest.approx(chance, abs=1e-12), hand
        if counted != best:
            differ.append(hand)
    assert differ == [(4, 4, 4, 4, 4), (5, 5, 5, 5, 5), (5, 5, 5, 5, 6)]  # equal chances, another bid of the tie


def test_bid_action_and_action_bid_name_the_bids_as_open_spiel_does():
    import pyspiel

    game = pyspiel.load_game("liars_dice", {"players": 2, "numdice": 5})
    state = game.new_initial_state()
    for die in [1, 3, 3, 6, 6] + [2, 2, 2, 2, 2]:
        state.apply_action(die - 1)
    bids = [action for action in state.legal_actions() if action != LIAR]
    assert len(bids) == 60 and bids == [bid_action(*action_bid(action)) for action in bids]
    for action in bids:  # open_spiel writes bid q-f as "q-f"
        assert state.action_to_string(0, action) == "{}-{}".format(*action_bid(action))
    assert bid_action(6, 3) == 32 and action_bid(37) == (7, 2)


def test_the_count_bids_expert_bids_once_by_counting_then_calls_liar():
    import pyspiel

    from ppo_affine.experts import Expert

    game = pyspiel.load_game("liars_dice", {"players": 2, "numdice": 5})
    state = game.new_initial_state()
    for die in [1, 3, 3, 6, 6] + [2, 2, 2, 2, 2]:  # player 0's dice, then player 1's
        state.apply_action(die - 1)
    first, second = (Expert("count_bids", game, player, 0, 0, 0) for player in (0, 1))
    assert first.choose(state, {}) == counting_bid([1, 3, 3, 6, 6])
    state.apply_action(32)  # 6-3
    assert second.choose(state, {}) == counting_bid([2, 2, 2, 2, 2], (6, 3))  # 7-2
    state.apply_action(37)
    assert first.choose(state, {}) == (LIAR, "my bid is made: Liar")


@pytest.mark.parametrize("mine, theirs", [((1, 3, 3, 6, 6), (2, 2, 2, 2, 2)), ((6, 6, 6, 6, 6), (1, 1, 1, 1, 1)),
                                          ((1, 2, 3, 4, 5), (1, 2, 3, 4, 5))])
def test_the_highest_true_bid_over_two_hands_matches_brute_force(mine, theirs):
    assert highest_true_bid(list(mine), list(theirs)) == _highest_true_bid(mine + theirs)
