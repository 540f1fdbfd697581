"""The validators' MCTS opponent as data (ppo_affine/opponent_model.py) and the experts aimed at it."""
from __future__ import annotations

import pytest


# ---------------------------------------------------------------- the opponent model and its best response
@pytest.fixture(scope="module")
def leduc_model():
    """The MCTS opponent of leduc_poker at a tiny budget (20 simulations, 2 rollouts), 2 searches per state."""
    import pyspiel

    from ppo_affine import opponent_model

    game = pyspiel.load_game("leduc_poker", {"players": 2})
    return game, opponent_model.mcts_action_frequencies(game, (20, 2), samples=2)


def test_the_opponent_table_covers_every_decision_with_a_distribution(leduc_model):
    game, frequencies = leduc_model
    assert len(frequencies) == 3780  # leduc_poker's 1 890 decision histories per player
    assert all(abs(sum(f.values()) - 1) < 1e-9 and all(p in (0.5, 1.0) for p in f.values())
               for f in frequencies.values())  # two samples: shares of 1/2 or 1


def test_the_best_responses_table_played_as_a_policy_earns_the_value_it_claims(leduc_model):
    """Information-state consistency: the table's actions, played as a policy that sees only information states
    (never the true state), earn against the sampled opponent exactly the value best_response reports, in each
    seat; and every action in the table is legal where it is played."""
    from open_spiel.python import policy as openspiel_policy
    from open_spiel.python.algorithms.expected_game_score import policy_value

    from ppo_affine.opponent_model import SampledOpponent, best_response

    game, frequencies = leduc_model
    actions, values = best_response(game, frequencies)
    assert {seat: len(table) for seat, table in actions.items()} == {0: 468, 1: 468}

    class TablePolicy(openspiel_policy.Policy):
        def __init__(self, seat: int):
            super().__init__(game, [seat])
            self.table = actions[seat]

        def action_probabilities(self, state, player_id=None):
            action = self.table[state.information_state_string(state.current_player())]
            assert action in state.legal_actions()
            return {action: 1.0}

    opponent = SampledOpponent(game, frequencies)
    for seat in (0, 1):
        players = [TablePolicy(0), opponent] if seat == 0 else [opponent, TablePolicy(1)]
        assert policy_value(game.new_initial_state(), players)[seat] == pytest.approx(values[seat], abs=1e-9)


def test_the_opponent_model_is_built_once_and_read_back(tmp_path, monkeypatch):
    from ppo_affine import opponent_model

    built = opponent_model.load_or_build("leduc_poker(players=2)", (10, 1), 1, tmp_path)
    monkeypatch.setattr(opponent_model, "mcts_action_frequencies", lambda *a, **k: pytest.fail("rebuilt"))
    again = opponent_model.load_or_build("leduc_poker(players=2)", (10, 1), 1, tmp_path)
    assert again["best_response"] == built["best_response"] and set(again["values"]) == {0, 1}


def test_the_best_response_expert_plays_its_table(monkeypatch):
    import pyspiel

    from ppo_affine import experts, opponent_model

    game = pyspiel.load_game("leduc_poker", {"players": 2})
    state = game.new_initial_state()
    state.apply_action(0)
    state.apply_action(3)  # J of spades to player 0, Q to player 1
    infostate = state.information_state_string(0)
    model = {"best_response": {0: {infostate: 2}, 1: {}}, "values": {0: 0.0, 1: 0.0}}
    monkeypatch.setattr(opponent_model, "load_or_build", lambda *args, **kwargs: model)
    expert = experts.Expert("best_response", game, 0, seed=0, budget=0, cfr_iterations=0)
    assert expert.choose(state, {0: "Fold", 1: "Call", 2: "Raise"}) == (2, "Against this opponent, Raise pays best here.")
