"""sft_warmstart.py and experts.py: expert episodes in the env's conversation, masked SFT, PPO from the result."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyspiel
import pytest
import torch

import sft_warmstart
import train_ppo
from ppo_affine.config import ConfigError
from ppo_affine.seeds import derive_seed
from ppo_affine.batching import build_sequences
from ppo_affine.policy import adapter_weights_digest
from ppo_affine.envs.openspiel_text import strip_think
from ppo_affine.experts import Expert, ExpertUnavailable, expert_kind
from ppo_affine.prompts import PromptBuilder
from ppo_affine.warm_start import dagger, expert_play, sft
from ppo_affine.warm_start.config import (
    WarmStartConfig, parse_experts, parse_game_counts, parse_reason_games,
)
from ppo_affine.warm_start.expert_play import OpponentSetup, generate, plan_jobs, play_expert_episode
from ppo_affine.warm_start.relabel import read_played, relabel
from ppo_affine.warm_start.sft import conversations_to_episodes, train_sft

ROOT = Path(__file__).resolve().parent.parent


def plan(games, episodes, setup=OpponentSetup(), **options):
    """The expert games of a run with these options (CFR+ at 20 iterations: quick), on seed 0."""
    return plan_jobs(WarmStartConfig(games=games, episodes=episodes, **{"cfr_iterations": 20, **options}), 0, setup)


def jobs(game, n, **options):
    return plan([game], n, **options)


def test_expert_games_meet_the_opponent_budget_of_their_own_game():
    planned = plan(["liars_dice", "leduc_poker"], 1, OpponentSetup(simulations={"liars_dice": 30}), opponent="mcts")
    assert [(j.game, j.setup.budget(j.game)) for j in planned] == [("liars_dice", 30), ("leduc_poker", None)]
    assert [j.setup.budget(j.game) for j in jobs("liars_dice", 2, setup=OpponentSetup(simulations=40))] == [40, 40]


def test_each_game_gets_its_expert_and_unknown_ones_are_refused():
    assert [expert_kind(g) for g in ("leduc_poker", "goofspiel", "liars_dice", "gin_rummy", "hex")] == \
        ["cfr", "prize", "mcts", "simple_gin", "mcts"]
    assert expert_kind("goofspiel", {"goofspiel": "montecarlo"}) == "montecarlo"
    assert expert_kind("leduc_poker", {"goofspiel": "montecarlo"}) == "cfr"  # a choice concerns its game only
    assert expert_kind("leduc_poker", {"leduc_poker": "best_response"}) == "best_response"
    with pytest.raises(ExpertUnavailable, match="unknown goofspiel expert 'mcts'"):
        expert_kind("goofspiel", {"goofspiel": "mcts"})
    with pytest.raises(ExpertUnavailable, match="unknown game 'kuhn'"):
        expert_kind("kuhn")
    with pytest.raises(ExpertUnavailable, match="no expert plays blackjack"):
        expert_kind("blackjack")


def test_expert_episodes_are_the_envs_conversation_from_both_seats():
    planned = jobs("leduc_poker", 4)
    assert [j.seed % 2 for j in planned] == [0, 1, 0, 1]
    records = [play_expert_episode(job) for job in planned]
    for record in records:
        roles = [m["role"] for m in record["messages"]]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
        assert all(a != b for a, b in zip(roles[1:], roles[2:]))  # user and assistant alternate
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert all(r in {"0", "1", "2"} for r in replies)  # ID-only answers, never a retry prompt
        assert "attempt" not in " ".join(m["content"] for m in record["messages"] if m["role"] == "user").lower()
    assert {r["llm_player_id"] for r in records} == {0, 1}
    assert play_expert_episode(planned[0]) == records[0]  # reproducible from the seed


def test_goofspiel_prize_expert_bids_the_prize_card_in_every_variant():
    records = [play_expert_episode(job) for job in jobs("goofspiel", 5, config_ids=[0, 1, 2, 3, 4])]
    assert [r["expert"] for r in records] == ["prize"] * 5
    sizes = set()
    for record in records:
        messages = record["messages"]
        for before, reply in zip(messages[1::2], messages[2::2]):
            prize = int(re.search(r"Current point card: (\d+)", before["content"]).group(1))
            legal = re.findall(r"^(\d+) -> ", before["content"], re.M)
            assert reply["content"] == str(prize - 1) and reply["content"] in legal  # action k bids card k+1
        sizes.add(int(re.search(r"P0 hand: ([\d ]+)", messages[1]["content"]).group(1).split()[-1]))
    assert sizes == {8, 10, 12, 14, 16}


def test_goofspiel_prize_expert_takes_the_next_higher_card_when_the_prize_card_is_gone():
    game = pyspiel.load_game("goofspiel", {"players": 2, "num_cards": 8, "points_order": "random"})
    state = game.new_initial_state()
    state.apply_action(2)  # prize card 3
    state.apply_actions([4, 0])  # player 0 bids card 5 instead of 3
    state.apply_action(4)  # prize card 5: player 0's card 5 is gone
    expert = Expert("prize", game, player=0, seed=0, budget=0, cfr_iterations=0)
    assert expert.choose(state, {})[0] == 5  # card 6
    for bid, next_prize in ((5, 0), (6, 1), (7, 7)):  # cards 6, 7, 8 go too; prizes 1, 2, then 8
        state.apply_actions([bid, state.legal_actions(1)[0]])
        state.apply_action(next_prize)
    assert expert.choose(state, {})[0] == 3  # card 4, the highest left


def test_reasons_go_inside_think_tags_the_env_ignores():
    [record] = [play_expert_episode(job) for job in jobs("goofspiel", 1, expert_budget=2, reason=["goofspiel"])]
    reply = next(m["content"] for m in record["messages"] if m["role"] == "assistant")
    prize, action = re.fullmatch(r"<think>Current point card: (\d+)</think>(\d+)", reply).groups()
    assert int(action) == int(prize) - 1
    assert reply.startswith("<think>") and "</think>" in reply and reply.split("</think>")[1].isdigit()


@pytest.mark.slow
def test_experts_beat_a_random_opponent():
    for expert in ("prize", "montecarlo"):
        goofspiel = [play_expert_episode(job)["score"]
                     for job in jobs("goofspiel", 12, expert_budget=10, experts={"goofspiel": expert})]
        assert sum(goofspiel) / len(goofspiel) > 0.7, expert  # random play scores 0.5
    leduc = [play_expert_episode(job)["score"] for job in jobs("leduc_poker", 40, cfr_iterations=100)]
    assert sum(leduc) / len(leduc) > 0.5  # (chips won + 13) / 26: above 0.5 means chips won on average


def test_the_gin_rummy_expert_plays_whole_games_of_every_variant_legally():
    # config ids 0-8: hand sizes 7-9 x knock cards 10-8; the env refuses illegal replies, so a finished
    # game with as many replies as decisions was played legally
    for job in jobs("gin_rummy", 9, config_ids=list(range(9))):
        record = play_expert_episode(job)
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        feedback = [m["content"] for m in record["messages"] if "did not contain a valid action" in m["content"]]
        assert record["expert"] == "simple_gin" and len(replies) > 3 and not feedback
        assert 0.0 <= record["score"] <= 1.0


def test_experts_other_than_the_default_are_named_game_by_game():
    assert parse_experts("leduc_poker=best_response, gin_rummy=mcts") == {
        "leduc_poker": "best_response", "gin_rummy": "mcts"}
    assert parse_experts("") == {}
    with pytest.raises(ConfigError, match="--expert: expected GAME=KIND items separated by commas, got 'leduc_poker'"):
        parse_experts("leduc_poker")


def test_episodes_may_differ_game_by_game():
    assert parse_game_counts("64,gin_rummy=8", "--episodes") == {"*": 64, "gin_rummy": 8}
    planned = plan(["leduc_poker", "gin_rummy"], {"*": 3, "gin_rummy": 1})
    assert [j.game for j in planned] == ["leduc_poker"] * 3 + ["gin_rummy"]
    with pytest.raises(ConfigError, match="--episodes: expected a number, then GAME=N items"):
        parse_game_counts("64,gin_rummy", "--episodes")


def test_reasons_may_go_to_some_games_only():
    planned = plan(["goofspiel", "leduc_poker"], 1, reason=["goofspiel"])
    assert [(j.game, j.teacher.with_reason) for j in planned] == [("goofspiel", True), ("leduc_poker", False)]
    games = ["goofspiel", "leduc_poker"]
    assert parse_reason_games("*", games) == set(games)
    assert parse_reason_games("", games) == set()
    assert parse_reason_games(" goofspiel ", games) == {"goofspiel"}
    with pytest.raises(ConfigError, match=r"--reason: \['chess'\] are not in --games"):
        parse_reason_games("goofspiel,chess", games)


def test_the_options_text_and_its_parsed_values_make_the_same_config():
    text = WarmStartConfig.from_options(games="goofspiel, leduc_poker", episodes="64,goofspiel=8", config_ids="0,3",
                                        experts="", reason="goofspiel", openings="0,goofspiel=4", workers=2)
    parsed = WarmStartConfig(games=["goofspiel", "leduc_poker"], episodes={"*": 64, "goofspiel": 8}, config_ids=[0, 3],
                             experts={}, reason=["goofspiel"], openings={"*": 0, "goofspiel": 4}, workers=2)
    assert text == parsed and text.with_reason("goofspiel") and not text.with_reason("leduc_poker")
    assert WarmStartConfig(reason="*").with_reason("liars_dice") and WarmStartConfig(workers=None).workers >= 1


@pytest.mark.parametrize("options,expected", [
    ({"epochs": 0}, "--epochs must be at least 1, got 0."),
    ({"learning_rate": 0.0}, "--learning-rate must be > 0, got 0.0."),
    ({"opponent": "minimax"}, "--opponent: input should be 'random' or 'mcts', got 'minimax'."),
    ({"experts": "goofspiel=mcts"}, "--expert: unknown goofspiel expert 'mcts'"),
    ({"config_ids": "0,x"}, "--config-ids: expected comma-separated integers, got '0,x'."),
    ({"dagger_episodes": {"liars_dice": 4}}, "--dagger-episodes: needs a count for the games not named ('*')"),
])
def test_a_bad_option_value_is_one_line_naming_the_option(options, expected):
    with pytest.raises(ConfigError) as raised:
        WarmStartConfig.from_options(**options)
    assert str(raised.value).startswith(expected) and "\n" not in str(raised.value)


def test_generation_on_several_processes_matches_one_process(tmp_path):
    planned = jobs("liars_dice", 3, expert_budget=5) + jobs("leduc_poker", 2)
    parallel = generate(planned, workers=2, path=tmp_path / "data.jsonl")
    assert parallel == [play_expert_episode(job) for job in planned]
    assert [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()] == parallel


def test_conversations_become_rollout_sequences_with_only_the_replies_trained(tiny_policy):
    records = [play_expert_episode(job) for job in jobs("leduc_poker", 2)]
    builder = PromptBuilder(tiny_policy.tokenizer, 8192)
    eos = tiny_policy.tokenizer.eos_token_id
    episodes = conversations_to_episodes(records, builder, "full", {eos})
    for record, episode, sequence in zip(records, episodes, build_sequences(episodes)):
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert len(episode.sequences) == 1 and [t.response_text for t in episode.turns] == replies
        trained = [sequence.input_ids[start:end] for start, end in sequence.spans]
        assert trained == [builder.tokenize(r) + [eos] for r in replies]
        first_prompt = builder.encode(record["messages"][:2])
        assert sequence.input_ids[: len(first_prompt)] == first_prompt
    last = conversations_to_episodes(records, builder, "last", {eos})
    assert all(len(e.sequences) == len(e.turns) for e in last)  # a fresh prompt per decision


def test_reasoned_replies_are_trained_whole_but_later_prompts_show_them_as_validators_keep_them(tiny_policy):
    [record] = [play_expert_episode(job) for job in jobs("goofspiel", 1, expert_budget=2, reason=["goofspiel"])]
    builder = PromptBuilder(tiny_policy.tokenizer, 8192)
    eos = tiny_policy.tokenizer.eos_token_id
    [episode] = conversations_to_episodes([record], builder, "full", {eos})
    messages = record["messages"]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(replies) > 1 and all(r.startswith("<think>") for r in replies)
    assert len(episode.sequences) == len(replies)  # a reasoned reply cannot continue the sequence
    for i, turn in enumerate(episode.turns):
        at = [j for j, m in enumerate(messages) if m["role"] == "assistant"][i]
        shown = [{**m, "content": strip_think(m["content"])} if m["role"] == "assistant" else m
                 for m in messages[:at]]
        assert episode.prompt_ids(turn) == builder.encode(shown)
        assert turn.response_ids == builder.tokenize(replies[i]) + [eos]


def test_explored_moves_stay_in_the_conversation_but_only_the_experts_replies_are_trained(tiny_policy):
    planned = jobs("goofspiel", 4, expert_budget=2, reason=["goofspiel"], explore=0.5)
    records = [play_expert_episode(job) for job in planned]
    assert records == [play_expert_episode(job) for job in planned]  # seeded: the same moves again
    assert all(r["explored_replies"] for r in records)
    # the expert answers from states its own games never reach: the prize's matching card was bid already
    assert any("is gone" in m["content"] for r in records for m in r["messages"] if m["role"] == "assistant")
    builder = PromptBuilder(tiny_policy.tokenizer, 8192)
    episodes = conversations_to_episodes(records, builder, "full", {tiny_policy.tokenizer.eos_token_id})
    for record, episode in zip(records, episodes):
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        explored = set(record["explored_replies"])
        assert all(replies[i].isdigit() for i in explored)  # a random legal ID, no reason
        assert [t.response_text for t in episode.turns] == [r for i, r in enumerate(replies) if i not in explored]
    assert all(not r["explored_replies"] for r in (play_expert_episode(job)
                                                   for job in jobs("goofspiel", 2, expert_budget=2)))


def test_openings_are_expert_games_cut_after_the_experts_first_reply(tiny_policy):
    from ppo_affine.experts import true_bid_choice

    planned = plan(["liars_dice", "leduc_poker"], 1, experts={"liars_dice": "true_bids"}, explore=0.3,
                   openings={"*": 0, "liars_dice": 4})
    whole, openings = planned[:2], planned[2:]
    assert [(j.game, j.max_replies, j.explore) for j in whole] == [("liars_dice", None, 0.3), ("leduc_poker", None, 0.3)]
    assert [(j.game, j.max_replies, j.explore) for j in openings] == [("liars_dice", 1, 0.0)] * 4
    assert [j.seed % 2 for j in openings] == [0, 1, 0, 1] and whole[0].seed not in {j.seed for j in openings}
    records = [play_expert_episode(job) for job in openings]
    assert records == [play_expert_episode(job) for job in openings]  # seeded
    for record in records:
        assert [m["role"] for m in record["messages"]][-1] == "assistant"
        assert [m["role"] for m in record["messages"]].count("assistant") == 1
        assert record["score"] is None and record["max_replies"] == 1 and not record["explored_replies"]
    first_seat = [r for r in records if r["llm_player_id"] == 0]
    for record in first_seat:  # the opening bid is the teacher's, from the dice the prompt shows
        dice = re.search(r"Your dice: \[([\d, ]+)\]", record["messages"][1]["content"]).group(1)
        expected, _ = true_bid_choice([int(d) for d in dice.split(",")], [], list(range(60)))
        assert record["messages"][-1]["content"] == str(expected)
    # the second seat answers the opponent's opening: its prompt shows that bid
    assert all("No bid yet" not in r["messages"][1]["content"] for r in records if r["llm_player_id"] == 1)
    episodes = conversations_to_episodes(records, PromptBuilder(tiny_policy.tokenizer, 8192), "full",
                                         {tiny_policy.tokenizer.eos_token_id})
    assert [len(e.turns) for e in episodes] == [1] * 4 and all(e.score == 0.0 for e in episodes)


def _played_goofspiel(seed, replies):
    """A game 'a model' played against the random opponent: `replies(turn, legal, expert_move)` gives each reply."""
    import uuid

    from ppo_affine.envs.openspiel_episode import Episode
    from ppo_affine.envs.tasks import game_task_id

    episode = Episode(uuid.uuid4().hex, task_id=game_task_id("goofspiel", 0), seed=seed, opponent="random",
                      observation_format="evaluate", max_parse_attempts=3, mcts_simulations=None)
    expert = Expert("prize", episode.game, episode.player, seed, 0, 0)
    result = episode.start()
    messages = [{"role": "system", "content": episode.system_prompt},
                {"role": "user", "content": result["observation"]}]
    turn = 0
    while not result["done"]:
        expert_move, _ = expert.choose(episode.state, dict(zip(episode.legal, episode.labels)))
        messages.append({"role": "assistant", "content": replies(turn, episode.legal, expert_move)})
        result = episode.step(messages[-1]["content"])
        if not result["done"]:
            messages.append({"role": "user", "content": result["observation"]})
        turn += 1
    return {"model": "student", "game": "goofspiel", "task_id": episode.task_id, "seed": seed, "opponent": "random",
            "score": episode.score, "error": None, "conversation": messages}


def _teachers(**options):
    """The options relabelling reads: each game's default teacher (CFR+ at 20 iterations), one process."""
    return WarmStartConfig(cfr_iterations=20, workers=1, **options)


def test_relabelled_games_train_the_experts_move_at_every_state_the_model_reached(tmp_path, tiny_policy):
    # the model misses the expert's move on turns 1 and 3 and answers turn 5 with prose the env asks again about
    def replies(turn, legal, expert_move):
        if turn in (1, 3):
            return str(next(a for a in legal if a != expert_move))
        return "I bid high" if turn == 5 else str(expert_move)

    played = _played_goofspiel(4, replies)
    played_replies = [m["content"] for m in played["conversation"] if m["role"] == "assistant"]
    records = relabel([{**played, "source": "games.jsonl line 1"}], _teachers(),
                      OpponentSetup(cache_dir="~/.cache/ppo-affine"), tmp_path / "relabelled.jsonl")
    assert [json.loads(line) for line in (tmp_path / "relabelled.jsonl").read_text().splitlines()] == records
    *missed, whole = records
    assert whole["explored_replies"] == [1, 3, 5] and whole["score"] == played["score"]
    # the game as played: its prompts, the model's own moves where it missed (context), the expert's elsewhere
    assert whole["messages"] == played["conversation"]
    assert [r["max_replies"] for r in missed] == [2, 4, 6]
    for record in missed:  # cut after the expert's answer, from the conversation the model's play led to
        cut = record["max_replies"]
        assert record["messages"][:-1] == whole["messages"][:len(record["messages"]) - 1]
        assert record["messages"][-1]["role"] == "assistant" and record["messages"][-1]["content"].isdigit()
        assert record["messages"][-1]["content"] != played_replies[cut - 1]
        assert record["explored_replies"] == list(range(cut - 1)) and record["score"] is None
    # turn 5's prose and turn 6 answer the same decision: the expert's move both times
    assert missed[2]["messages"][-1]["content"] == played_replies[6]
    episodes = conversations_to_episodes(records, PromptBuilder(tiny_policy.tokenizer, 8192), "full",
                                         {tiny_policy.tokenizer.eos_token_id})
    trained = [t.response_text for e in episodes for t in e.turns]
    assert len(trained) == len(played_replies)  # every turn once: the expert's move, never the model's miss
    assert "I bid high" not in trained and trained[:3] == [r["messages"][-1]["content"] for r in missed]
    # only the misses: the records cut after the expert's answers
    assert relabel([{**played, "source": "games.jsonl line 1"}], _teachers(relabel_missed_only=True),
                   OpponentSetup(cache_dir="~/.cache/ppo-affine"), None) == missed


def test_a_conversation_in_both_sets_trains_once():
    """--data X --dagger-data X: --dagger-data's records less those the SFT trained on; equal dicts with their keys
    in another order are the same record, and a repeat within one file stays."""
    a = {"task_id": 1, "seed": 2, "messages": [{"role": "user", "content": "x"}]}
    b = {"seed": 2, "task_id": 1, "messages": [{"role": "user", "content": "y"}]}
    reordered = {"messages": a["messages"], "seed": 2, "task_id": 1}
    assert dagger.records_not_in([a, b, reordered, b], [a]) == [b, b]
    assert dagger.records_not_in([a], []) == [a] and dagger.records_not_in([], [a]) == []


def test_relabelling_refuses_a_game_that_replays_differently_or_a_file_without_games(tmp_path):
    played = _played_goofspiel(2, lambda turn, legal, expert_move: str(expert_move))
    teacher = {"model": "expert", "game": "goofspiel", "task_id": played["task_id"], "seed": 3, "score": 1.0}
    path = tmp_path / "eval-mcts.jsonl"
    path.write_text(json.dumps(played) + "\n" + json.dumps(teacher) + "\n")
    assert [g["source"] for g in read_played(str(path), "mcts")] == [f"{path} line 1"]  # no conversation: a teacher's
    assert read_played(f"{path}:student", "mcts")[0]["opponent"] == "random"
    with pytest.raises(ConfigError, match=r"no finished game with a conversation of model 'sft' in it"):
        read_played(f"{path}:sft", "mcts")
    path.write_text(json.dumps(played) + "\n[1, 2]\n")
    with pytest.raises(ConfigError, match=r"eval-mcts.jsonl line 2: expected an episode record with 'task_id'"):
        read_played(str(path), "mcts")
    altered = {**played, "seed": played["seed"] + 2}  # another deal and opponent: the prompts differ
    with pytest.raises(ConfigError, match=r"games.jsonl line 7: the replayed game differs from the recorded one"):
        relabel([{**altered, "source": "games.jsonl line 7"}], _teachers(), OpponentSetup(cache_dir="~"), None)
    with pytest.raises(ConfigError, match=r"line 7: no expert plays blackjack"):
        relabel([{**played, "game": "blackjack", "source": "games.jsonl line 7"}], _teachers(),
                OpponentSetup(cache_dir="~"), None)


@pytest.mark.parametrize("held_out", ["validator", "tuning", "confirmation"])
def test_games_on_evaluation_seeds_are_refused_as_training_input(tmp_path, held_out):
    from ppo_affine.envs.tasks import EVALUATION_BLOCKS, paired_seed, validator_seed
    from ppo_affine.warm_start.sft import read_records

    played = _played_goofspiel(2, lambda turn, legal, expert_move: str(expert_move))
    seed = (validator_seed("game", played["task_id"]) if held_out == "validator"
            else paired_seed(EVALUATION_BLOCKS[held_out], "goofspiel", 37))  # either block of bench/learning.py
    path = tmp_path / "eval-mcts.jsonl"
    path.write_text(json.dumps(played) + "\n" + json.dumps({**played, "seed": seed}) + "\n")
    with pytest.raises(ConfigError, match=rf"eval-mcts.jsonl line 2: goofspiel task {played['task_id']} seed {seed} "
                                          r"is an evaluation seed"):
        read_played(str(path), "mcts")
    data = tmp_path / "sft_data.jsonl"  # the same for SFT conversations (--data, --dagger-data)
    data.write_text(json.dumps({"messages": [], "game": "goofspiel", "task_id": played["task_id"], "seed": seed}))
    with pytest.raises(ConfigError, match=r"sft_data.jsonl line 1: .* is an evaluation seed"):
        read_records(data, "--data")
    path.write_text(json.dumps(played) + "\n")  # a game on a seed of its own is kept
    assert len(read_played(str(path), "mcts")) == 1


def test_sft_raises_the_likelihood_of_the_expert_replies(tiny_policy):
    records = [play_expert_episode(job) for job in jobs("leduc_poker", 6)]
    episodes = conversations_to_episodes(records, PromptBuilder(tiny_policy.tokenizer, 8192), "full",
                                         {tiny_policy.tokenizer.eos_token_id})
    history = train_sft(tiny_policy, build_sequences(episodes), epochs=4, learning_rate=1e-2, batch_size=3,
                        token_budget=8192, seed=0)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]


def _cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "sft_warmstart.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.mark.parametrize("args,expected", [
    (["--games", "kuhn_poker"], "--games: unknown game 'kuhn_poker'"),
    (["--games", "blackjack"], "--games: no expert plays blackjack"),
    (["--episodes", "0"], "--episodes must be at least 1"),
    (["--relabel", "runs/no-such-eval.jsonl"], "--relabel runs/no-such-eval.jsonl: cannot read played games"),
    (["--explore", "1.5"], "--explore must be in [0, 1)"),
    (["--openings", "-1"], "--openings must be at least 0"),
    (["--openings", "8,liars_dice"], "--openings: expected a number, then GAME=N items"),
    (["--init-adapter", "runs/no-such-sft/checkpoint-9"], "runs/no-such-sft/checkpoint-9 is neither a checkpoint folder"),
    (["--dagger-rounds", "-1"], "--dagger-rounds must be at least 0"),
    (["--dagger-rounds", "1", "--dagger-episodes", "8,leduc_poker=0"], "--dagger-episodes must be at least 1"),
    (["--dagger-rounds", "1", "--dagger-episodes", "many"], "--dagger-episodes: expected a number"),
    # DAgger rounds with no expert game before them need an adapter to start from
    (["--dagger-rounds", "1", "--episodes", "0"], "--episodes must be at least 1"),
    (["--dagger-data", "runs/sft/sft_data.jsonl"], "--dagger-data trains in every --dagger-rounds round, but"),
    (["--dagger-aggregate", "all"], "--dagger-aggregate all keeps earlier rounds' games, but --dagger-rounds is 0"),
    (["--dagger-rounds", "1", "--dagger-data", "runs/no-such/sft_data.jsonl"],
     "--dagger-data runs/no-such/sft_data.jsonl: cannot read conversations"),
])
def test_bad_options_are_a_one_line_error_naming_the_option(args, expected):
    result = _cli("--preset", "cpu", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.slow
def test_warm_start_checkpoint_starts_a_ppo_run(tiny_model_dir, tmp_path):
    from test_train import tiny_args

    sets = ["--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.use_4bit=false",
            "--set", "model.dtype=float32", "--set", "run.device=cpu", "--set", "model.gradient_checkpointing=false"]
    assert sft_warmstart.main(["--games", "leduc_poker,goofspiel", "--episodes", "4", "--expert-budget", "2",
                               "--cfr-iterations", "20", "--epochs", "1", "--workers", "1",
                               "--output-dir", str(tmp_path / "sft"), *sets]) == 0
    [checkpoint] = (tmp_path / "sft" / "checkpoints").glob("checkpoint-*")
    from safetensors.torch import load_file

    assert len((tmp_path / "sft" / "sft_data.jsonl").read_text().splitlines()) == 8
    run = tiny_args(tiny_model_dir, tmp_path / "ppo", "--max-steps", "1")
    assert train_ppo.main(run + ["--init-adapter", str(checkpoint)]) == 0
    sft = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for k, t in sft.items() if "lora_B" in k)  # SFT moved the adapter
    # more epochs on the same data go on from that adapter (a learning rate too small to move it shows where
    # they start), not from a fresh LoRA whose B matrices are zero
    assert sft_warmstart.main(["--data", str(tmp_path / "sft" / "sft_data.jsonl"), "--init-adapter", str(checkpoint),
                               "--epochs", "1", "--learning-rate", "1e-12", "--output-dir", str(tmp_path / "more"),
                               *sets]) == 0
    [more] = (tmp_path / "more" / "checkpoints").glob("checkpoint-*")
    continued = load_file(str(more / "adapter" / "adapter_model.safetensors"))
    assert continued.keys() == sft.keys() and all(torch.allclose(continued[k], sft[k], atol=1e-6) for k in sft)
    # DAgger: games the model played, relabelled by the expert, are the only data with --episodes 0
    played = _played_goofspiel(6, lambda turn, legal, expert_move: str(min(legal)))
    (tmp_path / "played.jsonl").write_text(json.dumps(played) + "\n")
    assert sft_warmstart.main(["--games", "goofspiel", "--episodes", "0", "--relabel", str(tmp_path / "played.jsonl"),
                               "--init-adapter", str(checkpoint), "--epochs", "1", "--workers", "1",
                               "--output-dir", str(tmp_path / "dagger"), *sets]) == 0
    relabelled = [json.loads(line) for line in (tmp_path / "dagger" / "relabelled.jsonl").read_text().splitlines()]
    assert relabelled and all(r["relabelled"] and r["expert"] == "prize" for r in relabelled)
    assert (tmp_path / "dagger" / "sft_data.jsonl").read_text() == ""  # no expert game of its own
    assert list((tmp_path / "dagger" / "checkpoints").glob("checkpoint-*"))
    # the KL anchor is the SFT adapter: the first rollout policy equals it, so its KL is 0
    [first] = [json.loads(line) for line in (tmp_path / "ppo" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert first["reward/kl_per_token"] == pytest.approx(0.0, abs=1e-6)
    ppo_checkpoint = tmp_path / "ppo" / "t" / "checkpoints" / "checkpoint-1"
    reference = load_file(str(ppo_checkpoint / "reference_adapter" / "adapter_model.safetensors"))
    assert reference.keys() == sft.keys() and all(torch.equal(reference[k], sft[k]) for k in sft)
    assert not (ppo_checkpoint / "adapter" / "reference").exists()  # vLLM's folder holds the trained adapter only
    # anchored to the base model instead, the same start is far from its reference
    base_run = tiny_args(tiny_model_dir, tmp_path / "base-anchor", "--max-steps", "1", "--set", "ppo.kl_reference=base")
    assert train_ppo.main(base_run + ["--init-adapter", str(checkpoint)]) == 0
    [anchored] = [json.loads(line) for line in
                  (tmp_path / "base-anchor" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert abs(anchored["reward/kl_per_token"]) > 1e-4  # k1 is signed; tiny SFT moves little
    assert not (tmp_path / "base-anchor" / "t" / "checkpoints" / "checkpoint-1" / "reference_adapter").exists()
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path / "other", "--resume", str(checkpoint))) == 2


@pytest.mark.slow
def test_dagger_rounds_keep_the_sfts_data_and_train_a_conversation_given_twice_once(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """--data X --relabel P --dagger-data X --dagger-rounds 1: the SFT trains on X and P's relabelled records, the
    round on its own records, X and P's again (X once), in that order; dagger.jsonl counts X and P's apart."""
    sets = ["--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.use_4bit=false",
            "--set", "model.dtype=float32", "--set", "run.device=cpu", "--set", "model.gradient_checkpointing=false",
            "--set", "generation.backend=local", "--set", "generation.max_new_tokens=4"]
    expert = _played_goofspiel(3, lambda turn, legal, expert_move: str(expert_move))
    data = [{"game": "goofspiel", "task_id": expert["task_id"], "seed": 3, "score": expert["score"],
             "messages": expert["conversation"]}]
    (tmp_path / "data.jsonl").write_text(json.dumps(data[0]) + "\n")
    (tmp_path / "played.jsonl").write_text(json.dumps(_played_goofspiel(6, lambda t, legal, e: str(min(legal)))) + "\n")
    trained, real_fine_tune = [], sft.fine_tune
    monkeypatch.setattr(sft, "fine_tune", lambda config, records, *rest: trained.append(records)
                        or real_fine_tune(config, records, *rest))
    out = tmp_path / "sft"
    assert sft_warmstart.main(["--games", "goofspiel", "--data", str(tmp_path / "data.jsonl"), "--relabel",
                               str(tmp_path / "played.jsonl"), "--dagger-data", str(tmp_path / "data.jsonl"),
                               "--dagger-rounds", "1", "--dagger-episodes", "2", "--epochs", "1", "--workers", "1",
                               "--output-dir", str(out), *sets]) == 0
    given, round_one = ([json.loads(line) for line in (folder / "relabelled.jsonl").read_text().splitlines()]
                        for folder in (out, out / "dagger-1"))
    assert given and round_one
    assert trained == [data + given, round_one + data + given]
    [entry] = [json.loads(line) for line in (out / "dagger.jsonl").read_text().splitlines()]
    assert (entry["records"], entry["expert_records"], entry["relabelled_records"]) == (len(round_one), 1, len(given))


@pytest.mark.slow
def test_dagger_rounds_train_each_new_adapter_on_its_own_games_relabelled(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    sets = ["--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.use_4bit=false",
            "--set", "model.dtype=float32", "--set", "run.device=cpu", "--set", "model.gradient_checkpointing=false",
            "--set", "generation.backend=local", "--set", "generation.max_new_tokens=4"]
    common = ["--games", "goofspiel", "--epochs", "1", "--workers", "1", "--dagger-episodes", "3", *sets]
    out = tmp_path / "sft"
    trained, real_fine_tune = [], sft.fine_tune

    def recording_fine_tune(config, records, *rest):
        trained.append(records)
        return real_fine_tune(config, records, *rest)

    monkeypatch.setattr(sft, "fine_tune", recording_fine_tune)
    assert sft_warmstart.main(["--episodes", "2", "--dagger-rounds", "2", "--output-dir", str(out), *common]) == 0
    expert_games = [json.loads(line) for line in (out / "sft_data.jsonl").read_text().splitlines()]
    assert len(trained) == 3 and trained[0] == expert_games  # the SFT, then one per round
    rounds = [json.loads(line) for line in (out / "dagger.jsonl").read_text().splitlines()]
    [first_sft] = (out / "checkpoints").glob("checkpoint-*")
    assert [r["round"] for r in rounds] == [1, 2]
    assert rounds[0]["adapter"] == str(first_sft) and rounds[1]["adapter"] == rounds[0]["checkpoint"]
    seeds_by_round = []
    for entry in rounds:
        folder = out / f"dagger-{entry['round']}"
        played = [json.loads(line) for line in (folder / "played.jsonl").read_text().splitlines()]
        relabelled = [json.loads(line) for line in (folder / "relabelled.jsonl").read_text().splitlines()]
        assert len(played) == 3 and {p["game"] for p in played} == {"goofspiel"}
        assert {p["seed"] % 2 for p in played} == {0, 1}  # both seats, as evaluate.py plays
        seeds_by_round.append({p["seed"] for p in played})
        assert relabelled and all(r["relabelled"] and r["expert"] == "prize" for r in relabelled)
        turns = sum(m["role"] == "assistant" for p in played for m in p["conversation"])
        missed = sum(r.get("max_replies") is not None for r in relabelled)
        stats = entry["by_game"]["goofspiel"]
        assert (stats["games"], stats["turns"], stats["expert_moves"]) == (3, turns, turns - missed)
        assert stats["mean_score"] == pytest.approx(sum(p["score"] for p in played) / 3)
        assert entry["records"] == len(relabelled)
        # aggregated DAgger: each round trains on its relabelled games and on the SFT's expert games again, by
        # default not on an earlier round's relabelled games
        assert trained[entry["round"]] == relabelled + expert_games
        assert (entry["expert_records"], entry["relabelled_records"]) == (2, 0)
        # each round's SFT went on from the adapter that played its games, and moved it
        before = load_file(str(Path(entry["adapter"]) / "adapter" / "adapter_model.safetensors"))
        after = load_file(str(Path(entry["checkpoint"]) / "adapter" / "adapter_model.safetensors"))
        assert after.keys() == before.keys() and any(not torch.equal(after[k], before[k]) for k in before)
        assert Path(entry["checkpoint"]).parent == folder / "checkpoints"
    assert not seeds_by_round[0] & seeds_by_round[1]  # each round meets states on deals of its own
    # going on from (a copy of) the last round's adapter alone (no expert game first), into the same folder: new
    # deals, and the log holds this run's rounds only; --dagger-data's expert games train beside the round's
    # relabelled ones. The deals follow the adapter's weights, not where it lies. With --dagger-aggregate all the
    # second round also trains on the first round's relabelled games.
    moved = tmp_path / "elsewhere" / "checkpoint"
    shutil.copytree(rounds[1]["checkpoint"], moved)
    digest = adapter_weights_digest(rounds[1]["checkpoint"])  # this run's second round replaces that folder
    trained.clear()
    assert sft_warmstart.main(["--episodes", "0", "--init-adapter", str(moved), "--dagger-rounds", "2",
                               "--dagger-aggregate", "all", "--dagger-data", str(out / "sft_data.jsonl"),
                               "--output-dir", str(out), *common]) == 0
    again = [json.loads(line) for line in (out / "dagger.jsonl").read_text().splitlines()]
    assert [r["round"] for r in again] == [1, 2] and again[0]["adapter"] == str(moved)
    assert again[0]["seed"] not in {r["seed"] for r in rounds}
    train_config = torch.load(Path(again[0]["checkpoint"]) / "trainer_state.pt", weights_only=False)["config"]["train"]
    assert again[0]["seed"] == derive_seed(train_config["run"]["seed"], "dagger", 1, digest)
    first, second = ([json.loads(line) for line in (out / f"dagger-{n}" / "relabelled.jsonl").read_text().splitlines()]
                     for n in (1, 2))
    assert trained == [first + expert_games, second + expert_games + first]  # the rounds' SFTs
    assert [(r["expert_records"], r["relabelled_records"]) for r in again] == [(2, 0), (2, len(first))]
    options = torch.load(Path(again[1]["checkpoint"]) / "trainer_state.pt", weights_only=False)["sft"]
    assert options["dagger_data"] == str(out / "sft_data.jsonl") and options["dagger_aggregate"] == "all"
    assert not {"played", "dagger_records", "dagger_expert_records"} & set(options)  # loaded data stays out
    # a student that cannot play (no server to generate with) is a one-line configuration error
    assert sft_warmstart.main(["--episodes", "0", "--init-adapter", rounds[1]["checkpoint"], "--dagger-rounds", "1",
                               "--output-dir", str(tmp_path / "no-server"), *common, "--set", "generation.backend=vllm",
                               "--set", "env.vllm_url=http://127.0.0.1:9/v1"]) == 2


def test_worker_pools_spawn_fresh_processes_never_forks_of_a_process_holding_a_model(monkeypatch):
    import concurrent.futures

    from ppo_affine import opponent_model

    started = []

    class RecordingPool(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *args, mp_context=None, **kwargs):
            started.append(mp_context and mp_context.get_start_method())
            super().__init__(*args, mp_context=mp_context, **kwargs)

    monkeypatch.setattr(expert_play, "ProcessPoolExecutor", RecordingPool)
    monkeypatch.setattr(opponent_model, "ProcessPoolExecutor", RecordingPool)
    assert expert_play.run_jobs(abs, [-1, 2], 1, "numbers") == [1, 2]  # the expert games' and replays' pool
    frequencies = opponent_model.mcts_action_frequencies(pyspiel.load_game("kuhn_poker"), (2, 1), samples=1)
    assert len(frequencies) == 24 and started == ["spawn", "spawn"]


def test_the_mcts_expert_searches_as_the_game_table_allows():
    from open_spiel.python.algorithms import mcts

    gin_rummy = pyspiel.load_game("gin_rummy")  # open_spiel's C++ rollouts crash on some of its states
    assert isinstance(Expert("mcts", gin_rummy, 0, seed=0, budget=5, cfr_iterations=0).bot, mcts.MCTSBot)
    liars_dice = pyspiel.load_game("liars_dice")
    assert isinstance(Expert("mcts", liars_dice, 0, seed=0, budget=5, cfr_iterations=0).bot, pyspiel.MCTSBot)


@pytest.mark.slow
def test_the_mcts_expert_plays_a_whole_gin_rummy_game():
    [job] = jobs("gin_rummy", 1, expert_budget=2, experts={"gin_rummy": "mcts"})
    record = play_expert_episode(job)
    assert record["expert"] == "mcts" and 0.0 <= record["score"] <= 1.0


def test_a_teacher_aimed_at_the_mcts_warns_once_when_it_meets_another_opponent(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(sft_warmstart, "setup_logging", lambda: None)  # caplog keeps its handler
    monkeypatch.setattr(expert_play, "generate", lambda jobs, workers, path: [])
    with caplog.at_level("WARNING", logger=expert_play.__name__):
        assert sft_warmstart.main(["--games", "leduc_poker,liars_dice,goofspiel", "--episodes", "1",
                                   "--expert", "leduc_poker=best_response,liars_dice=true_bids",
                                   "--output-dir", str(tmp_path)]) == 0
        expert_play.warn_teachers_aimed_elsewhere(["leduc_poker"], {"leduc_poker": "best_response"}, "mcts")
        expert_play.warn_teachers_aimed_elsewhere(["leduc_poker", "goofspiel"], {}, "random")  # cfr, prize
    assert [r.getMessage() for r in caplog.records] == [
        "leduc_poker=best_response, liars_dice=true_bids: teachers aimed at the MCTS opponent meet the random one "
        "here, so their moves answer a player that is not there (the mcts opponent, or another teacher, fits)"]
