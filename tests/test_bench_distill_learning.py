"""bench/distill_learning.py at toy size with the tiny model: cells are played and written in the published layout,
held-out cells are never trained on, the summary pairs every held-out cell, and --resume-cells plays nothing again."""
import json

import pytest

from bench import distill_learning
from ppo_affine.distill import read_cells


@pytest.mark.slow
def test_the_distill_bench_trains_on_some_cells_and_scores_the_others(tiny_model_dir, tmp_path, monkeypatch):
    args = ["--tasks", "3", "--samples", "2", "--train-tasks", "2", "--steps", "2", "--cells-per-step", "1",
            "--output-dir", str(tmp_path), "--set", f"model.name_or_path={tiny_model_dir}",
            "--set", "model.gguf_package=null", "--set", "generation.max_new_tokens=8",
            "--set", "generation.max_concurrent_episodes=2"]
    summary = distill_learning.main(args)
    train, held = read_cells(tmp_path / "cells-train"), read_cells(tmp_path / "cells-held-out")
    assert [len(c.rollouts) for c in train + held] == [2, 2, 2]
    assert {c.task_id for c in train}.isdisjoint({c.task_id for c in held})  # held-out tasks never train
    assert summary["cells"] == {"train": 2, "held_out": 1, "samples": 2}
    assert len(summary["training_curve"]) == 2
    change = summary["held_out_after_minus_before"]
    assert change["cells_up"] + change["cells_down"] <= 1 and change["mean"] is not None
    episodes = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 6 and len({(e["task_id"], e["seed"]) for e in episodes}) == 3

    def no_more_play(*_, **__):
        raise AssertionError("--resume-cells played the cells again")

    monkeypatch.setattr(distill_learning.evaluate, "evaluate", no_more_play)
    again = distill_learning.main(args + ["--resume-cells"])
    assert again["cells"] == summary["cells"]


def test_the_distill_bench_refuses_a_split_without_held_out_cells(tmp_path, capsys):
    with pytest.raises(SystemExit):
        distill_learning.main(["--tasks", "4", "--train-tasks", "4", "--output-dir", str(tmp_path)])
    assert "--train-tasks must be between 1 and --tasks - 1 (3)" in capsys.readouterr().err
