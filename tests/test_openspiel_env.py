"""The embedded Affine OpenSpiel env against docs/protocols.md, 'The game env (Affine OpenSpiel)'.

Expected values are written out from that page; where a value depends on a random stream the
test replays that stream with numpy and pyspiel directly, as the page says the real env does.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import pyspiel
import pytest
from open_spiel.python.algorithms import mcts
from open_spiel.python.bots.uniform_random import UniformRandomBot

from ppo_affine.envs.games import GAMES, describe_blackjack, describe_leduc
from ppo_affine.envs.openspiel_env import OpenSpielEnv, decode_task_id, is_playable
from ppo_affine.envs.openspiel_episode import AffineRolloutEvaluator, build_bots, compute_score, load_game
from ppo_affine.envs.openspiel_text import parse_evaluate_action, parse_openenv_action, strip_think
from ppo_affine.envs.tasks import AVAILABLE_GAMES, game_task_id, players_of

FORMATS = ("evaluate", "openenv")
INFO_KEYS = {
    "task_id", "seed", "game_name", "llm_player_id", "opponent_type", "system_prompt", "turn_prompt",
    "parse_error", "legal_actions", "illegal_moves", "turns", "step_count",
}


def run(coro):
    return asyncio.run(coro)


async def play_episode(env: OpenSpielEnv, task_id: int, seed: int, opponent: str, policy_seed: int = 0,
                       max_turns: int | None = None) -> list[dict]:
    """Reset, then answer every decision with a seeded random legal action; returns all results."""
    policy = random.Random(policy_seed)
    results = [await env.reset(task_id, seed=seed, opponent=opponent)]
    while not results[-1]["done"]:
        if max_turns is not None and results[-1]["info"]["turns"] >= max_turns:
            await env.stop(results[-1]["episode_id"])
            break
        action = policy.choice(results[-1]["info"]["legal_actions"])
        results.append(await env.step(str(action), results[-1]["episode_id"]))
    return results


# ---------------------------------------------------------------- task ids (protocols.md, 'Task ids and games')
DECODE_TABLE = [
    (0, "goofspiel", 0, 0, {"players": 2, "num_cards": 8, "points_order": "random"}),
    (1, "goofspiel", 0, 1, {"players": 2, "num_cards": 10, "points_order": "random"}),
    (4, "goofspiel", 0, 4, {"players": 2, "num_cards": 16, "points_order": "random"}),
    (5, "goofspiel", 0, 5, {"players": 2, "num_cards": 8, "points_order": "random"}),
    (100000007, "liars_dice", 1, 7, {"players": 2, "numdice": 5}),
    (200000000, "leduc_poker", 2, 0, {"players": 2}),
    (300000004, "gin_rummy", 3, 4, {"hand_size": 8, "knock_card": 9}),
    (300000008, "gin_rummy", 3, 8, {"hand_size": 9, "knock_card": 8}),
    (400000000, "othello", 4, 0, {}),
    (500000000, "backgammon", 5, 0, {}),
    (600000003, "hex", 6, 3, {"board_size": 11}),
    (700000002, "clobber", 7, 2, {"rows": 7, "columns": 7}),
    (800000005, "hearts", 8, 5, {"pass_cards": True, "jd_bonus": False, "avoid_all_tricks_bonus": True}),
    (800000010, "hearts", 8, 10, {"pass_cards": False, "jd_bonus": True, "avoid_all_tricks_bonus": False}),
    (900000003, "euchre", 9, 3, {"allow_lone_defender": True, "stick_the_dealer": True}),
    (1000000001, "dots_and_boxes", 10, 1, {"num_rows": 4, "num_cols": 4}),
    (1100000001, "go", 11, 1, {"board_size": 7, "komi": 7.5}),
    (1200000000, "chess", 12, 0, {}),
    (1300000000, "checkers", 13, 0, {}),
    (1400000001, "quoridor", 14, 1, {"board_size": 7, "wall_count": 10}),
    (1400000003, "quoridor", 14, 3, {"board_size": 9, "wall_count": 10}),
    (1500000000, "blackjack", 15, 0, {}),
    (1600000000, "phantom_ttt", 16, 0, {"obstype": "reveal-nothing"}),
    (1600000001, "phantom_ttt", 16, 1, {"obstype": "reveal-numturns"}),
    (1700000000, "2048", 17, 0, {}),
    (1800000000, "solitaire", 18, 0, {}),
    (1900000000, "bridge", 19, 0, {}),
    (1900000001, "bridge", 19, 1, {"is_chicago": True}),
    (1900000002, "bridge", 19, 2, {"is_duplicate": True}),
    (2000000002, "amazons", 20, 2, {"board_size": 10}),
    (2100000000, "oware", 21, 0, {"seeds_per_house": 4}),
    (2100000001, "oware", 21, 1, {"seeds_per_house": 3}),
    (2200000000, "goofspiel", 22, 0, {"players": 2, "num_cards": 8, "points_order": "random"}),
    (999999999999, "go", 9999, 99999999, {"board_size": 7, "komi": 7.5}),
]


@pytest.mark.parametrize("task_id, game, game_idx, config_id, params", DECODE_TABLE)
def test_decode_task_id_matches_the_affine_table(task_id, game, game_idx, config_id, params):
    decoded = decode_task_id(task_id)
    assert decoded == {"game_name": game, "game_idx": game_idx, "config_id": config_id, "game_params": params}
    # load_game sees the value types too: real bools, the float komi, strings.
    assert [type(v) for v in decoded["game_params"].values()] == [type(v) for v in params.values()]


def test_decode_covers_the_22_games_in_order():
    assert [decode_task_id(i * 100_000_000)["game_name"] for i in range(22)] == AVAILABLE_GAMES


def test_only_bridge_variants_1_and_2_are_unplayable():
    unplayable = [t for g in AVAILABLE_GAMES for c in range(12) if not is_playable(t := game_task_id(g, c))]
    assert unplayable == [1900000001, 1900000002, 1900000004, 1900000005, 1900000007, 1900000008,
                          1900000010, 1900000011]


def test_players_of_matches_every_playable_variant():
    # curriculum seats (TaskSource.seat) are drawn from this table, so it must say what open_spiel loads
    for game in AVAILABLE_GAMES:
        counts = {load_game(game, tuple(sorted(decode_task_id(t)["game_params"].items()))).num_players()
                  for c in range(12) if is_playable(t := game_task_id(game, c))}
        assert counts == {players_of(game)}, game


def test_oware_loads_with_the_repaired_parameter_name():
    # The real env passes `seeds_per_house`, which open_spiel rejects for every oware task.
    for config_id, seeds in [(0, 4), (1, 3), (2, 5)]:
        params = decode_task_id(game_task_id("oware", config_id))["game_params"]
        state = load_game("oware", tuple(params.items())).new_initial_state()
        assert state.observation_string(0) == "0 | 0 0 | " + " ".join([str(seeds)] * 12)


def test_reset_on_an_unplayable_task_returns_an_error_result():
    result = run(OpenSpielEnv().reset(1900000001, seed=0))
    assert result["done"] and result["truncated"] and result["episode_id"] is None
    assert result["info"]["error"]["type"] == "invalid_game"
    assert result["info"]["score"] == 0.0 and result["info"]["success"] is False


# ---------------------------------------------------------------- every game plays
# (protocols.md, 'The opponents' and 'The evaluate() call and its result')
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("game", AVAILABLE_GAMES)
def test_every_game_completes_against_random(game, fmt):
    env = OpenSpielEnv(fmt)
    results = run(play_episode(env, game_task_id(game), seed=7, opponent="random", policy_seed=3))
    final = results[-1]
    assert final["done"] and not final["truncated"]
    assert 0.0 <= final["info"]["score"] <= 1.0
    assert final["info"]["success"] == (final["info"]["score"] > 0.5)
    assert final["reward"] == final["info"]["score"]
    assert all(not r["info"]["parse_error"] and "error" not in r["info"] for r in results)
    assert all(INFO_KEYS <= set(r["info"]) for r in results)
    assert final["info"]["turns"] == len(results) - 1
    assert env._live == {}  # finished episodes are freed


CHEAP_SEARCH_GAMES = ["liars_dice", "leduc_poker", "hex", "clobber", "euchre", "dots_and_boxes", "go",
                      "phantom_ttt", "bridge", "goofspiel", "blackjack", "2048", "solitaire"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("game", CHEAP_SEARCH_GAMES)
def test_cheap_games_complete_against_a_small_mcts(game, fmt):
    env = OpenSpielEnv(fmt, mcts_simulations=4)
    final = run(play_episode(env, game_task_id(game), seed=2, opponent="mcts"))[-1]
    assert final["done"] and 0.0 <= final["info"]["score"] <= 1.0 and "error" not in final["info"]


EXPENSIVE_SEARCH_GAMES = ["othello", "backgammon", "gin_rummy", "hearts", "chess", "checkers", "quoridor",
                          "amazons", "oware"]


@pytest.mark.parametrize("game", EXPENSIVE_SEARCH_GAMES)
def test_expensive_games_run_clean_against_mcts_for_a_few_turns(game):
    # Random playouts of these games are long, so even 2 simulations cost up to ~0.1 s a move.
    env = OpenSpielEnv("evaluate", mcts_simulations=2)
    results = run(play_episode(env, game_task_id(game), seed=1, opponent="mcts", max_turns=4))
    assert all("error" not in r["info"] for r in results)
    assert results[-1]["info"]["turns"] == 4 and results[-1]["info"]["step_count"] >= 4
    assert env._live == {}


def test_leduc_plays_against_mcts_with_the_spec_budget():
    env = OpenSpielEnv("evaluate")
    bot = build_bots(load_game("leduc_poker", (("players", 2),)), GAMES["leduc_poker"], "evaluate", 0, 0,
                     "mcts", None, search="exact")[1]
    assert (bot.max_simulations, bot.evaluator.n_rollouts, bot.uct_c) == (3000, 200, 1.414)
    final = run(play_episode(env, game_task_id("leduc_poker"), seed=4, opponent="mcts"))[-1]
    assert final["done"] and final["info"]["score"] in {(r + 13) / 26 for r in range(-13, 14)}


# ---------------------------------------------------------------- opponents and seats
# (protocols.md, 'The opponents' and 'Seeds')
def _bots(game: str, fmt: str, player: int, opponent: str, sims: int | None = None, search: str = "exact"):
    """The exact search's budgets can be read off its bot; the C++ bot does not show them."""
    params = decode_task_id(game_task_id(game))["game_params"]
    return build_bots(load_game(game, tuple(params.items())), GAMES[game], fmt, player, 10, opponent, sims, search)


def test_evaluate_builds_one_bot_per_other_seat():
    bots = _bots("hearts", "evaluate", 1, "mcts")
    assert sorted(bots) == [0, 2, 3] and len({id(b) for b in bots.values()}) == 3
    assert all((b.max_simulations, b.evaluator.n_rollouts) == (500, 50) for b in bots.values())


def test_openenv_shares_one_search_bot_between_the_other_seats():
    bots = _bots("euchre", "openenv", 2, "mcts")
    assert sorted(bots) == [0, 1, 3] and len({id(b) for b in bots.values()}) == 1


def test_mcts_simulations_overrides_only_the_simulation_count():
    bot = _bots("hex", "evaluate", 0, "mcts", sims=7)[1]
    assert (bot.max_simulations, bot.evaluator.n_rollouts) == (7, 50)


def test_per_game_mcts_simulations_apply_to_the_named_games_only():
    from ppo_affine.envs.openspiel_episode import Episode

    budgets = {"liars_dice": 30}
    liars = Episode("a", task_id=game_task_id("liars_dice"), seed=0, opponent="mcts", observation_format="evaluate",
                    max_parse_attempts=3, mcts_simulations=budgets, opponent_search="exact")
    leduc = Episode("b", task_id=game_task_id("leduc_poker"), seed=0, opponent="mcts", observation_format="evaluate",
                    max_parse_attempts=3, mcts_simulations=budgets, opponent_search="exact")
    assert (liars.bots[1].max_simulations, leduc.bots[1].max_simulations) == (30, 3000)


def test_an_mcts_budget_below_one_is_refused_in_either_form():
    with pytest.raises(ValueError, match="mcts_simulations"):
        OpenSpielEnv("evaluate", mcts_simulations={"liars_dice": 0})
    with pytest.raises(ValueError, match="mcts_simulations"):
        OpenSpielEnv("evaluate", mcts_simulations=0)


@pytest.mark.parametrize("game", ["goofspiel", "blackjack", "2048", "solitaire"])
def test_games_without_a_search_budget_get_random_or_no_opponents(game):
    bots = _bots(game, "evaluate", 0, "mcts")
    assert all(isinstance(b, UniformRandomBot) for b in bots.values())
    assert len(bots) == (1 if game == "goofspiel" else 0)


@pytest.mark.parametrize("fmt, seed, expected_seat", [
    ("evaluate", 0, 0), ("evaluate", 1, 1), ("evaluate", 2, 0), ("evaluate", 3, 1),
    ("openenv", 0, 0), ("openenv", 1, 1), ("openenv", 2, 2), ("openenv", 3, 3),
])
def test_model_seat_in_four_player_games(fmt, seed, expected_seat):
    # evaluate seats the model at (seed % 2) % 4, so never at 2 or 3; openenv at seed % 4.
    result = run(OpenSpielEnv(fmt).reset(game_task_id("hearts"), seed=seed, opponent="random"))
    assert result["info"]["llm_player_id"] == expected_seat


@pytest.mark.parametrize("game", ["hearts", "euchre", "bridge"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_openenv_four_player_games_work_with_the_random_opponent(game, seed):
    # The real env's single random bot asks for player 0's legal actions and crashes here
    # (protocols.md, 'Where the real env fails', 6).
    final = run(play_episode(OpenSpielEnv("openenv"), game_task_id(game), seed=seed, opponent="random"))[-1]
    assert final["done"] and "error" not in final["info"]


def _replay_chance(game: str, rng: np.random.RandomState) -> pyspiel.State:
    state = pyspiel.load_game(game).new_initial_state()
    while state.is_chance_node():
        outcomes, probs = zip(*state.chance_outcomes())
        state.apply_action(rng.choice(outcomes, p=probs))
    return state


@pytest.mark.parametrize("fmt, chance_seed", [("evaluate", 11), ("openenv", 111)])
def test_chance_outcomes_come_from_the_seeded_stream(fmt, chance_seed):
    # evaluate draws chance from RandomState(seed), openenv from RandomState(seed + 100).
    result = run(OpenSpielEnv(fmt).reset(game_task_id("blackjack"), seed=11))
    expected = _replay_chance("blackjack", np.random.RandomState(chance_seed)).observation_string(0)
    assert expected in result["info"]["turn_prompt"]


@pytest.mark.parametrize("fmt, bot_seed", [("evaluate", 1 + 4 + 0), ("openenv", 1 + 2)])
def test_random_opponent_draws_from_its_seat_seed(fmt, bot_seed):
    # seed 1 seats the model at 1 in both formats; the bot at seat 0 moves first.
    oracle_rng = np.random.RandomState(bot_seed)
    oracle = pyspiel.load_game("hex", {"board_size": 5}).new_initial_state()
    env = OpenSpielEnv(fmt)
    result = run(env.reset(game_task_id("hex"), seed=1, opponent="random"))

    async def play():
        nonlocal result
        while not result["done"]:
            oracle.apply_action(oracle_rng.choice(oracle.legal_actions()))
            assert result["info"]["last_opponent_action"] == oracle.history()[-1]
            move = result["info"]["legal_actions"][0]
            oracle.apply_action(move)
            result = await env.step(str(move), result["episode_id"])

    run(play())


def test_evaluate_mcts_bots_use_their_seat_seeds():
    game = load_game("phantom_ttt", (("obstype", "reveal-nothing"),))
    seed, sims = 3, 30  # model at seat 1, bot at seat 0: rollouts seed+5+0, tree seed+6+0
    oracle_bot = mcts.MCTSBot(game, 1.414, sims, AffineRolloutEvaluator(150, np.random.RandomState(seed + 5)),
                              random_state=np.random.RandomState(seed + 6))
    oracle = game.new_initial_state()
    env = OpenSpielEnv("evaluate", mcts_simulations=sims, opponent_search="exact")
    result = run(env.reset(game_task_id("phantom_ttt"), seed=seed))
    oracle.apply_action(oracle_bot.step(oracle))
    assert result["info"]["last_opponent_action"] == oracle.history()[-1]
    run(env.stop(result["episode_id"]))


# ---------------------------------------------------------------- the fast search (open_spiel's C++ MCTS)
def _fast(game: str) -> None:
    assert GAMES[game].fast_search, f"{game} is expected to play the fast search"


@pytest.mark.parametrize("game", ["leduc_poker", "liars_dice"])
def test_the_validator_search_games_get_the_fast_search_by_default(game):
    _fast(game)
    assert all(isinstance(bot, pyspiel.MCTSBot) for bot in _bots(game, "evaluate", 0, "mcts", search="fast").values())
    assert all(isinstance(bot, mcts.MCTSBot) for bot in _bots(game, "evaluate", 0, "mcts", search="exact").values())


def test_a_game_whose_parity_is_not_proven_keeps_the_exact_search(monkeypatch):
    monkeypatch.setitem(GAMES, "hex", dataclasses.replace(GAMES["hex"], fast_search=False))
    assert isinstance(_bots("hex", "evaluate", 0, "mcts", search="fast")[1], mcts.MCTSBot)


def test_the_fast_bots_use_their_seat_seeds_and_the_spec_settings():
    _fast("leduc_poker")
    game = load_game("leduc_poker", (("players", 2),))
    seed = 7  # model at seat 1, bot at seat 0: rollouts seed+5+0, tree seed+6+0, as in the exact search
    oracle_bot = pyspiel.MCTSBot(game, pyspiel.RandomRolloutEvaluator(200, seed + 5), 1.414, 3000, 2048, True,
                                 seed + 6, False)
    oracle = game.new_initial_state()
    chance = np.random.RandomState(seed)
    env = OpenSpielEnv("evaluate", opponent_search="fast")
    result = run(env.reset(game_task_id("leduc_poker"), seed=seed, opponent="mcts"))
    while oracle.is_chance_node():
        outcomes, probs = zip(*oracle.chance_outcomes())
        oracle.apply_action(int(chance.choice(outcomes, p=probs)))
    oracle.apply_action(oracle_bot.step(oracle))
    assert result["info"]["last_opponent_action"] == oracle.history()[-1]
    run(env.stop(result["episode_id"]))


def test_fast_episodes_replay_identically_from_their_seeds():
    def play() -> list[list[str]]:
        env = OpenSpielEnv("evaluate", mcts_simulations=200, opponent_search="fast")
        return [[r["observation"] for r in run(play_episode(env, game_task_id("liars_dice"), seed, "mcts"))]
                for seed in (0, 1)]

    assert play() == play()


def test_an_unknown_opponent_search_is_refused():
    with pytest.raises(ValueError, match="opponent_search must be one of"):
        OpenSpielEnv("evaluate", opponent_search="quick")


def test_chess_model_as_player_0_plays_black_after_whites_first_move():
    env = OpenSpielEnv("evaluate")
    black = run(env.reset(game_task_id("chess"), seed=0, opponent="random"))
    assert black["info"]["llm_player_id"] == 0 and black["info"]["step_count"] == 1
    assert "last_opponent_action" in black["info"]
    assert " b KQkq " in black["observation"]
    white = run(env.reset(game_task_id("chess"), seed=1, opponent="random"))
    assert white["info"]["step_count"] == 0 and "last_opponent_action" not in white["info"]
    assert "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1" in white["observation"]


def _hands(prompt: str) -> tuple[list[str], list[str]]:
    lines = dict(line.split(": ", 1) for line in prompt.splitlines() if line.startswith(("P0 hand", "P1 hand")))
    return lines["P0 hand"].split(), lines["P1 hand"].split()


def test_goofspiel_applies_the_joint_bid_in_evaluate_format():
    env = OpenSpielEnv("evaluate")
    first = run(env.reset(game_task_id("goofspiel"), seed=0))  # 8 cards, model at seat 0
    assert first["info"]["legal_actions"] == [0, 1, 2, 3, 4, 5, 6, 7]
    opponent_bid = np.random.RandomState(0 + 4 + 1).choice(range(8)) + 1
    after = run(env.step("7", first["episode_id"]))  # bid card 8
    ours, theirs = _hands(after["observation"])
    assert ours == ["1", "2", "3", "4", "5", "6", "7"]
    assert theirs == [str(c) for c in range(1, 9) if c != opponent_bid]


def test_goofspiel_openenv_shows_legal_cards_and_plays_the_chosen_one():
    # The real env shows "Waiting for Player -2" and remaps the cards from round 2 on
    # (protocols.md, 'Where the real env fails', 7).
    env = OpenSpielEnv("openenv")
    result = run(env.reset(game_task_id("goofspiel"), seed=0))
    assert "Waiting for Player" not in result["observation"] and "  7 -> [P0]Bid: 8" in result["observation"]
    result = run(env.step("7", result["episode_id"]))
    result = run(env.step("6", result["episode_id"]))  # round 2: bid card 7
    assert _hands(result["observation"])[0] == ["1", "2", "3", "4", "5", "6"]


# ---------------------------------------------------------------- actions and parsing
# (protocols.md, 'The reset/step protocol' and 'The evaluate() conversation')
GARBAGE = ["", "hello", "-1", "99999", "9" * 10_000, "lorem ipsum " * 900, "♠♥ 你好 🂡 ٣", "<think>7</think>3",
           None]
# hex 5x5, seed 0: the model opens, all 25 cells (ids 0-24) are legal.
EVALUATE_PARSE = {"": None, "hello": None, "-1": 1, "99999": None, "9" * 10_000: None,
                  "lorem ipsum " * 900: None, "♠♥ 你好 🂡 ٣": None, "<think>7</think>3": 3, None: None}
OPENENV_PARSE = {"": None, "hello": None, "-1": 1, "99999": None, "9" * 10_000: None,
                 "lorem ipsum " * 900: None, "♠♥ 你好 🂡 ٣": 3, "<think>7</think>3": 7, None: None}


@pytest.mark.parametrize("fmt, expected", [("evaluate", EVALUATE_PARSE), ("openenv", OPENENV_PARSE)])
@pytest.mark.parametrize("garbage", GARBAGE, ids=lambda g: repr(g)[:20])
def test_garbage_actions_never_crash(fmt, expected, garbage):
    env = OpenSpielEnv(fmt)
    first = run(env.reset(game_task_id("hex"), seed=0, opponent="random"))
    result = run(env.step(garbage, first["episode_id"]))
    assert not result["done"]
    if expected[garbage] is None:
        assert result["info"]["parse_error"] and result["info"]["illegal_moves"] == 1
        assert result["info"]["turn_prompt"] == first["info"]["turn_prompt"]
        assert result["reward"] == (-0.01 if fmt == "openenv" else 0.0)
    else:
        assert not result["info"]["parse_error"] and result["info"]["turns"] == 1
        assert result["info"]["step_count"] == 2  # our stone and the opponent's reply
        assert expected[garbage] not in result["info"]["legal_actions"]


def test_evaluate_gives_three_attempts_then_loses_the_game():
    env = OpenSpielEnv("evaluate")
    first = run(env.reset(game_task_id("hex"), seed=0))
    one = run(env.step("no idea", first["episode_id"]))
    two = run(env.step("<think>5</think>", first["episode_id"]))
    assert (one["info"]["attempt"], two["info"]["attempt"]) == (2, 3)
    assert one["observation"].endswith("This is attempt 1 of 3.") and not two["done"]
    three = run(env.step("99", first["episode_id"]))
    assert three["done"] and not three["truncated"]
    assert three["reward"] == 0.0 and three["info"]["score"] == 0.0 and three["info"]["success"] is False
    assert three["info"]["returns"] is None and "error" not in three["info"]
    assert "attempt 3 of 3" in three["observation"]


def test_a_valid_reply_resets_the_attempt_count():
    env = OpenSpielEnv("evaluate", max_parse_attempts=2)
    first = run(env.reset(game_task_id("hex"), seed=0, opponent="random"))
    run(env.step("?", first["episode_id"]))
    moved = run(env.step("12", first["episode_id"]))
    assert moved["info"]["attempt"] == 1 and moved["observation"] == moved["info"]["turn_prompt"]
    assert not run(env.step("?", first["episode_id"]))["done"]


def test_openenv_never_ends_an_episode_for_invalid_actions():
    env = OpenSpielEnv("openenv")
    first = run(env.reset(game_task_id("chess"), seed=1, opponent="random"))
    for _ in range(20):
        result = run(env.step("pawn to e4", first["episode_id"]))
    assert not result["done"] and result["info"]["illegal_moves"] == 20 and result["info"]["step_count"] == 0
    assert result["info"]["error"]["type"] == "invalid_action"
    assert result["observation"].startswith('Invalid action: "pawn to e4"')
    assert "  ... and 10 more" in result["observation"]  # 20 legal opening moves, the first 10 listed


@pytest.mark.parametrize("raw, expected", [
    ("<think>7</think>3", "3"),
    ("<THINK>a</think>b", "b"),
    (" <thinking>x\ny</thinking> 5 ", "5"),
    ("<think>a</think> 1 <think>b</think> 2", "1  2"),
    ("stray reasoning</think>4", "4"),
    ("a</think>b</thinking>c", "c"),
    ("4<think>never closed", "4"),
    ("a\n\n\n\n\nb", "a\n\nb"),
    ("<think>only</think>", ""),
    ("", ""),
])
def test_strip_think(raw, expected):
    assert strip_think(raw) == expected


@pytest.mark.parametrize("reply, legal, labels, expected", [
    ("7", [3, 7], ["a", "b"], 7),
    ("  7 \n", [3, 7], ["a", "b"], 7),
    ("007", [7], ["a"], 7),
    ("5", [1, 2], ["5 cards", "x"], None),  # an illegal bare number does not fall through to labels
    ("between 30 and 29, I pick 29", [29, 30], ["x", "y"], 29),  # ascending ids, first whole word
    ("1-1", [0, 1], ["1-1", "1-2"], 1),  # protocols.md's example: the id rule wins over the label
    ("a12b then 12", [12], ["z"], 12),
    ("a12b", [12], ["z"], None),
    ("I play c4", [19, 26], ["d3", "c4"], 26),
    ("p0 bid 3", [2], ["[P0]Bid: 3"], 2),  # label with the punctuation and spaces removed
    ("pass", [5, 6], ["Pass", "pass"], 6),  # a later duplicate label takes over the id
    ("hello", [3], ["--"], None),  # a label of symbols only must not match everything
    ("", [0, 1], ["Hit", "Stand"], None),
    ("9" * 5000, [9], ["x"], None),
])
def test_parse_evaluate_action(reply, legal, labels, expected):
    assert parse_evaluate_action(reply, legal, labels) == expected


@pytest.mark.parametrize("text, legal, expected", [
    ("<think>call 1</think> 999", [1, 999], 1),  # no think stripping in openenv
    ("-5", [5], 5),
    ("3.7", [3, 7], 3),
    ("move 12 or 13", [13], None),  # only the first digit run counts
    ("none", [0], None),
    ("1" * 5000, [1], None),
])
def test_parse_openenv_action(text, legal, expected):
    assert parse_openenv_action(text, legal) == expected


# ---------------------------------------------------------------- scoring (protocols.md, 'Scores')
@pytest.mark.parametrize("returns, player, zero_sum, lo, hi, expected", [
    ([1.0, -1.0], 0, True, -1, 1, 1.0),
    ([0.0, 0.0], 1, True, -1, 1, 0.5),
    ([1.0, -1.0], 0, True, -13, 13, 14 / 26),  # leduc: (r + 13) / 26
    ([-5.0, 5.0], 0, True, -13, 13, 8 / 26),
    ([0.0, 0.0], 0, True, -123, 123, 0.5),  # gin hand with an exhausted stock
    ([2.0, -2.0, 2.0, -2.0], 2, True, -4, 4, 0.75),  # euchre: (r + 4) / 8
    ([-1.0, 1.0, -1.0, 1.0], 0, True, -4, 4, 0.375),
    ([-4.0, 4.0, -4.0, 4.0], 1, True, -4, 4, 1.0),
    ([-150.0, 150.0, -150.0, 150.0], 0, True, -7600, 7600, 7450 / 15200),  # bridge
    ([26.0, 20.0, 20.0, 0.0], 0, False, 0, 36, 1.0),  # hearts: place, ties share the better one
    ([26.0, 20.0, 20.0, 0.0], 1, False, 0, 36, 2 / 3),
    ([26.0, 20.0, 20.0, 0.0], 2, False, 0, 36, 2 / 3),
    ([26.0, 20.0, 20.0, 0.0], 3, False, 0, 36, 0.0),
    ([10.0, 10.0, 10.0, 10.0], 3, False, 0, 36, 1.0),
    ([3.0, 1.0], 0, False, 0, 10, 1.0),  # 2-player general-sum: win / draw / loss
    ([1.0, 1.0], 1, False, 0, 10, 0.5),
    ([1.0], 0, False, -1, 1, 1.0),  # blackjack: (r + 1) / 2
    ([0.0], 0, False, -1, 1, 0.5),
    ([-1.0], 0, False, -1, 1, 0.0),
    ([1436.0], 0, False, 0, 20480, 1436 / 20480),  # 2048
    ([360.0], 0, False, 0, 3220, 360 / 3220),  # solitaire
    ([5.0], 0, False, 1, 1, 0.5),  # degenerate single-player range
    ([1.0, -1.0], 0, True, 1, 1, 0.0),  # degenerate zero-sum range
])
def test_compute_score(returns, player, zero_sum, lo, hi, expected):
    assert compute_score(returns, player, zero_sum, lo, hi) == pytest.approx(expected)


def test_openenv_2048_reports_merge_rewards_then_the_score():
    results = run(play_episode(OpenSpielEnv("openenv"), game_task_id("2048"), seed=0, opponent="random"))
    step_rewards = [r["reward"] for r in results[1:-1]]
    assert any(r > 0 for r in step_rewards) and all(r >= 0 and r % 4 == 0 for r in step_rewards)
    assert results[-1]["reward"] == results[-1]["info"]["score"] == results[-1]["info"]["returns"][0] / 20480


def test_evaluate_rewards_are_zero_until_the_final_score():
    results = run(play_episode(OpenSpielEnv("evaluate"), game_task_id("2048"), seed=0, opponent="random"))
    assert all(r["reward"] == 0.0 for r in results[:-1]) and results[-1]["reward"] == results[-1]["info"]["score"]


# ---------------------------------------------------------------- state descriptions
# (protocols.md, 'State descriptions')
class _FakeState:
    def __init__(self, observation: str = "", information_state: str = ""):
        self._observation, self._information_state = observation, information_state

    def observation_string(self, player):
        return self._observation

    def information_state_string(self, player):
        return self._information_state


@pytest.mark.parametrize("cards, total", [("HT CJ", 20), ("CT CA", 21), ("HT SA S9", 20), ("SA HA", 12), ("D9 C3", 12)])
def test_blackjack_total_counts_a_ten(cards, total):
    # The real env's int("T") crashes every hand holding a ten (protocols.md, 'Where the real env fails', 4).
    state = _FakeState(f"Current Phase: Player Turn\nCurrent Player: 0\nPlayer 0: Cards: {cards}\n"
                       "Dealer: Cards: ?? HA\n")
    assert describe_blackjack(state, 0).endswith(f"\nYour total: {total} points")


@pytest.mark.parametrize("fmt", FORMATS)
def test_blackjack_with_tens_plays_in_both_formats(fmt):
    env = OpenSpielEnv(fmt)
    tens = 0
    for seed in range(40):
        first = run(env.reset(game_task_id("blackjack"), seed=seed))
        tens += "T" in first["info"]["turn_prompt"].split("Cards:")[1].split("\n")[0]
        final = run(env.step("1", first["episode_id"])) if not first["done"] else first
        assert final["done"] and final["info"]["score"] in (0.0, 0.5, 1.0)
    assert tens >= 3


def test_leduc_description():
    state = _FakeState(information_state="[Observer: 1][Private: 0][Round 2][Player: 1][Pot: 10][Money: 93 97]"
                                         "[Public: 1][Round1: 2 1][Round2: 2]")
    assert describe_leduc(state, 1) == "\n".join([
        "Your card: J♠", "Public card: J♥", "Hand: Pair", "Current round: 2/2", "Pot size: 10 chips",
        "Your chips: 97", "Opponent chips: 93", "Round 1 betting: Raise, Call", "Round 2 betting: Raise",
        "Your turn to act",
    ])


def test_leduc_description_falls_back_to_the_raw_text():
    state = _FakeState(information_state="[Observer: 0][Private: x]")
    assert describe_leduc(state, 0).startswith("[Error formatting state:")
    assert describe_leduc(state, 0).endswith("\n[Observer: 0][Private: x]")


def test_goofspiel_description_rewrites_points_and_explains_the_win_sequence():
    env = OpenSpielEnv("evaluate")
    first = run(env.reset(game_task_id("goofspiel"), seed=0))
    assert "Win sequence: \n(1 = Player 1 took the prize" in first["observation"]
    assert "Player 0: 0 points, Player 1: 0 points" in first["observation"] and "Points:" not in first["observation"]


def test_liars_dice_description_shows_the_standing_bid():
    env = OpenSpielEnv("evaluate")
    first = run(env.reset(game_task_id("liars_dice"), seed=0, opponent="random"))
    assert "No bid yet - you must make the first bid" in first["observation"]
    second = run(env.step("3", first["episode_id"]))  # bid 1-4
    bid = f"{second['info']['last_opponent_action'] // 6 + 1}-{second['info']['last_opponent_action'] % 6 + 1}"
    assert f'Current bid: "{bid}"' in second["observation"]
    assert "Number of dice per player: 5\nTotal dice in game: 10\nNumber of players: 2" in second["observation"]


# ---------------------------------------------------------------- protocol (protocols.md, 'The reset/step protocol')
def test_evaluate_messages_and_info():
    env = OpenSpielEnv("evaluate")
    first = run(env.reset(game_task_id("othello"), seed=0, opponent="random"))
    system = first["info"]["system_prompt"]
    assert system.startswith("You are playing othello.\n\n# Game Rules\n") and "\n# Output Format\n" in system
    assert first["observation"] == first["info"]["turn_prompt"]
    assert first["observation"].startswith("Current State:\n") and first["observation"].endswith(
        "\n\nYou are Player 0.\nLegal Actions:\n19 -> d3\n26 -> c4\n37 -> f5\n44 -> e6\n\nYour choice (ID only):")
    failed = run(env.step("x", first["episode_id"]))
    assert failed["observation"] != failed["info"]["turn_prompt"] == first["info"]["turn_prompt"]


def test_openenv_reset_text_carries_the_rules_and_later_texts_do_not():
    env = OpenSpielEnv("openenv")
    first = run(env.reset(game_task_id("othello"), seed=0, opponent="random"))
    assert first["info"]["system_prompt"] is None
    assert first["observation"].startswith("# Game Rules\n" + GAMES["othello"].rules + "\n\n# Current Game State\n")
    assert first["observation"].endswith("Legal Actions:\n  19 -> d3\n  26 -> c4\n  37 -> f5\n  44 -> e6\n\n"
                                         "Your choice (action ID only):")
    second = run(env.step("19", first["episode_id"]))
    assert second["observation"].startswith("Game: othello\nYou are Player 0.\n\nCurrent State:\n")


def test_openenv_terminal_text():
    final = run(play_episode(OpenSpielEnv("openenv"), game_task_id("hex"), seed=0, opponent="random"))[-1]
    returns = final["info"]["returns"]
    result = "WIN" if returns[0] > 0 else "LOSS"
    assert final["observation"] == (f"Game Over: hex\nYou were Player 0.\n\nFinal Returns: {returns!r}\n"
                                    f"Your Return: {returns[0]!r}\nNormalized Score: {final['info']['score']:.3f}\n"
                                    f"Result: {result}")


def test_unknown_stopped_and_finished_episodes():
    env = OpenSpielEnv("evaluate")
    assert run(env.step("1", ""))["info"]["error"]["type"] == "no_episode_id"
    missing = run(env.step("1", "f" * 32))
    assert missing["done"] and missing["truncated"] and missing["info"]["error"]["type"] == "episode_not_found"
    live = run(env.reset(game_task_id("hex"), seed=0))
    assert run(env.stop(live["episode_id"])) == {"status": "ok", "stopped": True, "episode_id": live["episode_id"]}
    assert run(env.step("1", live["episode_id"]))["info"]["error"]["type"] == "episode_not_found"
    assert run(env.stop(live["episode_id"]))["stopped"] is False
    final = run(play_episode(env, game_task_id("hex"), seed=0, opponent="random"))[-1]
    again = run(env.step("1", final["episode_id"]))
    assert again["done"] and not again["truncated"] and again["info"]["error"]["type"] == "episode_done"
    assert again["observation"] == final["observation"] and again["reward"] == 0.0
    assert run(env.state(final["episode_id"]))["info"]["score"] == final["info"]["score"]


def test_reset_rejects_unknown_opponents_and_arguments():
    env = OpenSpielEnv()
    with pytest.raises(ValueError, match="opponent must be one of"):
        run(env.reset(0, seed=0, opponent="minimax"))
    with pytest.raises(TypeError, match="unexpected arguments"):
        run(env.reset(0, seed=0, temperature=0.0))


@pytest.mark.parametrize("fmt", FORMATS)
def test_seeds_near_two_to_the_32_do_not_overflow(fmt):
    # The real env's RandomState(seed + offset) raises past 2**32 - 1 (protocols.md, 'Seeds').
    final = run(play_episode(OpenSpielEnv(fmt), game_task_id("hearts"), seed=2**32 - 1, opponent="random"))[-1]
    assert final["done"] and "error" not in final["info"]


def test_missing_task_and_seed_come_from_the_env_seed():
    def draws(env_seed):
        env = OpenSpielEnv(seed=env_seed)
        out = []
        for _ in range(3):
            result = run(env.reset(opponent="random"))
            out.append((result["info"]["task_id"], result["info"]["seed"]))
        return out

    assert draws(5) == draws(5) != draws(6)
    assert all(0 <= t < 10**11 and 0 <= s < 2**32 for t, s in draws(5))


# ---------------------------------------------------------------- determinism and concurrency (protocols.md, 'Seeds')
def _trace(results: list[dict]) -> list[tuple]:
    return [(r["observation"], r["reward"], r["done"], r["info"].get("last_opponent_action")) for r in results]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("game, opponent", [("backgammon", "random"), ("leduc_poker", "mcts"), ("goofspiel", "mcts"),
                                            ("euchre", "mcts")])
def test_same_task_seed_and_actions_give_the_same_game(fmt, game, opponent):
    def play(seed):
        return run(play_episode(OpenSpielEnv(fmt, mcts_simulations=5), game_task_id(game), seed, opponent, 1))

    first, second, other_seed = play(5), play(5), play(7)
    assert _trace(first) == _trace(second)
    assert _trace(first) != _trace(other_seed)


@pytest.mark.slow
def test_sixty_concurrent_episodes_match_their_sequential_runs():
    tasks = [(game_task_id(AVAILABLE_GAMES[i % 22], i), i, "mcts" if i % 3 == 0 else "random") for i in range(66)]
    tasks = [t for t in tasks if is_playable(t[0])]
    cheap = {"liars_dice", "leduc_poker", "hex", "phantom_ttt", "euchre", "dots_and_boxes", "go", "clobber"}
    tasks = [(t, s, o if decode_task_id(t)["game_name"] in cheap else "random") for t, s, o in tasks]

    async def together():
        env = OpenSpielEnv("evaluate", mcts_simulations=3)
        runs = await asyncio.gather(*(play_episode(env, t, s, o, policy_seed=s) for t, s, o in tasks))
        assert env._live == {}
        return runs

    async def one_by_one():
        env = OpenSpielEnv("evaluate", mcts_simulations=3)
        return [await play_episode(env, t, s, o, policy_seed=s) for t, s, o in tasks]

    concurrent_runs = run(together())
    assert len(concurrent_runs) >= 60 and all(r[-1]["done"] for r in concurrent_runs)
    assert [_trace(r) for r in concurrent_runs] == [_trace(r) for r in run(one_by_one())]


async def _ticks_while(call) -> tuple[int, dict]:
    """How often another coroutine got to run while `call` was awaited (1 = the loop was blocked)."""
    pending = asyncio.ensure_future(call)
    ticks = 0
    while not pending.done():
        ticks += 1
        await asyncio.sleep(0)
    return ticks, await pending


def test_search_moves_do_not_block_the_event_loop():
    async def main():
        env = OpenSpielEnv("evaluate", mcts_simulations=50)
        first = await env.reset(game_task_id("hex"), seed=0)
        ticks, result = await _ticks_while(env.step("12", first["episode_id"]))
        assert ticks > 1 and result["info"]["step_count"] == 2

    run(main())


def test_dealing_bridge_does_not_block_the_event_loop():
    # Completing the deal runs open_spiel's double-dummy solver, 0.5-3 s per deal.
    async def main():
        ticks, result = await _ticks_while(OpenSpielEnv("evaluate").reset(game_task_id("bridge"), seed=0,
                                                                          opponent="random"))
        assert ticks > 1 and not result["done"]

    run(main())


# ---------------------------------------------------------------- worker processes
def test_worker_processes_play_the_same_games_as_in_process():
    tasks = [(game_task_id(g), s, "mcts") for g in ("hex", "leduc_poker", "euchre", "goofspiel") for s in (0, 1)]

    async def play_all(env):
        try:
            return await asyncio.gather(*(play_episode(env, t, s, o, policy_seed=s) for t, s, o in tasks))
        finally:
            await env.close()

    in_process = run(play_all(OpenSpielEnv("evaluate", mcts_simulations=5)))
    in_workers = run(play_all(OpenSpielEnv("evaluate", mcts_simulations=5, workers=2)))
    assert [_trace(r) for r in in_workers] == [_trace(r) for r in in_process]


def test_a_dead_worker_fails_its_episodes_and_is_replaced():
    import multiprocessing
    import os
    import signal

    async def main():
        env = OpenSpielEnv("openenv", workers=1, mcts_simulations=5)  # a search opponent: the episode goes to a worker
        first = await env.reset(game_task_id("hex"), seed=0, opponent="mcts")
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
        lost = await env.step("3", first["episode_id"])
        assert lost["done"] and lost["truncated"] and lost["info"]["error"]["type"] == "worker_lost"
        assert (await env.step("4", first["episode_id"]))["info"]["error"]["type"] == "episode_not_found"
        fresh = await env.reset(game_task_id("hex"), seed=0, opponent="mcts")
        assert fresh["observation"] == first["observation"]
        assert (await env.stop(fresh["episode_id"]))["stopped"]
        assert (await env.state(fresh["episode_id"]))["info"]["error"]["type"] == "episode_not_found"
        await env.close()

    run(main())


def test_each_result_says_how_long_the_opponents_took_to_move():
    env = OpenSpielEnv("evaluate", mcts_simulations=50, opponent_search="exact")
    results = run(play_episode(env, game_task_id("leduc_poker"), seed=1, opponent="mcts"))
    seconds = [r["info"]["opponent_seconds"] for r in results]
    assert seconds == sorted(seconds) and seconds[-1] > 0  # cumulative; the search took measurable time


def test_exact_rollouts_stop_at_a_state_without_legal_actions():
    """A few gin_rummy states are not terminal yet offer no action; a playout ends there with the state's
    current returns, as the Affine evaluator's does (numpy cannot draw from nothing)."""
    class Stuck:  # one move to a non-terminal state with no legal actions
        def __init__(self, moved=False):
            self.moved = moved

        def is_terminal(self):
            return False

        def legal_actions(self):
            return [] if self.moved else [7]

        def apply_action(self, action):
            self.moved = True

        def clone(self):
            return Stuck(self.moved)

        def returns(self):
            return [0.25, -0.25] if self.moved else [0.0, 0.0]

        def get_game(self):
            return load_game("leduc_poker", (("players", 2),))

    values = AffineRolloutEvaluator(3, np.random.RandomState(0)).evaluate(Stuck())
    assert values.tolist() == [0.25, -0.25]


def test_the_episodes_random_streams_are_numpys_random_state_of_the_seed_draw_for_draw():
    """`_rng` builds its generator without RandomState's hashed first seeding; every draw is still the one
    RandomState(seed) gives (chance, random bots, the exact search), on the seeds' edges and a spread between."""
    import random

    import numpy as np

    from ppo_affine.envs.openspiel_episode import SEED_SPACE, _rng

    seeds = [0, 1, -1, 2**31 - 1, 2**31, SEED_SPACE - 1, SEED_SPACE, 3 * SEED_SPACE + 7]
    seeds += [random.Random(5).randrange(2**40) for _ in range(50)]
    for seed in seeds:
        ours, numpys = _rng(seed), np.random.RandomState(seed % SEED_SPACE)
        assert ours.randint(0, 10**6, 20).tolist() == numpys.randint(0, 10**6, 20).tolist()
        assert ours.standard_normal(3).tolist() == numpys.standard_normal(3).tolist()  # the gauss cache too
        assert ours.choice(7, 5, p=[0.1, 0.2, 0.3, 0.1, 0.1, 0.1, 0.1]).tolist() == \
            numpys.choice(7, 5, p=[0.1, 0.2, 0.3, 0.1, 0.1, 0.1, 0.1]).tolist()
        assert ours.get_state()[1].tolist() == numpys.get_state()[1].tolist()


def test_episode_costs_are_running_means_per_game_and_seat_and_the_mean_of_all_for_an_unseen_kind():
    from ppo_affine.envs.openspiel_env import EpisodeCosts

    costs = EpisodeCosts()
    assert costs.expected(("liars_dice", "mcts", 1)) == 1.0  # nothing finished yet: every kind alike (a count)
    costs.finished(("liars_dice", "mcts", 1), 3.0)
    costs.finished(("liars_dice", "mcts", 1), 1.0)
    costs.finished(("leduc_poker", "mcts", 0), 0.5)
    assert costs.expected(("liars_dice", "mcts", 1)) == 2.0
    assert costs.expected(("leduc_poker", "mcts", 0)) == 0.5
    assert costs.expected(("goofspiel", "mcts", 0)) == pytest.approx(4.5 / 3)  # unseen: the mean over finished episodes
    for _ in range(300):  # past 256 episodes the old ones weigh half: the mean follows a change
        costs.finished(("leduc_poker", "mcts", 0), 2.0)
    assert 1.9 < costs.expected(("leduc_poker", "mcts", 0)) < 2.0


def test_a_new_episode_goes_to_the_worker_with_the_fewest_expected_seconds_left():
    """Two workers; the expensive kind's episodes split between them instead of following the count."""
    import asyncio as aio

    from ppo_affine.envs.openspiel_env import OpenSpielEnv, _Live

    env = OpenSpielEnv(workers=0)
    env._workers = [object(), object()]  # only their number is used here
    env.costs.finished(("liars_dice", "mcts", 1), 2.0)
    env.costs.finished(("leduc_poker", "mcts", 0), 0.01)
    placed = []
    for index, kind in enumerate([("liars_dice", "mcts", 1), ("leduc_poker", "mcts", 0)] * 4):
        live = env._live[f"e{index}"] = _Live(aio.Lock(), kind=kind, expected=env.costs.expected(kind))
        live.worker = env._least_loaded_worker()
        placed.append((kind[0], live.worker))
    expensive = [worker for game, worker in placed if game == "liars_dice"]
    assert sorted(expensive) == [0, 0, 1, 1]  # by count, alternating placement put all four on worker 0
    on_worker_0 = [live for live in env._live.values() if live.worker == 0 and live.kind[0] == "liars_dice"]
    for live in on_worker_0:  # worker 0's searches are nearly done: the next episodes go there
        live.spent = 1.9
    assert on_worker_0[0].left == pytest.approx(0.2)  # at least a tenth of the estimate is left
    assert env._least_loaded_worker() == 0
    for live in on_worker_0:
        live.spent = 0.0
    for live in env._live.values():  # and the other way round
        live.spent = 1.9 if live.worker == 1 and live.kind[0] == "liars_dice" else 0.0
    assert env._least_loaded_worker() == 1


def test_worker_episodes_are_costed_from_the_seconds_their_worker_spent():
    async def play():
        env = OpenSpielEnv("evaluate", mcts_simulations=5, workers=1)
        try:
            await play_episode(env, game_task_id("leduc_poker"), seed=3, opponent="mcts")
            assert env._workers[0] is not None
            return env.costs
        finally:
            await env.close()
    costs = run(play())
    assert 0 < costs.expected(("leduc_poker", "mcts", 1)) < 1.0  # measured: milliseconds, not the 1.0 placeholder


def test_with_workers_cheap_kinds_play_in_this_process_and_the_same_games():
    """Against a random opponent, or once a kind measured under INLINE_SECONDS an episode, the episode plays here
    (no worker queue holds its moves); a kind that costs more, or an unmeasured one against the MCTS, goes to a
    worker. Where an episode plays changes none of its moves."""
    from ppo_affine.envs.openspiel_env import INLINE_SECONDS

    env = OpenSpielEnv("evaluate", workers=0)
    assert env._plays_here(("goofspiel", "random", 0), "random")
    assert not env._plays_here(("liars_dice", "mcts", 1), "mcts")
    env.costs.finished(("liars_dice", "mcts", 1), 10 * INLINE_SECONDS)
    env.costs.finished(("leduc_poker", "mcts", 0), INLINE_SECONDS / 5)
    assert not env._plays_here(("liars_dice", "mcts", 1), "mcts")
    assert env._plays_here(("leduc_poker", "mcts", 0), "mcts")

    placed = []

    async def play_all(env):
        original = env._least_loaded_worker
        env._least_loaded_worker = lambda: placed.append(1) or original()
        try:
            return [await play_episode(env, game_task_id(game), seed=seed, opponent=opponent, policy_seed=seed)
                    for game, opponent in (("leduc_poker", "random"), ("hex", "mcts"), ("hex", "mcts"))
                    for seed in (0, 1)]
        finally:
            await env.close()

    with_workers = OpenSpielEnv("evaluate", mcts_simulations=5, workers=1)
    with_workers.costs.finished(("hex", "mcts", 1), INLINE_SECONDS / 5)  # hex from seat 1: measured cheap
    played = run(play_all(with_workers))
    # only the first hex game from seat 0 (not measured yet) went to the worker: it measured cheap (5 simulations),
    # so the second played here, as did the measured seat 1 and every game against the random opponent
    assert len(placed) == 1
    assert with_workers.costs.measured(("hex", "mcts", 0)) < INLINE_SECONDS
    assert [_trace(r) for r in played] == [_trace(r) for r in run(play_all(OpenSpielEnv("evaluate",
                                                                                      mcts_simulations=5)))]
