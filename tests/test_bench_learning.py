"""bench/learning.py: profiles, per-game MCTS budgets, and the table's paired differences to base and SFT."""
import importlib.util
import json
from pathlib import Path

import pytest

from ppo_affine.envs.opponent_moves import OpponentMoves

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_learning", ROOT / "bench" / "learning.py")
learning = importlib.util.module_from_spec(spec)
spec.loader.exec_module(learning)


def test_simulations_are_one_number_or_per_game():
    assert learning.parse_simulations("300") == 300
    assert learning.parse_simulations("liars_dice=300,leduc_poker=1000") == {"liars_dice": 300, "leduc_poker": 1000}


def test_the_validator_profile_plays_the_four_games_at_full_strength_and_flags_still_win():
    args = learning.parse_args(["--profile", "validator", "--steps", "12"])
    assert args.games.split(",") == ["leduc_poker", "liars_dice", "goofspiel", "gin_rummy"]
    assert (args.opponents, args.train_opponent, args.mcts_simulations) == ("mcts", "mcts", None)  # the game table's
    assert (args.steps, args.max_new_tokens, args.reason_games) == (12, 6, [])
    assert args.eval_counts == {"*": 32, "goofspiel": 16, "gin_rummy": 4}
    assert args.sft_counts == {"*": 48, "goofspiel": 16, "gin_rummy": 4}
    assert args.expert_choices == {"leduc_poker": "best_response", "liars_dice": "true_bids"}
    assert args.weights == {"gin_rummy": 0.05}
    assert learning.parse_args([]).steps == 4 and learning.parse_args(["--no-warm-start"]).steps == 10


def test_per_game_options_name_games_of_the_run():
    with pytest.raises(SystemExit):
        learning.parse_args(["--profile", "validator", "--games", "leduc_poker", "--game-weights", "chess=2"])
    with pytest.raises(SystemExit):
        learning.parse_args(["--eval-episodes", "48,gin_rummy"])


def test_gin_rummy_gets_room_for_its_whole_conversation_and_the_users_set_still_wins():
    args = learning.parse_args(["--profile", "validator", "--games", "leduc_poker,gin_rummy",
                                "--set", "generation.max_turns=80"])
    overrides = learning.run_overrides(args, ["leduc_poker", "gin_rummy"])
    settings = dict(item.split("=", 1) for item in overrides)  # a later item wins, as in load_config
    assert settings["generation.max_turns"] == "80" and settings["generation.max_prompt_tokens"] == "8186"
    assert settings["generation.max_new_tokens"] == "6" and settings["model.gradient_checkpointing"] == "true"
    leduc_only = dict(item.split("=", 1) for item in learning.run_overrides(args, ["leduc_poker"]))
    assert leduc_only["generation.max_prompt_tokens"] == "4096"


def test_a_profiles_per_game_defaults_follow_the_games_of_the_run():
    args = learning.parse_args(["--profile", "validator", "--games", "leduc_poker,liars_dice"])
    assert args.expert_choices == {"leduc_poker": "best_response", "liars_dice": "true_bids"}
    assert (args.reason_games, args.max_new_tokens) == ([], 6)  # no goofspiel: ID-only replies, 6 tokens
    assert args.weights == {}  # gin_rummy's share goes with gin_rummy
    assert learning.parse_args(["--profile", "validator", "--games", "leduc_poker"]).expert_choices == {
        "leduc_poker": "best_response"}


def test_train_seat_puts_ppo_in_one_seat_only(monkeypatch, tmp_path):
    args = learning.parse_args(["--profile", "validator", "--games", "liars_dice", "--train-seat", "0"])
    assert args.train_seat == 0 and learning.parse_args([]).train_seat is None
    seen = []
    monkeypatch.setattr(learning.train_ppo, "main", lambda argv: seen.append(argv) or 1)
    with pytest.raises(SystemExit, match="training failed"):
        learning.train(["liars_dice"], 2, tmp_path, [], None, "mcts", seat=args.train_seat)
    stages = json.loads(next(a for a in seen[0] if a.startswith("curriculum.stages="))[len("curriculum.stages="):])
    assert [source["seat"] for source in stages[0]["tasks"]] == [0]
    from ppo_affine.curriculum_config import CurriculumConfig
    CurriculumConfig.model_validate({"stages": stages})  # the loop's own config accepts it


def test_rows_not_in_this_run_are_refused():
    with pytest.raises(SystemExit):
        learning.parse_args(["--no-warm-start", "--models", "sft"])
    with pytest.raises(SystemExit):  # no PPO steps, no SFT+PPO row
        learning.parse_args(["--steps", "0", "--models", "sft,sft+ppo"])
    with pytest.raises(SystemExit):  # PPO without a warm start needs steps
        learning.parse_args(["--no-warm-start", "--steps", "0"])
    assert learning.parse_args(["--steps", "0"]).model_rows == ["base", "sft", "expert"]
    # rows that leave the PPO adapter out train none (the profile's 20 steps would be minutes for nothing) ...
    assert learning.parse_args(["--profile", "validator", "--models", "sft,expert"]).steps == 0
    with pytest.raises(SystemExit):  # ... and steps asked for with no row to play them are refused
        learning.parse_args(["--steps", "3", "--models", "sft,expert"])
    assert learning.parse_args(["--profile", "validator", "--models", "sft,sft+ppo"]).steps == 20
    with pytest.raises(SystemExit):
        learning.parse_args(["--sft-explore", "1"])
    with pytest.raises(SystemExit):  # DAgger rounds make a student: they need the warm start
        learning.parse_args(["--no-warm-start", "--sft-dagger-rounds", "1"])
    for dagger_data in (["--sft-dagger-data", "README.md"],  # no rounds to train in
                        ["--sft-dagger-aggregate", "all"],  # nor here
                        ["--sft-dagger-rounds", "1", "--sft-dagger-data", "README.md"],  # the SFT here keeps its own
                        ["--sft-dagger-rounds", "1", "--sft-checkpoint", "tests", "--sft-dagger-data", "README.md"]):
        with pytest.raises(SystemExit):  # (tests/ is no checkpoint folder either)
            learning.parse_args(dagger_data)


def test_inputs_inside_the_output_dir_are_refused_before_the_bench_clears_it(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "old" / "adapter").mkdir(parents=True)
    (tmp_path / "student" / "adapter").mkdir(parents=True)
    for folder in (out, tmp_path):
        (folder / "data.jsonl").write_text("{}\n")
    rounds = ["--sft-dagger-rounds", "1", "--output-dir", str(out)]
    for option, inputs in (("--sft-checkpoint", [str(out / "old"), str(tmp_path / "data.jsonl")]),
                           ("--sft-dagger-data", [str(tmp_path / "student"), str(out / "data.jsonl")])):
        with pytest.raises(SystemExit):
            learning.parse_args([*rounds, "--sft-checkpoint", inputs[0], "--sft-dagger-data", inputs[1]])
        assert f"{option} lies inside --output-dir" in capsys.readouterr().err
    args = learning.parse_args([*rounds, "--sft-checkpoint", str(tmp_path / "student"),
                                "--sft-dagger-data", str(tmp_path / "data.jsonl")])
    assert args.sft_dagger_data == tmp_path / "data.jsonl"


def test_a_folder_the_bench_did_not_make_is_refused_before_anything_runs_and_keeps_its_files(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    (runs / "my-run").mkdir(parents=True)
    (runs / "my-run" / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setattr(learning.sft_warmstart, "main", lambda argv: pytest.fail("the warm start ran"))
    with pytest.raises(SystemExit, match=r"--output-dir .*runs exists and was not made by this bench"):
        learning.main(["--output-dir", str(runs)])
    assert sorted(p.relative_to(runs).as_posix() for p in runs.rglob("*")) == ["my-run", "my-run/metrics.jsonl"]


def test_a_folder_the_bench_made_is_cleared_for_the_next_run_and_a_new_one_is_made(tmp_path):
    out = tmp_path / "bench"
    learning.claim_output_dir(out)  # a new folder
    (out / "eval-mcts.jsonl").write_text("{}\n")  # an earlier run's files
    learning.claim_output_dir(out)
    assert [p.name for p in out.iterdir()] == [learning.OUTPUT_MARKER]
    (tmp_path / "empty").mkdir()
    learning.claim_output_dir(tmp_path / "empty")  # an empty folder loses nothing
    assert (tmp_path / "empty" / learning.OUTPUT_MARKER).is_file()


def test_every_row_meets_the_opponent_and_cache_folder_the_run_is_configured_with(tmp_path, monkeypatch, capsys):
    """The models' rows (evaluate.py's env spec), the teachers' and the ceiling's jobs and the warm start all meet
    the exact search at the budget --set names, and the best response keeps its opponent model in model.cache_dir."""
    from ppo_affine.envs.tasks import game_name_of

    seen = {"sft": [], "rows": [], "jobs": []}

    def warm_start(argv):
        seen["sft"] = argv
        return 0

    def play(config, *args, **kwargs):
        seen["rows"].append(learning.game_env(config))
        return []

    def generate(jobs, workers, path):
        seen["jobs"] += jobs
        return [{"game": game_name_of(j.task_id), "task_id": j.task_id, "seed": j.seed, "llm_player_id": j.seed % 2,
                 "score": 0.5, "messages": []} for j in jobs]

    monkeypatch.setattr(learning.sft_warmstart, "main", warm_start)
    monkeypatch.setattr(learning, "play", play)
    monkeypatch.setattr(learning.expert_play, "generate", generate)
    out, cache = tmp_path / "bench", tmp_path / "cache"
    learning.main(["--profile", "ci", "--games", "leduc_poker,liars_dice", "--steps", "0", "--models", "base,sft,expert",
                   "--output-dir", str(out), "--set", "env.envs.openspiel.opponent_search=exact",
                   "--set", "env.envs.openspiel.mcts_simulations=7", "--set", f"model.cache_dir={cache}"])
    capsys.readouterr()
    assert "env.envs.openspiel.opponent_search=exact" in seen["sft"] and f"model.cache_dir={cache}" in seen["sft"]
    assert [(row.opponent_search, row.mcts_simulations) for row in seen["rows"]] == [("exact", 7)]
    # liars_dice's teacher, leduc_poker's (cfr) and the ceiling's best response, on the same two seeds each
    assert sorted((j.game, j.teacher.kind) for j in seen["jobs"]) == [
        ("leduc_poker", "best_response")] * 2 + [("leduc_poker", "cfr")] * 2 + [("liars_dice", "true_bids")] * 2
    assert {(j.setup.search, j.setup.budget(j.game), j.setup.cache_dir, j.setup.moves) for j in seen["jobs"]} == {
        ("exact", 7, str(cache), str(out / "opponent-moves.sqlite"))}


def bench_report(printed: str) -> dict:
    """The JSON a bench run prints between the run's own lines and its table."""
    return json.loads(printed[printed.index('{\n "model"'):printed.index("\n| game |")])


def test_rows_without_a_student_train_none(tmp_path, monkeypatch, capsys):
    """The teacher's row alone (or with base) plays no adapter, so no SFT runs for it; a row that plays the
    student still trains one."""
    assert learning.parse_args(["--models", "base,expert"]).train_sft is False
    assert learning.parse_args(["--models", "sft"]).train_sft is True
    assert learning.parse_args(["--steps", "1", "--models", "sft+ppo"]).train_sft is True
    assert learning.parse_args(["--no-warm-start"]).train_sft is False
    with pytest.raises(SystemExit):  # DAgger rounds for a student no row plays are refused, not skipped
        learning.parse_args(["--models", "base,expert", "--sft-dagger-rounds", "1"])
    monkeypatch.setattr(learning.sft_warmstart, "main", lambda argv: pytest.fail("the warm start ran"))
    played = []
    monkeypatch.setattr(learning, "expert_records", lambda games, *args, **kwargs: played.extend(games) or [])
    out = tmp_path / "bench"
    learning.main(["--profile", "ci", "--games", "liars_dice", "--models", "expert", "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert played == ["liars_dice"]
    assert bench_report(printed)["sft"] is None


def test_eval_skip_plays_the_later_episodes_of_a_longer_evaluation_on_the_same_seeds():
    first = learning.eval_tasks(["goofspiel", "leduc_poker"], {"*": 4}, "mcts")
    longer = learning.eval_tasks(["goofspiel", "leduc_poker"], {"*": 10}, "mcts")
    extension = learning.eval_tasks(["goofspiel", "leduc_poker"], {"*": 10}, "mcts", skip=4)
    # per game: the first run's 4 tasks, then the extension's 6; together the longer run, task for task
    assert first + extension == longer[:4] + longer[10:14] + longer[4:10] + longer[14:] and len(extension) == 12
    assert not {(t.task_id, t.seed) for t in first} & {(t.task_id, t.seed) for t in extension}
    assert learning.parse_args(["--eval-episodes", "48", "--eval-skip", "16"]).eval_skip == 16
    for skip in ("-1", "48"):  # nothing left to play, or a negative count
        with pytest.raises(SystemExit):
            learning.parse_args(["--eval-episodes", "48", "--eval-skip", skip])


def record(model, seed, score):
    return {"model": model, "game": "leduc_poker", "task_id": 300000000, "seed": seed, "score": score,
            "outcome": "win" if score > 0.5 else "loss", "turns": 2, "illegal_moves": 0, "parse_failed_game": False,
            "generated_tokens": 4, "error": None, "llm_player_id": seed % 2}


def test_the_trained_row_carries_its_paired_difference_to_sft():
    scores = {"base": [0.2, 0.4, 0.3, 0.5], "sft": [0.5, 0.5, 0.4, 0.6], "sft+ppo": [0.6, 0.7, 0.5, 0.6]}
    records = [record(model, seed, score) for model, values in scores.items() for seed, score in enumerate(values)]
    result, rows = learning.table(records, "mcts", ["base", "sft", "sft+ppo"])
    trained = result["leduc_poker"]["sft+ppo"]
    # differences to sft: 0.1, 0.2, 0.1, 0.0 -> mean 0.1; to base: 0.4, 0.3, 0.2, 0.1 -> 0.25
    assert trained["score_minus_sft"] == pytest.approx(0.1)
    assert trained["score_minus_base"] == pytest.approx(0.25)
    low, high = trained["score_minus_sft_ci95"]
    assert low < 0.1 < high
    assert result["leduc_poker"]["sft"]["score_minus_sft"] is None
    assert rows[-1].startswith("| leduc_poker | mcts | sft+ppo |") and "+0.100" in rows[-1]


def test_training_signal_summarises_the_per_step_correlations(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in [
        {"step": 1, "signal/advantage_logprob_corr": 0.5}, {"step": 2}, {"step": 3, "signal/advantage_logprob_corr": -0.1}]))
    assert learning.training_signal(path) == {"advantage_logprob_corr_by_step": [0.5, -0.1],
                                              "advantage_logprob_corr_mean": 0.2, "steps_with_positive_corr": 1}


@pytest.mark.slow
def test_the_ci_profile_runs_every_phase_and_row_on_the_four_validator_games(tiny_model_dir, tmp_path, capsys,
                                                                            monkeypatch):
    """The whole recipe at toy sizes on the tiny model: SFT on the teachers, a PPO step, evaluation of base, SFT,
    SFT+PPO and the teachers, and leduc_poker's best response as the ceiling row."""
    from ppo_affine import experts, opponent_model
    from ppo_affine.envs.games import GAMES

    # The best response behind the ceiling, cheaply: its opponent model at 1 search per state instead of
    # experts.OPPONENT_MODEL_SAMPLES. The ceiling's games run in a spawned worker, which a monkeypatch of this process
    # does not reach (there the model took a minute), so the same code builds it here, under the key that worker
    # looks up (leduc_poker's one variant against the profile's 20 simulations) in model.cache_dir, where it reads it.
    build_frequencies = opponent_model.mcts_action_frequencies
    with monkeypatch.context() as once:
        once.setattr(opponent_model, "mcts_action_frequencies",
                     lambda game, budget, samples, **kwargs: build_frequencies(game, budget, 1, **kwargs))
        opponent_model.load_or_build("leduc_poker(players=2)", (20, GAMES["leduc_poker"].mcts[1]),
                                     experts.OPPONENT_MODEL_SAMPLES, tmp_path)
    opponent_models = sorted((tmp_path / "opponent-models").iterdir())
    moves_file, recorded = tmp_path / "bench" / "opponent-moves.sqlite", {}

    def counting_teacher_moves(*args, real=learning.teacher_moves):
        recorded["before"] = len(OpponentMoves(moves_file))
        result = real(*args)
        recorded["after"] = len(OpponentMoves(moves_file))
        return result

    monkeypatch.setattr(learning, "teacher_moves", counting_teacher_moves)
    sets = {"model.name_or_path": str(tiny_model_dir), "model.gguf_package": "null", "model.dtype": "float32",
            "model.cache_dir": str(tmp_path),
            "generation.max_prompt_tokens": "16384", "generation.max_turns": "40", "ppo.micro_batch_tokens": "16384"}
    learning.main(["--profile", "ci", "--output-dir", str(tmp_path / "bench"), "--workers", "1", "--teacher-moves",
                   *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]])
    printed = capsys.readouterr().out
    report = bench_report(printed)
    games = ["leduc_poker", "liars_dice", "goofspiel", "gin_rummy"]
    for game in games:  # every model that played, replayed against its teacher
        moves = report["teacher_moves"]["mcts"][game]
        assert set(moves) == {"base", "sft", "sft+ppo"} and all(m["turns"] >= 2 for m in moves.values()), game
    assert report["games"] == games and set(report["results"]["mcts"]) == set(games)
    for game in games:
        rows = report["results"]["mcts"][game]
        assert {"base", "sft", "sft+ppo", "expert"} <= set(rows), game
        assert rows["sft+ppo"]["episodes"] == 2 and rows["sft+ppo"]["score_minus_sft"] is not None
    assert "ceiling" in report["results"]["mcts"]["leduc_poker"]
    assert sorted((tmp_path / "opponent-models").iterdir()) == opponent_models  # the ceiling read it, built none
    assert report["experts"]["liars_dice"] == "true_bids"
    assert set(report["minutes"]) == {"sft", "ppo", "eval", "teacher", "teacher_moves"}
    # the evaluations recorded the opponent's moves, and replaying their games with the teachers searched none
    assert recorded["before"] > 0 and recorded["after"] == recorded["before"]


def test_reasoned_replies_are_every_game_some_games_or_none_and_an_explicit_length_wins():
    assert learning.parse_args([]).reason_games == ["goofspiel", "leduc_poker"]  # the random profile: every game
    args = learning.parse_args(["--profile", "validator", "--sft-reason", "goofspiel"])
    assert (args.reason_games, args.max_new_tokens) == (["goofspiel"], learning.REASON_REPLY_TOKENS)
    args = learning.parse_args(["--profile", "validator", "--sft-reason", "leduc_poker", "--max-new-tokens", "12"])
    assert (args.reason_games, args.max_new_tokens) == (["leduc_poker"], 12)
    assert learning.parse_args(["--no-sft-reason"]).reason_games == []
    with pytest.raises(SystemExit):  # a game this run does not play
        learning.parse_args(["--profile", "validator", "--games", "leduc_poker", "--sft-reason", "goofspiel"])


@pytest.mark.slow
def test_zero_steps_measure_the_sft_rows_alone(tiny_model_dir, tmp_path, capsys):
    """`--steps 0`: SFT (here from expert games with explored turns), no PPO run, the SFT row evaluated."""
    sets = {"model.name_or_path": str(tiny_model_dir), "model.gguf_package": "null", "model.dtype": "float32",
            "model.cache_dir": str(tmp_path), "generation.max_prompt_tokens": "16384",
            "ppo.micro_batch_tokens": "16384"}
    learning.main(["--profile", "ci", "--games", "liars_dice", "--steps", "0", "--models", "sft",
                   "--sft-explore", "0.3", "--sft-episodes", "4", "--output-dir", str(tmp_path / "bench"),
                   "--workers", "1",
                   *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]])
    printed = capsys.readouterr().out
    report = bench_report(printed)
    assert set(report["results"]["mcts"]["liars_dice"]) == {"sft"}
    assert report["checkpoint"] is None and report["signal"] is None and set(report["minutes"]) == {"sft", "eval",
                                                                                                    "teacher"}
    assert report["sft"]["explore"] == 0.3 and not (tmp_path / "bench" / "ppo").exists()
    data = [json.loads(line) for line in (tmp_path / "bench" / "sft" / "sft_data.jsonl").read_text().splitlines()]
    assert any(record["explored_replies"] for record in data)


def test_dagger_rounds_make_the_sft_row_from_a_given_checkpoint(tiny_model_dir, tmp_path, capsys):
    """`--sft-checkpoint` with `--sft-dagger-rounds`: no expert games, the rounds start from that checkpoint and
    the last round's adapter is what the SFT row plays."""
    import sft_warmstart

    sets = ["--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.gguf_package=null",
            "--set", "model.dtype=float32", "--set", f"model.cache_dir={tmp_path}"]
    assert sft_warmstart.main(["--preset", "cpu", "--games", "liars_dice", "--episodes", "2", "--epochs", "1",
                               "--workers", "1", "--opponent-simulations", "20", "--expert", "liars_dice=true_bids",
                               "--output-dir", str(tmp_path / "student"), *sets]) == 0
    [student] = (tmp_path / "student" / "checkpoints").glob("checkpoint-*")
    learning.main(["--profile", "ci", "--games", "liars_dice", "--steps", "0", "--models", "sft",
                   "--sft-checkpoint", str(student), "--sft-dagger-rounds", "1", "--sft-dagger-episodes", "2",
                   "--sft-dagger-data", str(tmp_path / "student" / "sft_data.jsonl"), "--sft-dagger-aggregate", "all",
                   "--output-dir", str(tmp_path / "bench"), "--workers", "1", *sets])
    printed = capsys.readouterr().out
    report = bench_report(printed)
    [dagger] = (tmp_path / "bench" / "sft" / "dagger-1" / "checkpoints").glob("checkpoint-*")
    assert report["sft"] == {"checkpoint": str(student), "dagger_rounds": 1, "dagger_episodes": "2",
                             "dagger_aggregate": "all", "dagger_checkpoint": str(dagger),
                             "dagger_data": str(tmp_path / "student" / "sft_data.jsonl")}
    assert not (tmp_path / "bench" / "sft" / "sft_data.jsonl").exists()  # no expert game before the rounds
    [round_one] = [json.loads(line) for line in (tmp_path / "bench" / "sft" / "dagger.jsonl").read_text().splitlines()]
    assert round_one["adapter"] == str(student) and round_one["by_game"]["liars_dice"]["games"] == 2
    assert round_one["expert_records"] == 2  # the student's two expert games, trained on beside the round's
    import torch

    assert torch.load(dagger / "trainer_state.pt", weights_only=False)["sft"]["dagger_aggregate"] == "all"  # passed on
    assert set(report["results"]["mcts"]["liars_dice"]) == {"sft"}


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_tables_from_joins_runs_relabels_a_model_and_sizes_its_difference(tmp_path, capsys):
    """An adapter's first seeds from one run, the rest from a later --eval-skip run where it played as `sft`."""
    first = write_records(tmp_path / "eval-mcts.jsonl", [record("sft", 0, 0.0), record("sft", 1, 0.0),
                                                         record("sft+ppo", 0, 1.0), record("sft+ppo", 1, 0.0)])
    (tmp_path / "sft").mkdir()
    (tmp_path / "ppo").mkdir()
    later_sft = write_records(tmp_path / "sft" / "eval-mcts.jsonl", [record("sft", 2, 1.0), record("sft", 3, 0.0)])
    later_ppo = write_records(tmp_path / "ppo" / "eval-mcts.jsonl", [record("sft", 2, 1.0), record("sft", 3, 0.0)])
    learning.main(["--tables-from", str(first), str(later_sft), f"{later_ppo}:sft=sft+ppo"])
    printed = capsys.readouterr().out
    rows = json.loads(printed[:printed.index("\n| game |")])["results"]["mcts"]["leduc_poker"]
    # sft 0, 0, 1, 0 and sft+ppo 1, 0, 1, 0: differences 1, 0, 0, 0, mean 0.25, s = 0.5; t(17) * 0.5 / sqrt(18)
    # = 0.2487 is the first half width under 0.25 (t(16) * 0.5 / sqrt(17) = 0.2571)
    assert rows["sft"]["episodes"] == rows["sft+ppo"]["episodes"] == 4
    assert rows["sft+ppo"]["score_minus_sft"] == pytest.approx(0.25)
    assert (rows["sft+ppo"]["score_minus_sft_pairs"], rows["sft+ppo"]["score_minus_sft_changed"],
            rows["sft+ppo"]["score_minus_sft_pairs_to_decide"]) == (4, 1, 18)
    assert "leduc_poker vs mcts, sft+ppo - sft: 1 of 4 pairs scored differently; 18 pairs" in printed
    # even seeds moved first: sft won seed 2 there, sft+ppo seeds 0 and 2
    assert rows["sft"]["score_by_seat"] == {"0": 0.5, "1": 0.0}
    assert rows["sft+ppo"]["score_by_seat"] == {"0": 1.0, "1": 0.0}
    assert rows["sft+ppo"]["episodes_by_seat"] == {"0": 2, "1": 2}


def test_a_later_file_replaces_an_earlier_files_episode_and_old_files_get_their_opponent_from_the_name(tmp_path):
    old = write_records(tmp_path / "eval-random.jsonl", [record("sft", 0, 0.0)])
    redo = write_records(tmp_path / "redo.jsonl", [{**record("sft", 0, 1.0), "opponent": "random"}])
    merged = learning.merged_records([str(old), str(redo)])
    assert [(r["opponent"], r["score"]) for r in merged] == [("random", 1.0)]


def test_the_confirmation_block_plays_the_same_tasks_on_seeds_of_its_own():
    """Recipes are compared on the tuning block; a chosen one is judged once on the confirmation block."""
    counts = {"*": 64}
    tuning, confirmation = (learning.eval_tasks(["leduc_poker", "goofspiel"], counts, "mcts", block=block)
                            for block in ("tuning", "confirmation"))
    assert tuning == learning.eval_tasks(["leduc_poker", "goofspiel"], counts, "mcts")  # the default, as before
    assert [t.task_id for t in tuning] == [t.task_id for t in confirmation]  # the same games and variants
    assert [t.seed % 2 for t in tuning] == [t.seed % 2 for t in confirmation] == [i % 2 for i in range(64)] * 2
    assert not {t.seed for t in tuning} & {t.seed for t in confirmation}
    # a later --eval-skip run extends the block it names
    assert learning.eval_tasks(["leduc_poker"], counts, "mcts", 16, "confirmation") == confirmation[16:64]
    assert learning.parse_args(["--eval-block", "confirmation"]).eval_block == "confirmation"
    with pytest.raises(SystemExit):
        learning.parse_args(["--eval-block", "final"])


def test_tables_from_refuses_files_of_both_blocks_together(tmp_path, capsys):
    tuning = write_records(tmp_path / "eval-mcts.jsonl", [record("sft", 0, 0.0)])  # from before blocks: tuning
    (tmp_path / "c").mkdir()
    confirmation = write_records(tmp_path / "c" / "eval-mcts.jsonl", [{**record("sft+ppo", 0, 1.0),
                                                                       "block": "confirmation"}])
    with pytest.raises(SystemExit, match=r"eval-mcts.jsonl holds tuning-block episodes and .*c/eval-mcts.jsonl "
                                         r"confirmation-block ones"):
        learning.main(["--tables-from", str(tuning), str(confirmation)])
    learning.main(["--tables-from", str(confirmation)])  # one block's files make a table
    assert "| leduc_poker | mcts | sft+ppo |" in capsys.readouterr().out


@pytest.mark.parametrize("source", ["missing.jsonl", "eval-mcts.jsonl:sft", "eval-mcts.jsonl:=sft+ppo",
                                    "eval-mcts.jsonl:sft=", "eval-mcts.jsonl:"])
def test_tables_from_rejects_a_missing_file_or_a_half_relabel(tmp_path, source):
    write_records(tmp_path / "eval-mcts.jsonl", [record("sft", 0, 0.0)])
    with pytest.raises(SystemExit):
        learning.parse_args(["--tables-from", str(tmp_path / source)])


def test_teacher_moves_count_the_turns_a_model_played_its_teachers_move(tmp_path, capsys, monkeypatch):
    """--teacher-moves: each recorded game replayed with the teacher answering; rows without a conversation
    (the teacher's own) are left out."""
    from test_sft_warmstart import _played_goofspiel

    matches = []

    def sometimes_the_lowest(turn, legal, expert_move):
        reply = expert_move if turn % 2 else min(legal)
        matches.append(reply == expert_move)
        return str(reply)

    played = [_played_goofspiel(seed, sometimes_the_lowest) for seed in (4, 5)]
    records = [{**game, "model": "sft", "outcome": "loss", "turns": len(game["conversation"]) // 2,
                "illegal_moves": 0, "parse_failed_game": False, "generated_tokens": 2,
                "llm_player_id": game["seed"] % 2} for game in played]
    teacher = {**records[0], "model": "expert"}
    del teacher["conversation"]
    # a second model that always played the teacher's move, listed first: one pool replays both, and each
    # model's turns are counted against its own games
    perfect = [{**record, **_played_goofspiel(record["seed"], lambda turn, legal, expert_move: str(expert_move)),
                "model": "sft+ppo"} for record in records]
    eval_file = write_records(tmp_path / "eval-random.jsonl", perfect + records + [teacher])
    learning.main(["--tables-from", str(eval_file), "--teacher-moves", "--workers", "1"])
    printed = capsys.readouterr().out
    moves = json.loads(printed[printed.index('{\n "sources"'):printed.index("\n| game |")])["teacher_moves"]
    assert list(moves["random"]["goofspiel"]) == ["sft", "sft+ppo"]
    best = moves["random"]["goofspiel"]["sft+ppo"]
    assert best["teacher_moves"] == best["turns"] > 0 and best["rate"] == 1.0
    row = moves["random"]["goofspiel"]["sft"]
    assert (row["teacher"], row["turns"], row["teacher_moves"]) == ("prize", len(matches), sum(matches))
    assert 0 < sum(matches) < len(matches) and row["ci95"][0] < row["rate"] < row["ci95"][1]
    assert f"| goofspiel | random | sft | prize | {row['rate']:.3f}" in printed
    # only rows without a conversation (the teacher's): nothing to replay, and no pool started
    def no_pool(*args, **kwargs):
        raise AssertionError("a pool started for no game")

    monkeypatch.setattr(learning.expert_play, "ProcessPoolExecutor", no_pool)
    learning.main(["--tables-from", str(write_records(tmp_path / "eval-mcts.jsonl", [teacher])), "--teacher-moves"])
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index('{\n "sources"'):printed.index("\n| game |")])["teacher_moves"] == {}
    monkeypatch.undo()
    # a game that does not replay as recorded (here: another seed) stops the table, naming the flag and the game
    (tmp_path / "moved").mkdir()
    moved = write_records(tmp_path / "moved" / "eval-random.jsonl", [{**records[0], "seed": 6}])
    with pytest.raises(SystemExit, match=r"--teacher-moves sft's goofspiel game \(task \d+, seed 6\): the replayed"):
        learning.main(["--tables-from", str(moved), "--teacher-moves", "--workers", "1"])
