"""verdict.py: both models on the same tasks and seeds, one at a time; the rule's buckets and the copy check in the
summary; a runner plugged in for an env scored without episodes; bad options."""
import json
from pathlib import Path

import pytest

import verdict
from ppo_affine.testing.distill_cells import golden_cells, write_cells
from ppo_affine.testing.tiny import load_tiny_policy, save_checkpoint_with_active_adapter
from test_evaluate_env import quiz_url, tools_model_dir  # noqa: F401 (fixtures: the foreign env's server, its model)

TINY = {"model.use_4bit": "false", "model.dtype": "float32", "run.device": "cpu", "generation.backend": "local",
        "generation.max_prompt_tokens": "16384", "generation.max_concurrent_episodes": "4",
        "generation.max_turns": "40"}


def tiny_args(model_dir: Path, *extra: str, ours_only: bool = True) -> list[str]:
    sets = TINY | {"model.name_or_path": str(model_dir)}
    if ours_only:  # judged on our envs alone; else the validators' scored envs stay 'unknown'
        sets["env.validators.sampling_counts"] = "{}"
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")] + [
        "--opponent", "random", "--max-new-tokens", "3", *extra]


@pytest.fixture(scope="module")
def copy_of_base(tiny_model_dir, tmp_path_factory) -> Path:
    """A checkpoint whose adapter is fresh (B = 0): the base model exactly."""
    folder = tmp_path_factory.mktemp("copy") / "checkpoint-1"
    load_tiny_policy(tiny_model_dir).save(folder)
    return folder


@pytest.fixture(scope="module")
def changed(tiny_model_dir, tmp_path_factory) -> Path:
    return save_checkpoint_with_active_adapter(tiny_model_dir, tmp_path_factory.mktemp("changed") / "checkpoint-2")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_both_models_play_the_same_tasks_and_seeds_and_the_summary_holds_each_env(tiny_model_dir, changed, tmp_path,
                                                                                   capsys):
    out = tmp_path / "out"
    code = verdict.main(tiny_args(tiny_model_dir, "--candidate", str(changed), "--env", "openspiel", "--games",
                                  "leduc_poker", "--env", "trace", "--episodes", "2", "--output-dir", str(out),
                                  ours_only=False))
    assert code == 0
    champion, candidate = read_jsonl(out / "episodes-champion.jsonl"), read_jsonl(out / "episodes-candidate.jsonl")
    keys = sorted((r["env"], r["task_id"], r["seed"]) for r in champion)  # written as episodes finish
    assert keys == sorted((r["env"], r["task_id"], r["seed"]) for r in candidate)
    assert len(keys) == 4 and ("openspiel", 200000000, 1580322239) in keys  # the validators' seed of game:200000000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["temperature"] == 0.0
    rows = {row["env"]: row for row in summary["envs"]}
    assert list(rows) == ["openspiel", "trace", "SWE-INFINITE", "DISTILL-V2", "TERMINAL"]
    assert [rows[e]["bucket"] for e in ("SWE-INFINITE", "DISTILL-V2", "TERMINAL")] == ["unknown"] * 3
    assert (rows["DISTILL-V2"]["shared_tasks"], rows["DISTILL-V2"]["required_tasks"]) == (0, 100)
    assert rows["trace"]["shared_tasks"] == 2 and rows["trace"]["required_tasks"] == 1
    assert summary["verdict"] in ("unknown", "would not")  # never 'would dethrone' with scored envs unrun
    copy = summary["copy_check"]
    assert copy["rollouts"] >= 1 and copy["positions"] > 0 and copy["median"] > 0.05  # an active adapter moved it
    printed = capsys.readouterr().out
    assert "verdict: " in printed and "copy check: median |Δ log-prob|" in printed


def test_an_identical_copy_ties_everywhere_and_is_caught_by_the_copy_check(tiny_model_dir, copy_of_base, tmp_path):
    # the candidate is a merged model folder, the champion a checkpoint: the same weights either way
    out = tmp_path / "out"
    assert verdict.main(tiny_args(tiny_model_dir, "--candidate", str(tiny_model_dir), "--champion", str(copy_of_base),
                                  "--env", "trace", "--episodes", "3", "--output-dir", str(out),
                                  "--set", "env.validators.copy_min_positions=10")) == 0  # 3-token replies: few
    summary = json.loads((out / "summary.json").read_text())
    (trace,) = summary["envs"]
    # greedy decoding of the same weights: every paired difference is 0
    assert (trace["bucket"], trace["difference"], trace["difference_ci95"]) == ("not_worse", 0.0, [0.0, 0.0])
    assert trace["interval_could_change_bucket"] is False
    assert summary["verdict_text"] == "would not, because dominant in 0 env(s), 1 needed"
    copy = summary["copy_check"]
    assert (copy["median"], copy["verdict"], copy["rollouts"]) == (0.0, "copy", 3)
    assert copy["positions"] >= 10


def test_a_plugged_in_runner_scores_its_env_while_each_model_is_loaded(tiny_model_dir, changed, tmp_path,
                                                                      monkeypatch):
    seen = []

    def cells(model, plans, policy, episodes_path):
        seen.append((model.label, policy is not None))
        score = 0.5 if model.label == "candidate" else 0.0
        return [{"model": model.label, "env": "DISTILL-V2", "task_id": t.task_id, "seed": t.seed, "score": score,
                 "error": None} for plan in plans for t in plan.tasks]

    monkeypatch.setitem(verdict.RUNNERS, "distill", cells)
    monkeypatch.setitem(verdict.RUNNER_OF_ENV, "DISTILL-V2", "distill")
    out = tmp_path / "out"
    assert verdict.main(tiny_args(tiny_model_dir, "--candidate", str(changed), "--env", "DISTILL-V2=0-99",
                                  "--no-copy-check", "--output-dir", str(out),
                                  "--set", 'env.validators.sampling_counts={"DISTILL-V2": 100}')) == 0
    assert seen == [("champion", True), ("candidate", True)]
    summary = json.loads((out / "summary.json").read_text())
    (distill,) = summary["envs"]
    assert (distill["bucket"], distill["shared_tasks"], distill["dominant_above"]) == ("dominant", 100, 0.1)
    assert summary["verdict"] == "would dethrone"
    assert summary["copy_check"] is None


@pytest.mark.parametrize("extra, message", [
    (["--env", "nosuch"], "--env nosuch: no such env in the env config"),
    (["--env", "openspiel"], "--env openspiel: say which games it plays with --games"),
    (["--env", "trace", "--champion", "/no/such/folder"], "--champion: /no/such/folder is not a folder"),
])
def test_bad_options_exit_2_with_one_clear_message(tiny_model_dir, changed, extra, message, capsys):
    assert verdict.main(tiny_args(tiny_model_dir, "--candidate", str(changed), *extra)) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_a_checkpoint_with_its_run_configuration_is_not_taken_for_a_merged_model(tiny_model_dir, changed, tmp_path):
    checkpoint = tmp_path / "checkpoint-3"
    (checkpoint / "adapter").mkdir(parents=True)
    (checkpoint / "config.json").write_text('{"train": {}, "env": {}, "curriculum": {}}')  # what train_ppo saves
    assert verdict.is_merged_model(tiny_model_dir) is True
    assert verdict.is_merged_model(checkpoint) is False
    assert verdict.is_merged_model(changed) is False


def test_distill_cells_are_scored_by_each_model_and_judged_with_the_additive_band(tiny_model_dir, copy_of_base,
                                                                                  tmp_path):
    cells = write_cells(tmp_path / "cells", golden_cells()[:2])
    out = tmp_path / "out"
    # the same weights on both sides: every cell scores the same, so DISTILL-V2 ties
    assert verdict.main(tiny_args(tiny_model_dir, "--candidate", str(tiny_model_dir), "--champion", str(copy_of_base),
                                  "--distill-cells", str(cells), "--no-copy-check", "--output-dir", str(out),
                                  "--set", 'env.validators.sampling_counts={"DISTILL-V2": 2}')) == 0
    champion, candidate = read_jsonl(out / "distill-champion.jsonl"), read_jsonl(out / "distill-candidate.jsonl")
    assert [(r["env"], r["task_id"]) for r in champion] == [("DISTILL-V2", 0), ("DISTILL-V2", 1)]
    assert [r["score"] for r in candidate] == pytest.approx([r["score"] for r in champion], abs=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    (distill,) = summary["envs"]
    assert (distill["env"], distill["bucket"], distill["shared_tasks"], distill["required_tasks"]) == (
        "DISTILL-V2", "not_worse", 2, 2)
    assert distill["not_worse_from"] == pytest.approx(distill["champion_mean"] - 0.1)  # additive, not x 0.98
    assert summary["verdict"] == "would not"


def test_an_env_of_kind_evaluate_is_played_through_the_endpoint_for_both_models(tools_model_dir, quiz_url, tmp_path):
    env = {"openspiel": {"kind": "openspiel"}, "quiz": {"kind": "evaluate", "mode": "url", "url": quiz_url,
                                                        "timeout": 120}}
    out = tmp_path / "out"
    # the candidate is the base model's own folder: the same model, so every quiz score ties
    assert verdict.main(tiny_args(tools_model_dir, "--candidate", str(tools_model_dir), "--env", "quiz=0-3",
                                  "--no-copy-check", "--output-dir", str(out), "--set", f"env.envs={json.dumps(env)}",
                                  "--max-new-tokens", "6")) == 0
    for side in ("champion", "candidate"):
        records = read_jsonl(out / f"episodes-{side}.jsonl")
        assert sorted((r["env"], r["task_id"]) for r in records) == [("quiz", t) for t in range(4)]
        assert all(r["error"] is None and r["turns"] >= 1 for r in records)  # each evaluate() called the endpoint
    (quiz,) = json.loads((out / "summary.json").read_text())["envs"]
    assert (quiz["env"], quiz["shared_tasks"], quiz["difference"], quiz["bucket"]) == ("quiz", 4, 0.0, "not_worse")


def test_the_copy_check_takes_each_envs_finished_episodes_with_the_highest_task_ids():
    from ppo_affine.testing.tiny import make_tokenizer

    def record(env, task_id, error=None):
        return {"env": env, "game": env, "task_id": task_id, "seed": 7, "error": error,
                "conversation": [{"role": "user", "content": "Your move?"},
                                 {"role": "assistant", "content": f"Action: {task_id}"}]}

    records = [record("a", 1), record("a", 3), record("a", 2), record("a", 9, error="timeout"), record("b", 5),
               {**record("c", 4), "conversation": [{"role": "user", "content": "no reply"}]}]
    rollouts = verdict.champion_rollouts(records, make_tokenizer(), {}, per_env=2)
    assert [r.key for r in rollouts] == ["a#3#7", "a#2#7", "b#5#7"]
    assert all(any(r.assistant_mask) for r in rollouts)
