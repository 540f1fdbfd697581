"""bench/distill_anchor.py at toy size with the tiny model: the base measured once, the runs off and on from the same
start (the same cells drawn), a stop by --stop-after-minutes continued by the same command, a coef sweep reusing the
runs done, a folder refused under another recipe, and the summary paired by cell, by game seed and by held-out
episode."""
import json

import pytest
import torch

from bench import distill_anchor
from ppo_affine.testing.distill_cells import golden_cells, write_cells
from test_anchor import episode, write_episodes


def toy_args(tiny_model_dir, out, episodes, *extra):
    return ["--output-dir", str(out), "--anchor-episodes", episodes, "--steps", "2", "--cells-per-step", "2",
            "--games", "2", "--anchor-per-step", "2", "--held-out-share", "0.4", "--learning-rate", "0.01",
            "--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.gguf_package=null",
            "--set", "generation.max_new_tokens=4", "--set", "generation.max_concurrent_episodes=2", *extra]


@pytest.mark.slow
def test_the_anchor_bench_runs_off_and_on_and_continues_where_it_stopped(tiny_model_dir, tmp_path):
    cells = golden_cells()
    write_cells(tmp_path / "cells-train", [cells[0], cells[2], cells[3]])
    write_cells(tmp_path / "cells-held-out", [cells[0], cells[3]])  # toy size: any two cells to score
    episodes = write_episodes(tmp_path / "anchor.jsonl",
                              [episode("liars_dice", [str(i % 3), "1"]) for i in range(5)])
    # the run off alone first: the base measured, the run trained and measured
    first = distill_anchor.main(toy_args(tiny_model_dir, tmp_path, episodes, "--runs", "off"))
    base = json.loads((tmp_path / "base.json").read_text())
    assert len(base["trained_game"]) == 2 and len(base["anchored_game"]) == 2
    assert base["drift_kl"] == [pytest.approx(0.0, abs=1e-6)] * 2  # ceil(0.4 * 5) held out; the base is the base
    assert not any(key.endswith("_minus_off") for key in first)  # no anchored run to pair with off yet
    assert first["off"]["held_out_cells_gain"]["n"] == 2
    off_before = (tmp_path / "run-off" / "result.json").read_text()
    # 0 minutes: the run on stops before its first step; the same command then finishes it, off not run again
    assert distill_anchor.main(toy_args(tiny_model_dir, tmp_path, episodes, "--stop-after-minutes", "0")) is None
    assert not (tmp_path / "run-on-coef0.2" / "result.json").exists()
    summary = distill_anchor.main(toy_args(tiny_model_dir, tmp_path, episodes))
    assert (tmp_path / "run-off" / "result.json").read_text() == off_before
    off = json.loads((tmp_path / "run-off" / "result.json").read_text())
    on = json.loads((tmp_path / "run-on-coef0.2" / "result.json").read_text())
    assert [list(step) for step in off["training_curve"]] == [["cells_score"]] * 2
    assert [sorted(step) for step in on["training_curve"]] == \
        [["anchor/liars_dice/kl", "anchor/liars_dice/tokens", "cells_score"]] * 2
    # the same start and the same cells drawn: the first step's cells score is the same number in both runs
    assert on["training_curve"][0]["cells_score"] == off["training_curve"][0]["cells_score"]
    assert all(kl > 0 for kl in off["drift_kl"] + on["drift_kl"])  # both runs moved off the base
    assert summary["anchored_game"] == "liars_dice" and summary["drift_episodes"] == 2
    assert summary["anchor_episodes"] == 3
    versus_off = summary["on@0.2_minus_off"]
    assert [versus_off[k]["n"] for k in ("drift_kl", "held_out_cells", "trained_game", "anchored_game")] == [2, 2, 2, 2]
    assert versus_off["drift_kl"]["mean"] == pytest.approx(
        sum(a - b for a, b in zip(on["drift_kl"], off["drift_kl"])) / 2)
    assert summary["off"]["held_out_cells_gain"]["n"] == 2
    assert summary["on@0.2"]["trained_game_change"]["n"] == 2 and summary["on@0.2"]["anchored_game_change"]["n"] == 2
    saved = torch.load(tmp_path / "run-on-coef0.2" / "state.pt", weights_only=False)
    assert len(saved["curve"]) == 2 and saved["anchor"]["draws"]
    assert json.loads((tmp_path / "run-on-coef0.2" / "recipe.json").read_text())["anchor"] == {"coef": 0.2,
                                                                                            "per_step": 2}

    # a sweep: another coef trains into its own folder from the same start, the runs already done are reused
    swept = distill_anchor.main(toy_args(tiny_model_dir, tmp_path, episodes, "--anchor-coef", "0.2,0.5"))
    assert (tmp_path / "run-off" / "result.json").read_text() == off_before
    other = json.loads((tmp_path / "run-on-coef0.5" / "result.json").read_text())
    assert other["training_curve"][0]["cells_score"] == off["training_curve"][0]["cells_score"]
    assert swept["on@0.2"] == summary["on@0.2"] and set(swept) >= {"on@0.2_minus_off", "on@0.5_minus_off"}

    # a folder's results hold for its recipe: continuing with more steps is refused in one line, nothing touched
    with pytest.raises(SystemExit, match=r"run-off: measured with steps=2, asked steps=3: use another --output-dir"):
        distill_anchor.main(toy_args(tiny_model_dir, tmp_path, episodes, "--runs", "off", "--steps", "3"))
    assert (tmp_path / "run-off" / "result.json").read_text() == off_before
    with pytest.raises(SystemExit, match=r"base: measured with games=2, asked games=4"):
        distill_anchor.main(toy_args(tiny_model_dir, tmp_path, episodes, "--games", "4"))


def test_a_results_folder_without_its_recipe_is_not_reused(tmp_path):
    (tmp_path / "run-off").mkdir()
    (tmp_path / "run-off" / "result.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"run-off: holds results without a recipe.json"):
        distill_anchor.claim_folder(tmp_path / "run-off", {"steps": 2})
    distill_anchor.claim_folder(tmp_path / "fresh", {"steps": 2})  # an empty or missing folder is claimed
    distill_anchor.claim_folder(tmp_path / "fresh", {"steps": 2})  # and reused under the same recipe
    assert json.loads((tmp_path / "fresh" / "recipe.json").read_text()) == {"steps": 2}


@pytest.mark.parametrize("coefs", ["0", "a,1", ","])
def test_the_anchor_bench_refuses_a_bad_coef_list(tmp_path, capsys, coefs):
    with pytest.raises(SystemExit):
        distill_anchor.main(["--output-dir", str(tmp_path), "--anchor-episodes", "x.jsonl", "--anchor-coef", coefs])
    assert "--anchor-coef: expected" in capsys.readouterr().err


def test_the_anchor_bench_refuses_episodes_of_two_games(tmp_path, capsys):
    episodes = write_episodes(tmp_path / "two.jsonl", [episode("liars_dice", ["1"])] * 2 +
                              [episode("goofspiel", ["1"])] * 2)
    with pytest.raises(SystemExit):
        distill_anchor.main(["--output-dir", str(tmp_path), "--anchor-episodes", episodes])
    assert "expected the episodes of one game, got ['goofspiel', 'liars_dice']" in capsys.readouterr().err
