"""The file of recorded opponent moves (ppo_affine/envs/opponent_moves.py): replaying it must give the
games a search gives, move for move, also after a game leaves the recorded history."""
from __future__ import annotations

import asyncio

import pytest

from ppo_affine.envs.openspiel_env import OpenSpielEnv
from ppo_affine.envs.openspiel_episode import Episode
from ppo_affine.envs.opponent_moves import OpponentMoves
from ppo_affine.envs.tasks import game_task_id


def play(game: str, seed: int, policy: str, log, search: str = "fast", simulations: int = 25):
    """One evaluate-format game in which the model plays the lowest legal action ('low'), the highest
    ('high'), or the lowest at its first decision and the highest after it ('low-then-high').
    Returns (full history, score, opponent moves replayed from the file)."""
    episode = Episode("e", task_id=game_task_id(game), seed=seed, opponent="mcts", observation_format="evaluate",
                      max_parse_attempts=3, mcts_simulations=simulations, opponent_search=search,
                      opponent_moves=log and str(log))
    episode.start()
    decisions = 0
    while not episode.done:
        pick = min if policy == "low" or (policy == "low-then-high" and decisions == 0) else max
        episode.step(str(pick(episode.legal)))
        decisions += 1
    return episode.state.history(), episode.score, episode.opponent_moves_replayed


@pytest.mark.parametrize("game,search,seeds", [("leduc_poker", "fast", 12), ("liars_dice", "fast", 12),
                                               ("leduc_poker", "exact", 3)])
def test_replayed_games_are_the_searched_games_also_after_they_leave_the_recorded_history(tmp_path, game, search,
                                                                                           seeds):
    # 25 simulations: a noisy search, so a bot whose random streams were not caught up plays other moves
    # (leaving out the catch-up fails this on leduc_poker's first seed)
    log = tmp_path / "moves.sqlite"
    replayed = 0
    for seed in range(seeds):
        searched = {policy: play(game, seed, policy, None, search)[:2] for policy in ("low", "low-then-high", "high")}
        first = play(game, seed, "low", log, search)
        again = play(game, seed, "low", log, search)
        assert first[:2] == again[:2] == searched["low"]
        assert first[2] == 0
        assert again[2] >= 1  # every opponent move of a repeated game comes from the file
        branching = play(game, seed, "low-then-high", log, search)
        assert branching[:2] == searched["low-then-high"], f"seed {seed}"
        assert play(game, seed, "high", log, search)[:2] == searched["high"], f"seed {seed}"
        replayed += branching[2]
    assert replayed > 0  # some games shared a prefix with a recorded one, then left it


def test_another_budget_or_seed_never_replays_a_recorded_move(tmp_path):
    log = tmp_path / "moves.sqlite"
    play("leduc_poker", 3, "low", log)
    recorded = len(OpponentMoves(log))
    assert recorded >= 1
    assert play("leduc_poker", 3, "low", log, simulations=26)[2] == 0
    assert play("leduc_poker", 5, "low", log)[2] == 0
    assert play("leduc_poker", 3, "low", log)[2] == recorded


def test_worker_processes_write_the_file_that_the_next_run_replays(tmp_path):
    log = tmp_path / "runs" / "moves.sqlite"  # its folder is made

    async def game(workers: int):
        env = OpenSpielEnv(workers=workers, mcts_simulations=25, opponent_moves=str(log))
        try:
            result = await env.reset(task_id=game_task_id("leduc_poker"), seed=7, opponent="mcts")
            replies = []
            while not result["done"]:
                replies.append(result["observation"])
                result = await env.step("1", result["episode_id"])  # Call is always legal
            return replies, result["info"]["score"]
        finally:
            await env.close()

    in_worker = asyncio.run(game(workers=1))
    assert len(OpponentMoves(log)) >= 1
    assert asyncio.run(game(workers=0)) == in_worker


def test_a_file_that_is_not_sqlite_is_refused_naming_the_setting(tmp_path):
    bad = tmp_path / "moves.sqlite"
    bad.write_text("not a database\n" * 100)
    with pytest.raises(ValueError, match=r"opponent_moves: .*moves\.sqlite is not a usable SQLite file"):
        OpenSpielEnv(opponent_moves=str(bad))


def test_a_path_that_cannot_become_the_file_is_refused_at_once(tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder\n")
    with pytest.raises(ValueError, match=r"opponent_moves: cannot create .*taken is not a folder"):
        OpenSpielEnv(opponent_moves=str(tmp_path / "taken" / "runs" / "moves.sqlite"))


def test_the_file_appears_only_once_an_mcts_opponent_plays(tmp_path):
    """Games whose opponent does not search (goofspiel's is uniform random) leave no empty file behind."""
    moves = tmp_path / "runs" / "moves.sqlite"
    OpenSpielEnv(opponent_moves=str(moves))
    assert play("goofspiel", 3, "low", moves)[2] == 0 and not moves.exists()
    play("leduc_poker", 3, "low", moves)
    assert len(OpponentMoves(moves)) > 0


def test_evaluations_share_a_file_only_for_local_game_envs_that_name_none(tmp_path):
    import evaluate
    from ppo_affine.config import EnvSpec

    path = tmp_path / "moves.sqlite"
    assert evaluate.shared_opponent_moves(EnvSpec(kind="openspiel"), path).opponent_moves == str(path)
    own = EnvSpec(kind="openspiel", opponent_moves="mine.sqlite")
    assert evaluate.shared_opponent_moves(own, path).opponent_moves == "mine.sqlite"
    remote = EnvSpec(kind="openspiel", mode="url", url="http://127.0.0.1:1")
    assert evaluate.shared_opponent_moves(remote, path).opponent_moves is None
    assert evaluate.shared_opponent_moves(EnvSpec(kind="trace"), path) == EnvSpec(kind="trace")


def test_an_illegal_recorded_move_is_searched_again_with_one_warning(tmp_path, caplog):
    import sqlite3

    log = tmp_path / "moves.sqlite"
    searched = play("leduc_poker", 3, "low", None)
    play("leduc_poker", 3, "low", log)
    for _ in range(2):
        with sqlite3.connect(log) as connection:
            connection.execute("UPDATE moves SET action = 7")  # leduc_poker's actions are 0, 1 and 2
        with caplog.at_level("WARNING", logger="ppo_affine.envs.opponent_moves"):
            replayed = play("leduc_poker", 3, "low", log)
        assert replayed[:2] == searched[:2] and replayed[2] == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"opponent_moves: {log} recorded move 7 where it is not legal (a damaged file, or one written by other code); "
        "the opponent searches there instead"]
    assert play("leduc_poker", 3, "low", log)[2] >= 1  # the searched moves replaced the illegal ones


def test_moves_recorded_by_another_search_or_open_spiel_version_are_never_replayed(tmp_path, monkeypatch):
    import functools

    import pyspiel

    from ppo_affine.envs import openspiel_episode

    log = tmp_path / "moves.sqlite"
    assert play("leduc_poker", 3, "low", log)[2] == 0
    assert play("leduc_poker", 3, "low", log, search="exact")[2] == 0  # the other implementation
    with monkeypatch.context() as patched:
        patched.setattr(pyspiel, "__version__", "0.0.1")
        assert play("leduc_poker", 3, "low", log)[2] == 0
    # a search whose settings or code changed is another search, with no format number to bump
    identity = openspiel_episode.search_identity.__wrapped__
    with monkeypatch.context() as patched:
        patched.setattr(openspiel_episode, "search_identity", functools.lru_cache(identity))
        patched.setattr(openspiel_episode, "UCT_C", 2.0)
        assert play("leduc_poker", 3, "low", log)[2] == 0
    assert play("leduc_poker", 3, "low", log)[2] >= 1  # the same search replays its own moves
    before = identity("exact")

    class ChangedRollouts(openspiel_episode.AffineRolloutEvaluator):
        pass

    monkeypatch.setattr(openspiel_episode, "AffineRolloutEvaluator", ChangedRollouts)
    assert identity("exact") != before  # the code that runs the search is part of what keys its moves
