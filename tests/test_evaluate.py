"""evaluate.py: which tasks and seeds it plays, what one episode records, and end-to-end runs on a tiny model."""
import asyncio
import json
from pathlib import Path

import pytest
import torch

import evaluate
from ppo_affine.envs.tasks import Task
from ppo_affine.rollout import Episode, Turn
from ppo_affine.config import ConfigError


# ---------------------------------------------------------------------- task planning
def test_games_without_seed_use_validator_seeds_of_consecutive_config_ids():
    tasks = evaluate.game_tasks("goofspiel", 3, None, "mcts", "openspiel")
    assert [t.task_id for t in tasks] == [0, 1, 2]
    assert tasks[0].seed == 251295477  # sha256("game:0"), the validators' seed (docs/protocols.md, 'How validators call it')
    leduc = evaluate.game_tasks("leduc_poker", 1, None, "random", "openspiel")[0]
    assert (leduc.task_id, leduc.seed, leduc.opponent, leduc.stage) == (200000000, 1580322239, "random", "eval")


def test_derived_seeds_play_every_variant_from_both_seats():
    tasks = evaluate.game_tasks("hex", 6, 123, "mcts", "openspiel")
    # hex has 4 variants (c % 4); a seat rule of (seed % 2) would tie variant to seat with one config id per episode
    assert [t.task_id for t in tasks] == [600000000, 600000000, 600000001, 600000001, 600000002, 600000002]
    assert [t.seed % 2 for t in tasks] == [0, 1, 0, 1, 0, 1]
    assert len({t.seed for t in tasks}) == 6 and all(t.seed < 2**32 - 16 for t in tasks)
    assert [t.seed for t in evaluate.game_tasks("hex", 6, 123, "mcts", "openspiel")] == [t.seed for t in tasks]
    assert [t.seed for t in evaluate.game_tasks("hex", 6, 124, "mcts", "openspiel")] != [t.seed for t in tasks]


def test_unloadable_variants_are_skipped():
    tasks = evaluate.game_tasks("bridge", 3, None, "mcts", "openspiel")
    assert [t.task_id % 100_000_000 for t in tasks] == [0, 3, 6]  # bridge loads only for config_id % 3 == 0


def test_trace_tasks_cycle_the_difficulty_levels():
    tasks = evaluate.game_tasks("trace", 4, None, "mcts", "trace")
    assert [t.task_id for t in tasks] == [0, 1_000_000, 2_000_000, 1]
    assert all(t.opponent is None for t in tasks)


def test_task_id_list_with_ranges_and_trace_prefix():
    assert evaluate.parse_task_ids("5, 0-2,trace:10-11") == [
        ("openspiel", 5), ("openspiel", 0), ("openspiel", 1), ("openspiel", 2), ("trace", 10), ("trace", 11)]
    tasks = evaluate.listed_tasks([("openspiel", 0), ("trace", 10)], None, "mcts",
                                  {"openspiel": "games", "trace": "tr"})
    assert [(t.env, t.task_id, t.seed, t.opponent) for t in tasks] == [("games", 0, 251295477, "mcts"),
                                                                      ("tr", 10, tasks[1].seed, None)]


@pytest.mark.parametrize("text", ["5-", "a", "chess:3", "4-2", "1,,2"])
def test_bad_task_ids_are_a_clear_error(text):
    with pytest.raises(ConfigError, match="--task-ids"):
        evaluate.parse_task_ids(text)


# ---------------------------------------------------------------------- one episode -> one record
def played(turn_errors, score, done=True, kind="openspiel", task_id=200000000, **fields):
    task = Task(env=kind, task_id=task_id, seed=7, opponent="random" if kind == "openspiel" else None,
                stage="eval", replay=False)
    episode = Episode(task=task, env_kind=kind, score=score, success=score > (0.5 if kind == "openspiel" else 0),
                      done=done, info={"llm_player_id": 1} if kind == "openspiel" else {}, **fields)
    episode.turns = [Turn(response_ids=[2, 3], response_text="x", sampler_logprobs=None,
                          parse_error=e) for e in turn_errors]
    return episode


def test_record_of_a_game_lost_to_three_failed_parses():
    record = evaluate.episode_record(played([False, True, True, True], 0.0), "adapter")
    assert record == {
        "model": "adapter", "env": "openspiel", "game": "leduc_poker", "task_id": 200000000, "seed": 7, "opponent": "random",
        "llm_player_id": 1, "score": 0.0, "success": False, "outcome": "loss", "turns": 4, "illegal_moves": 3,
        "parse_failed_game": True, "generated_tokens": 8, "error": None, "scored_by": "in_process",
        "conversation": [],
    }


def test_record_outcomes_follow_the_score():
    assert evaluate.episode_record(played([True, False], 1.0), "base")["outcome"] == "win"
    draw = evaluate.episode_record(played([True, False], 0.5), "base")
    assert (draw["outcome"], draw["parse_failed_game"], draw["illegal_moves"]) == ("draw", False, 1)
    assert evaluate.episode_record(played([False], 0.2), "base")["outcome"] == "loss"


def test_record_of_a_cut_off_episode_is_an_error():
    record = evaluate.episode_record(played([False] * 3, 0.0, done=False, cut_off=True), "base")
    assert record["outcome"] == "error"
    assert record["error"] == "cut off after 3 model turns (generation.max_turns)"


def test_record_of_a_trace_episode():
    record = evaluate.episode_record(played([False], 1.0, kind="trace", task_id=12), "adapter")
    assert (record["game"], record["outcome"], record["llm_player_id"], record["parse_failed_game"]) == (
        "trace", "correct", None, False)


# ---------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def digit_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with an LM head that can only say '1' or '2' (by the sign of one hidden unit), so its
    one-token replies are often legal moves and games are really played."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("1"), 0] = 1.0
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("2"), 0] = -1.0
    folder = tmp_path_factory.mktemp("digits")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(digit_model_dir, tmp_path_factory) -> Path:
    from ppo_affine.testing.tiny import save_checkpoint_with_active_adapter

    return save_checkpoint_with_active_adapter(digit_model_dir, tmp_path_factory.mktemp("run") / "checkpoint-3")


def tiny_args(model_dir: Path, *extra: str) -> list[str]:
    sets = {"model.name_or_path": str(model_dir), "model.use_4bit": "false", "model.dtype": "float32",
            "run.device": "cpu", "generation.backend": "local", "generation.max_prompt_tokens": "16384",
            "generation.max_concurrent_episodes": "4", "generation.max_turns": "40"}
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")] + [
        "--opponent", "random", "--max-new-tokens", "1", *extra]


def read_episodes(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "episodes.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_compare_base_plays_both_models_on_the_same_tasks(digit_model_dir, checkpoint, tmp_path, capsys):
    out = tmp_path / "eval"
    code = evaluate.main(tiny_args(digit_model_dir, "--checkpoint", str(checkpoint), "--compare-base",
                                   "--games", "leduc_poker,liars_dice,trace", "--episodes", "2", "--seed", "5",
                                   "--output-dir", str(out)))
    assert code == 0
    episodes = read_episodes(out)
    assert len(episodes) == 12  # 3 games x 2 episodes x 2 models
    by_model = {m: sorted((e["game"], e["task_id"], e["seed"]) for e in episodes if e["model"] == m)
                for m in ("adapter", "base")}
    assert by_model["adapter"] == by_model["base"]
    games = [e for e in episodes if e["game"] != "trace"]
    assert {e["llm_player_id"] for e in games} == {0, 1}  # --seed alternates the seat
    assert all(e["error"] is None and e["outcome"] in ("win", "draw", "loss") for e in games)
    assert any(e["turns"] > e["illegal_moves"] for e in games)  # legal moves were played
    assert {e["outcome"] for e in episodes if e["game"] == "trace"} <= {"correct", "incorrect"}

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["models"]) == ["adapter", "base"]
    leduc = summary["models"]["adapter"]["leduc_poker"]
    wins = sum(e["outcome"] == "win" for e in episodes if e["model"] == "adapter" and e["game"] == "leduc_poker")
    assert leduc["episodes"] == 2 and leduc["win_rate"] == wins / 2
    assert {"draw_rate", "loss_rate", "mean_score", "score_ci95", "illegal_rate", "parse_error_rate"} <= set(leduc)
    assert set(summary["comparison"]) == {"leduc_poker", "liars_dice", "all_games", "trace"}
    assert summary["comparison"]["leduc_poker"]["pairs"] == 2
    assert summary["settings"]["temperature"] == 0.0 and summary["settings"]["context_strategy"] == "full"
    printed = capsys.readouterr().out
    assert "leduc_poker" in printed and "score - base" in printed and "Trace" in printed


@pytest.mark.slow
def test_base_only_equals_the_base_side_of_a_comparison(digit_model_dir, checkpoint, tmp_path):
    """The adapter switched off plays exactly like the plain base model (same seeds, greedy)."""
    compare, alone = tmp_path / "compare", tmp_path / "alone"
    assert evaluate.main(tiny_args(digit_model_dir, "--checkpoint", str(checkpoint), "--compare-base",
                                   "--task-ids", "200000000-200000002", "--output-dir", str(compare))) == 0
    assert evaluate.main(tiny_args(digit_model_dir, "--base-only", "--task-ids", "200000000-200000002",
                                   "--output-dir", str(alone))) == 0
    key = lambda e: e["task_id"]  # noqa: E731
    base_side = sorted((e for e in read_episodes(compare) if e["model"] == "base"), key=key)
    assert base_side == sorted(read_episodes(alone), key=key)
    assert [e["seed"] for e in base_side] == [1580322239, 2916780863, 2582857272]  # validator seeds


@pytest.mark.parametrize("args,message", [
    (["--base-only"], "Nothing to evaluate"),
    (["--base-only", "--games", "tic_tac_toe"], "unknown ['tic_tac_toe']"),
    (["--base-only", "--task-ids", "1900000001"], "cannot load"),
    (["--base-only", "--task-ids", "3", "--episodes", "2"], "--episodes applies to --games"),
    (["--base-only", "--compare-base", "--games", "leduc_poker"], "needs --checkpoint"),
    (["--checkpoint", "/nonexistent/ckpt", "--games", "leduc_poker"], "/nonexistent/ckpt does not exist"),
])
def test_bad_options_exit_2_with_one_clear_message(tiny_model_dir, args, message, capsys):
    assert evaluate.main(tiny_args(tiny_model_dir, *args)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_env_that_fails_to_start_leaves_nothing_open(monkeypatch, tmp_path):
    """Two models share a scratch file of opponent moves; when the second env cannot start, the first env, the
    generator and that scratch folder are closed and gone all the same."""
    import tempfile

    from ppo_affine.config import EnvSpec, load_config

    closed = []

    class Closes:
        def __init__(self, name):
            self.name = name

        async def close(self):
            closed.append(self.name)

    def make_env(spec, **_):
        if spec.kind == "trace":
            raise ValueError("the trace env broke")
        assert Path(spec.opponent_moves).parent.parent == tmp_path  # the scratch folder is in use
        return Closes(spec.kind)

    monkeypatch.setattr(evaluate, "model_runs", lambda *_: (Closes("generator"), None, [("adapter", None),
                                                                                      ("base", None)]))
    monkeypatch.setattr(evaluate, "make_env", make_env)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env_specs = {"openspiel": ("openspiel", EnvSpec(kind="openspiel")), "trace": ("trace", EnvSpec(kind="trace"))}
    with pytest.raises(ValueError, match="the trace env broke"):
        asyncio.run(evaluate.evaluate(load_config(presets=["cpu"]), [], env_specs, None, True, None))
    assert closed == ["openspiel", "generator"] and not list(tmp_path.iterdir())


# ---------------------------------------------------------------------- the adapter reaches the engine
@pytest.fixture
def vllm_ignoring_adapters(tiny_model_dir):
    """A fake vLLM server that accepts adapters but keeps serving the base model (an engine with a LoRA bug)."""
    from test_train import _serve_fake_vllm

    yield from _serve_fake_vllm(tiny_model_dir, "--ignore-adapters")


@pytest.mark.slow
def test_an_engine_that_ignores_the_evaluated_adapter_is_caught_before_any_episode(tiny_model_dir, tmp_path, capsys,
                                                                                   vllm_ignoring_adapters):
    """Evaluating an adapter through a server that drops it would score the base model under the adapter's name:
    the probe stops evaluate.py first, in one line naming the likely upstream bugs, with no episode played."""
    from test_train import served_adapters

    from ppo_affine.testing.tiny import save_checkpoint_with_active_adapter

    checkpoint = save_checkpoint_with_active_adapter(tiny_model_dir, tmp_path / "run" / "checkpoint-3")
    capsys.readouterr()
    out = tmp_path / "out"
    code = evaluate.main(tiny_args(tiny_model_dir, "--checkpoint", str(checkpoint), "--games", "leduc_poker",
                                   "--episodes", "2", "--set", "generation.backend=vllm",
                                   "--set", f"env.vllm_url={vllm_ignoring_adapters}", "--output-dir", str(out)))
    assert code == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "does not apply LoRA adapters as the trainer does" in err and "vLLM #49354" in err
    assert "Traceback" not in err
    assert not (out / "episodes.jsonl").exists() or (out / "episodes.jsonl").read_text() == ""
    assert not (out / "summary.json").exists()
    assert served_adapters(vllm_ignoring_adapters) == []  # the probe was unloaded


@pytest.mark.slow
def test_an_engine_that_applies_the_evaluated_adapter_passes_the_probe_and_plays(tiny_model_dir, tmp_path, capsys,
                                                                                fake_vllm):
    from ppo_affine.testing.tiny import save_checkpoint_with_active_adapter

    checkpoint = save_checkpoint_with_active_adapter(tiny_model_dir, tmp_path / "run" / "checkpoint-3")
    out = tmp_path / "out"
    assert evaluate.main(tiny_args(tiny_model_dir, "--checkpoint", str(checkpoint), "--games", "leduc_poker",
                                   "--episodes", "2", "--set", "generation.backend=vllm",
                                   "--set", f"env.vllm_url={fake_vllm}", "--output-dir", str(out))) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "applies the adapter: a probe moved the trainer's log-probs by up to" in printed
    assert len(read_episodes(out)) == 2

