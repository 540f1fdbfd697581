"""curriculum.py: config validation, sampling, promotion, failure replay, exact save/load."""
import json
from collections import Counter

import pytest
from pydantic import ValidationError

from curriculum import Curriculum
from ppo_affine.curriculum_config import CurriculumConfig, default_curriculum
from ppo_affine.envs.tasks import Task, trace_level_of, trace_training_range
from ppo_affine.envs.trace_programs import repeats_a_held_out_program

GAMES_SOURCE = {"env": "openspiel", "games": ["goofspiel"], "config_ids": [0]}


def make_config(stages=None, **fields) -> CurriculumConfig:
    stages = stages or [{"name": "only", "tasks": [GAMES_SOURCE]}]
    return CurriculumConfig.model_validate({"stages": stages, **fields})


def two_stage_config(**fields) -> CurriculumConfig:
    return make_config(
        [
            {"name": "first", "tasks": [GAMES_SOURCE], "min_episodes": 5, "success_threshold": 0.75},
            {"name": "second", "tasks": [GAMES_SOURCE], "min_episodes": 1, "success_threshold": 0.5},
        ],
        window=4,
        **fields,
    )


def fresh(curriculum: Curriculum) -> Task:
    return Task(env="openspiel", task_id=0, seed=1, opponent="random", stage=curriculum.stage.name, replay=False)


def failed_task(seed: int, stage: str = "only") -> Task:
    return Task(env="openspiel", task_id=0, seed=seed, opponent="random", stage=stage, replay=False)


def buffer_entries(curriculum: Curriculum) -> list[tuple[int, float, int]]:
    """(seed, priority, successes) per buffer entry, oldest first."""
    return [(e["task"]["seed"], e["priority"], e["successes"]) for e in curriculum.state_dict()["buffer"]]


# ---------------------------------------------------------------- config validation
def validation_error(document) -> str:
    with pytest.raises(ValidationError) as error:
        CurriculumConfig.model_validate(document)
    return str(error.value)


def test_config_rejects_unknown_key():
    message = validation_error({"stages": [{"name": "a", "tasks": [GAMES_SOURCE]}], "windw": 10})
    assert "windw" in message and "Extra inputs are not permitted" in message


def test_config_rejects_unknown_game():
    message = validation_error({"stages": [{"name": "a", "tasks": [{"env": "openspiel", "games": ["chesss"]}]}]})
    assert "stages.0.tasks.0.games" in message and "chesss" in message


def test_config_rejects_games_and_ranges_together():
    source = {"env": "openspiel", "games": ["goofspiel"], "task_id_ranges": [[0, 10]]}
    message = validation_error({"stages": [{"name": "a", "tasks": [source]}]})
    assert "stages.0.tasks.0" in message and "exactly one of" in message and "'task_id_ranges'" in message


def test_config_rejects_source_without_tasks_kind():
    message = validation_error({"stages": [{"name": "a", "tasks": [{"env": "openspiel"}]}]})
    assert "exactly one of" in message


def test_config_rejects_empty_stages():
    message = validation_error({"stages": []})
    assert "stages" in message and "at least 1 item" in message


def test_config_rejects_threshold_out_of_range():
    message = validation_error({"stages": [{"name": "a", "tasks": [GAMES_SOURCE], "success_threshold": 1.5}]})
    assert "stages.0.success_threshold" in message
    message = validation_error({"stages": [{"name": "a", "tasks": [GAMES_SOURCE], "success_threshold": 0}]})
    assert "stages.0.success_threshold" in message


def test_config_rejects_duplicate_stage_names():
    stage = {"name": "a", "tasks": [GAMES_SOURCE]}
    assert "repeated: ['a']" in validation_error({"stages": [stage, stage]})


def test_config_rejects_bad_range_level_and_config_ids():
    bad_range = {"env": "trace", "task_id_ranges": [[5, 5]]}
    assert "stages.0.tasks.0.task_id_ranges" in validation_error({"stages": [{"name": "a", "tasks": [bad_range]}]})
    bad_level = {"env": "trace", "trace_difficulty": [4]}
    assert "stages.0.tasks.0.trace_difficulty" in validation_error({"stages": [{"name": "a", "tasks": [bad_level]}]})
    stray_ids = {"env": "trace", "trace_difficulty": [1], "config_ids": [0]}
    assert "'config_ids' only applies" in validation_error({"stages": [{"name": "a", "tasks": [stray_ids]}]})


def test_config_rejects_nonpositive_weight_and_bad_buffer():
    source = {**GAMES_SOURCE, "weight": 0}
    assert "stages.0.tasks.0.weight" in validation_error({"stages": [{"name": "a", "tasks": [source]}]})
    document = {"stages": [{"name": "a", "tasks": [GAMES_SOURCE]}], "failure_buffer": {"replay_prob": 1.2}}
    assert "failure_buffer.replay_prob" in validation_error(document)


def test_default_curriculum_stages():
    config = default_curriculum()
    assert [s.name for s in config.stages] == ["easy", "medium", "hard"]
    assert [s.opponent for s in config.stages] == ["random", "random", "mcts"]
    easy_ids = {task.task_id for task in Curriculum(config, seed=0).sample(200)}
    # config id 0 of goofspiel, liars_dice, leduc_poker, gin_rummy (game index * 100_000_000)
    assert easy_ids == {0, 100_000_000, 200_000_000, 300_000_000}


def test_default_hard_stage_is_validator_distribution():
    config = default_curriculum()
    hard_only = CurriculumConfig(stages=[config.stages[2]])
    tasks = Curriculum(hard_only, seed=0).sample(400)
    assert all(0 <= t.task_id < 400_000_000 and t.opponent == "mcts" for t in tasks)
    assert {t.task_id // 100_000_000 for t in tasks} == {0, 1, 2, 3}


# ---------------------------------------------------------------- sampling
def test_sampling_respects_source_weights():
    # weights 3 : 1 over 4000 draws: expected 3000 / 1000, binomial std ~27, bounds at ~5.5 std
    config = make_config([{"name": "s", "tasks": [
        {"env": "openspiel", "games": ["goofspiel"], "config_ids": [0], "weight": 3.0},
        {"env": "trace", "trace_difficulty": [1]},
    ]}])
    counts = Counter(task.env for task in Curriculum(config, seed=1).sample(4000))
    assert set(counts) == {"openspiel", "trace"}
    assert 2850 <= counts["openspiel"] <= 3150


def test_sampling_is_deterministic_for_a_seed():
    config = default_curriculum()
    assert Curriculum(config, seed=5).sample(20) == Curriculum(config, seed=5).sample(20)
    assert Curriculum(config, seed=5).sample(20) != Curriculum(config, seed=6).sample(20)


def test_game_task_ids_decode_to_requested_games_and_variants():
    # liars_dice is game 1, gin_rummy game 3; config ids 5 and 7
    config = make_config([{"name": "s", "tasks": [
        {"env": "openspiel", "games": ["liars_dice", "gin_rummy"], "config_ids": [5, 7]}]}])
    ids = {task.task_id for task in Curriculum(config, seed=2).sample(200)}
    assert ids == {100_000_005, 100_000_007, 300_000_005, 300_000_007}


def test_games_without_config_ids_draw_any_variant():
    config = make_config([{"name": "s", "tasks": [{"env": "openspiel", "games": ["leduc_poker"]}]}])
    ids = [task.task_id for task in Curriculum(config, seed=3).sample(50)]
    assert all(200_000_000 <= i < 300_000_000 for i in ids) and len(set(ids)) == 50


def test_seat_fixes_the_models_seat_in_every_game_of_the_source():
    # hearts has 4 players, liars_dice 2: the env seats the model at seed mod players (evaluate: (seed mod 2) mod it)
    for seat in (0, 1):
        config = make_config([{"name": "s", "tasks": [
            {"env": "openspiel", "games": ["liars_dice", "hearts"], "config_ids": [0], "seat": seat}]}])
        tasks = Curriculum(config, seed=5).sample(200)
        players = {100_000_000: 2, 800_000_000: 4}
        assert {t.task_id for t in tasks} == set(players)
        assert all(t.seed % players[t.task_id] == seat and (t.seed % 2) % players[t.task_id] == seat for t in tasks)
        assert len({t.seed for t in tasks}) == 200  # still fresh random seeds


def test_seat_without_games_or_beyond_the_players_is_rejected():
    trace = {"env": "trace", "trace_difficulty": [1], "seat": 0}
    assert "'seat' only applies together with 'games'" in validation_error({"stages": [{"name": "a", "tasks": [trace]}]})
    one_player = {"env": "openspiel", "games": ["liars_dice", "blackjack"], "seat": 1}
    message = validation_error({"stages": [{"name": "a", "tasks": [one_player]}]})
    assert "seat 1 does not exist in ['blackjack']" in message
    third = {"env": "openspiel", "games": ["hearts"], "seat": 2}
    assert "stages.0.tasks.0.seat" in validation_error({"stages": [{"name": "a", "tasks": [third]}]})


def test_trace_difficulty_maps_to_level_ranges_above_the_held_out_tasks():
    # level 1 = [0, 1_000_000), level 3 = [2_000_000, 3_000_000), level 0 = [3_000_000, 4_000_000); the first
    # 10 000 ids of each are held out for evaluation; trace tasks have no opponent
    config = make_config([{"name": "s", "tasks": [{"env": "trace", "trace_difficulty": [0, 1, 3]}]}])
    tasks = Curriculum(config, seed=4).sample(300)
    assert {t.task_id // 1_000_000 for t in tasks} == {0, 2, 3}
    assert all(t.task_id % 1_000_000 >= 10_000 for t in tasks)
    assert all(t.opponent is None and t.env == "trace" for t in tasks)


def test_trace_draws_pass_over_the_held_out_tasks_programs_under_other_ids():
    # level 0's one-snippet programs repeat: about 31 % of its training ids hold a held-out task's program
    config = make_config([{"name": "s", "tasks": [{"env": "trace", "trace_difficulty": [0]}]}])
    tasks = Curriculum(config, seed=4).sample(300)
    assert all(t.task_id % 1_000_000 >= 10_000 for t in tasks)
    assert not any(repeats_a_held_out_program(t.task_id) for t in tasks)


def test_task_id_ranges_are_uniform_over_their_union():
    # [10, 12) and [100, 101): ids 10, 11, 100 each with probability 1/3 -> ~1000 of 3000 (std ~26)
    config = make_config([{"name": "s", "tasks": [{"env": "trace", "task_id_ranges": [[10, 12], [100, 101]]}]}])
    counts = Counter(t.task_id for t in Curriculum(config, seed=5).sample(3000))
    assert set(counts) == {10, 11, 100}
    assert all(870 <= c <= 1130 for c in counts.values())


def test_source_opponent_overrides_stage_opponent():
    config = make_config([{"name": "s", "opponent": "random", "tasks": [{**GAMES_SOURCE, "opponent": "mcts"}]}])
    assert {t.opponent for t in Curriculum(config, seed=0).sample(10)} == {"mcts"}


def test_fresh_tasks_carry_stage_and_seed_range():
    tasks = Curriculum(make_config(), seed=0).sample(100)
    assert all(t.stage == "only" and not t.replay and 0 <= t.seed < 2**32 - 1 for t in tasks)
    assert len({t.seed for t in tasks}) == 100


def test_is_playable_rejects_ids():
    config = make_config([{"name": "s", "tasks": [{"env": "trace", "task_id_ranges": [[0, 10]]}]}])
    calls = []

    def even_only(env, task_id):
        calls.append(env)
        return task_id % 2 == 0

    ids = {t.task_id for t in Curriculum(config, seed=0, is_playable=even_only).sample(200)}
    assert ids == {0, 2, 4, 6, 8}
    assert set(calls) == {"trace"}


def test_never_playable_source_raises_clear_error():
    curriculum = Curriculum(make_config(), seed=0, is_playable=lambda env, task_id: False)
    with pytest.raises(RuntimeError, match="stage 'only'.*env 'openspiel'.*not playable"):
        curriculum.sample(1)


def test_sample_groups_repeat_each_task():
    tasks = Curriculum(default_curriculum(), seed=0).sample_groups(3, 4)
    assert len(tasks) == 12
    groups = [tasks[i:i + 4] for i in range(0, 12, 4)]
    assert all(len(set(group)) == 1 for group in groups)
    assert len({group[0].seed for group in groups}) == 3


# ---------------------------------------------------------------- promotion
def test_no_promotion_before_min_episodes():
    curriculum = Curriculum(two_stage_config(), seed=0)
    # 4 successes: rolling 1.0 but min_episodes is 5
    assert [curriculum.report(fresh(curriculum), 1.0, True) for _ in range(4)] == [False] * 4
    assert curriculum.stage_index == 0
    assert curriculum.report(fresh(curriculum), 1.0, True) is True
    assert curriculum.stage.name == "second"
    assert curriculum.promotions == [{"from_stage": "first", "to_stage": "second", "episode": 5, "stage_episodes": 5}]


def test_promotion_starts_the_new_stage_with_an_empty_window():
    curriculum = Curriculum(two_stage_config(), seed=0)
    for _ in range(5):
        curriculum.report(fresh(curriculum), 1.0, True)
    stats = curriculum.stats()
    assert stats["curriculum/stage_index"] == 1 and stats["curriculum/promotions"] == 1
    assert stats["curriculum/window_episodes"] == 0 and stats["curriculum/stage_episodes"] == 0
    curriculum.report(fresh(curriculum), 0.0, False)
    assert curriculum.stats()["curriculum/rolling_success"] == 0.0


def test_promotion_uses_rolling_window():
    curriculum = Curriculum(two_stage_config(), seed=0)
    outcomes = [False, False, False, True, True, True]
    promoted = [curriculum.report(fresh(curriculum), float(s), s) for s in outcomes]
    # after 5: window [F, F, T, T] = 0.5 < 0.75; after 6: window [F, T, T, T] = 0.75 -> promote
    assert promoted == [False, False, False, False, False, True]
    assert curriculum.stage_index == 1


def test_no_promotion_below_threshold():
    curriculum = Curriculum(two_stage_config(), seed=0)
    for i in range(40):
        success = i % 2 == 0  # rolling success 0.5 < 0.75
        assert curriculum.report(fresh(curriculum), float(success), success) is False
    assert curriculum.stage_index == 0
    assert curriculum.stats()["curriculum/rolling_success"] == 0.5


def test_last_stage_is_never_left():
    curriculum = Curriculum(make_config(), seed=0)
    assert not any(curriculum.report(fresh(curriculum), 1.0, True) for _ in range(300))
    assert curriculum.stage_index == 0


def test_score_metric_promotes_on_mean_score():
    # scores [0.5, 0.7, 0.9, 0.9, 0.75]: last 4 mean (0.7+0.9+0.9+0.75)/4 = 0.8125 >= 0.75, no success flags set
    curriculum = Curriculum(two_stage_config(success_metric="score"), seed=0)
    promoted = [curriculum.report(fresh(curriculum), s, False) for s in [0.5, 0.7, 0.9, 0.9, 0.75]]
    assert promoted == [False, False, False, False, True]


def test_replays_and_earlier_stage_episodes_do_not_count_for_promotion():
    curriculum = Curriculum(two_stage_config(), seed=0)
    replay = Task(env="openspiel", task_id=0, seed=9, opponent="random", stage="first", replay=True)
    for _ in range(10):
        assert curriculum.report(replay, 1.0, True) is False
    other_stage = Task(env="openspiel", task_id=0, seed=9, opponent="random", stage="second", replay=False)
    assert curriculum.report(other_stage, 1.0, True) is False
    stats = curriculum.stats()
    assert stats["curriculum/stage_episodes"] == 0 and stats["curriculum/replayed"] == 10
    assert stats["curriculum/episodes/second"] == 1


def trace_levels_config(review: float | None) -> CurriculumConfig:
    """Level 0 promoting after 2 successes, then level 1 with `review` (None: the field left out)."""
    second = {"name": "level-1", "tasks": [{"env": "trace", "trace_difficulty": [1]}]}
    return make_config(
        [
            {"name": "level-0", "tasks": [{"env": "trace", "trace_difficulty": [0]}], "min_episodes": 2,
             "success_threshold": 0.5},
            second if review is None else {**second, "review": review},
        ],
        window=2,
        failure_buffer={"replay_prob": 0.0},
    )


def promoted_curriculum(review: float) -> Curriculum:
    curriculum = Curriculum(trace_levels_config(review), seed=3)
    for task in curriculum.sample(2):
        curriculum.report(task, 1.0, True)
    assert curriculum.stage.name == "level-1"
    return curriculum


def test_review_draws_its_share_from_the_earlier_stage_under_that_stages_name():
    curriculum = promoted_curriculum(0.25)
    tasks = curriculum.sample(4000)
    reviewed = [t for t in tasks if t.stage == "level-0"]
    assert 0.22 < len(reviewed) / len(tasks) < 0.28
    # a reviewed task is the earlier stage's own kind of task: a level-0 id, never a held-out one
    assert all(trace_level_of(t.task_id) == 0 and t.task_id >= trace_training_range(0)[0] for t in reviewed)
    assert all(trace_level_of(t.task_id) == 1 for t in tasks if t.stage == "level-1")


def test_reviewed_episodes_count_for_their_stage_and_never_for_promotion():
    curriculum = promoted_curriculum(0.5)
    reviewed = next(t for t in curriculum.sample(50) if t.stage == "level-0")
    for _ in range(5):
        assert curriculum.report(reviewed, 1.0, True) is False
    stats = curriculum.stats()
    assert stats["curriculum/stage_episodes"] == 0 and stats["curriculum/window_episodes"] == 0
    assert stats["curriculum/episodes/level-0"] == 2 + 5 and stats["curriculum/success_rate/level-0"] == 1.0


def test_no_review_samples_exactly_as_before():
    # review 0 makes no extra random draw: the same tasks as a stage without the field
    without = Curriculum(trace_levels_config(0.0), seed=5)
    plain = Curriculum(trace_levels_config(None), seed=5)
    assert without.sample(20) == plain.sample(20)


def test_review_on_the_first_stage_is_a_config_error():
    message = validation_error({"stages": [{"name": "first", "tasks": [GAMES_SOURCE], "review": 0.3}]})
    assert "'first' is the first" in message and "review" in message
    assert "less than 1" in validation_error({"stages": [
        {"name": "a", "tasks": [GAMES_SOURCE]}, {"name": "b", "tasks": [GAMES_SOURCE], "review": 1.0}]})


def test_report_rejects_nan_score():
    curriculum = Curriculum(make_config(), seed=0)
    with pytest.raises(ValueError, match="score is NaN"):
        curriculum.report(fresh(curriculum), float("nan"), False)


def test_report_clips_score_to_unit_interval():
    # a raw reward of -1 counts as score 0 (priority 1.0), 1.5 as score 1 (rolling mean of scores 0.5)
    curriculum = Curriculum(make_config(success_metric="score"), seed=0)
    curriculum.report(failed_task(1), -1.0, False)
    curriculum.report(failed_task(2), 1.5, True)
    assert buffer_entries(curriculum) == [(1, 1.0, 0)]
    assert curriculum.stats()["curriculum/rolling_success"] == 0.5


# ---------------------------------------------------------------- failure buffer
def test_failures_enter_buffer_with_priority_and_update():
    curriculum = Curriculum(make_config(), seed=0)
    curriculum.report(failed_task(1), 0.25, False)
    curriculum.report(failed_task(2), 0.0, False)
    curriculum.report(failed_task(3), 1.0, True)  # successes never enter
    curriculum.report(failed_task(1), 0.5, False)  # same task again: priority 1 - 0.5
    assert buffer_entries(curriculum) == [(1, 0.5, 0), (2, 1.0, 0)]


def test_replay_follows_priority_order():
    # priorities 1.0, 0.5, 0.1 (scores 0, 0.5, 0.9) -> shares 1/1.6, 0.5/1.6, 0.1/1.6 of 1600 = 1000, 500, 100
    curriculum = Curriculum(make_config(failure_buffer={"replay_prob": 1.0}), seed=0)
    for seed, score in [(1, 0.0), (2, 0.5), (3, 0.9)]:
        curriculum.report(failed_task(seed), score, False)
    counts = Counter(t.seed for t in curriculum.sample(1600))
    assert 900 <= counts[1] <= 1100 and 410 <= counts[2] <= 590 and 55 <= counts[3] <= 145


def test_replayed_task_keeps_task_seed_and_opponent():
    curriculum = Curriculum(make_config(failure_buffer={"replay_prob": 1.0}), seed=0)
    original = Task(env="openspiel", task_id=100_000_003, seed=77, opponent="mcts", stage="only", replay=False)
    curriculum.report(original, 0.0, False)
    replay = curriculum.sample(1)[0]
    assert replay == Task(env="openspiel", task_id=100_000_003, seed=77, opponent="mcts", stage="only", replay=True)


def test_capacity_evicts_lowest_priority():
    curriculum = Curriculum(make_config(failure_buffer={"capacity": 2}), seed=0)
    curriculum.report(failed_task(1), 0.2, False)  # priority 0.8
    curriculum.report(failed_task(2), 0.6, False)  # priority 0.4
    curriculum.report(failed_task(3), 0.0, False)  # priority 1.0 -> evicts seed 2
    assert buffer_entries(curriculum) == [(1, 0.8, 0), (3, 1.0, 0)]
    curriculum.report(failed_task(4), 0.9, False)  # priority ~0.1, the lowest: not kept
    assert [seed for seed, _, _ in buffer_entries(curriculum)] == [1, 3]


def test_capacity_ties_evict_oldest():
    curriculum = Curriculum(make_config(failure_buffer={"capacity": 2}), seed=0)
    for seed in (1, 2, 3):
        curriculum.report(failed_task(seed), 0.5, False)
    assert [seed for seed, _, _ in buffer_entries(curriculum)] == [2, 3]


def test_replay_probability_is_about_configured():
    # replay_prob 0.3 with a non-empty buffer: 2000 draws -> ~600 replays (std ~20)
    curriculum = Curriculum(make_config(), seed=0)
    curriculum.report(failed_task(1), 0.0, False)
    replays = sum(t.replay for t in curriculum.sample(2000))
    assert 540 <= replays <= 660


def test_empty_buffer_never_replays():
    assert not any(t.replay for t in Curriculum(make_config(), seed=0).sample(200))


def test_task_retires_after_mastery_successful_replays():
    curriculum = Curriculum(make_config(failure_buffer={"mastery": 3, "replay_prob": 1.0}), seed=0)
    curriculum.report(failed_task(1), 0.0, False)
    curriculum.report(failed_task(1), 1.0, True)  # a fresh success does not count towards mastery
    replay = curriculum.sample(1)[0]
    curriculum.report(replay, 1.0, True)
    curriculum.report(replay, 0.3, False)  # a failed replay updates the priority, keeps the count
    assert buffer_entries(curriculum) == [(1, 0.7, 1)]
    curriculum.report(replay, 1.0, True)
    assert buffer_entries(curriculum) == [(1, 0.7, 2)]
    curriculum.report(replay, 1.0, True)
    assert buffer_entries(curriculum) == []
    stats = curriculum.stats()
    assert stats["curriculum/retired"] == 1 and stats["curriculum/buffer_size"] == 0
    assert stats["curriculum/replayed"] == 4


# ---------------------------------------------------------------- stats and state
def test_stats_are_plain_numbers():
    curriculum = Curriculum(two_stage_config(), seed=0)
    curriculum.report(fresh(curriculum), 1.0, True)
    curriculum.report(fresh(curriculum), 0.0, False)
    stats = curriculum.stats()
    assert all(type(v) in (int, float) for v in stats.values())
    assert stats["curriculum/episodes/first"] == 2 and stats["curriculum/success_rate/first"] == 0.5
    assert stats["curriculum/rolling_success"] == 0.5 and stats["curriculum/buffer_size"] == 1


def test_state_round_trip_continues_sampling_identically():
    config = two_stage_config(failure_buffer={"replay_prob": 0.5})
    original = Curriculum(config, seed=11)
    for i, task in enumerate(original.sample(12)):
        original.report(task, 0.0 if i % 3 else 1.0, i % 3 == 0)
    state = json.loads(json.dumps(original.state_dict()))
    restored = Curriculum(config, seed=999)
    restored.load_state_dict(state)
    assert restored.stats() == original.stats()
    continued = original.sample(30)
    assert restored.sample(30) == continued
    assert any(t.replay for t in continued) and any(not t.replay for t in continued)
    for task in continued:
        assert original.report(task, 1.0, True) == restored.report(task, 1.0, True)
    assert restored.state_dict() == original.state_dict()


def test_state_round_trip_after_promotion():
    config = two_stage_config()
    original = Curriculum(config, seed=0)
    for _ in range(5):
        original.report(fresh(original), 1.0, True)
    restored = Curriculum(config, seed=0)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.stage.name == "second" and restored.promotions == original.promotions


def test_load_rejects_unknown_stage():
    state = Curriculum(two_stage_config(), seed=0).state_dict()
    with pytest.raises(ValueError, match="stage 'first' is not among the configured stages"):
        Curriculum(make_config(), seed=0).load_state_dict(state)
