"""visualize.py on a small hand-written metrics.jsonl: which PNGs appear, stage lines, skipped panels, bad input."""
import json

import pytest

import visualize


def step_record(step, stage, success):
    return {
        "step": step, "curriculum/stage": stage, "curriculum/rolling_success": success,
        "env/reward_mean": 0.1 * step, "env/score_mean": 0.05 * step, "env/success_rate": success,
        "env/illegal_rate": 0.5 / step, "game/leduc_poker/success": success, "game/leduc_poker/score": 0.4,
        "game/liars_dice/success": success / 2, "game/liars_dice/score": 0.2, f"stage/{stage}/success": success,
        "reward/kl_per_token": 0.01 * step, "kl/coef": 0.2 - 0.01 * step, "policy/approx_kl_k3": 0.001,
        "policy/loss": -0.01, "value/loss": 0.3 / step, "policy/entropy": 1.2, "value/explained_variance": None,
        "policy/clipfrac": 0.05, "value/vf_clipfrac": 0.1,
    }


@pytest.fixture
def run_dir(tmp_path):
    """Five steps, promoted from 'easy' to 'medium' at step 3, no perf metrics (so throughput.png is skipped),
    and a last line cut off mid-write as a killed run leaves it."""
    records = [step_record(s, "easy" if s < 3 else "medium", 0.2 * s) for s in range(1, 6)]
    lines = [json.dumps(r) for r in records] + ['{"step": 6, "env/reward_me']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    return tmp_path


def test_stage_changes_mark_the_first_step_of_each_new_stage(run_dir):
    records = visualize.read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert visualize.stage_changes(records) == [(3, "medium")]


def test_every_panel_group_with_data_becomes_one_nonempty_png(run_dir, capsys):
    assert visualize.main(["--run-dir", str(run_dir)]) == 0
    plots = sorted(p.name for p in (run_dir / "plots").iterdir())
    assert plots == ["clipfrac.png", "illegal_rate.png", "kl_beta.png", "losses.png", "reward_score.png",
                     "success_by_game.png", "success_by_stage.png"]
    for name in plots:
        content = (run_dir / "plots" / name).read_bytes()
        assert content.startswith(b"\x89PNG") and len(content) > 5000
    assert "skipped throughput.png" in capsys.readouterr().out


def test_game_family_lines_are_labelled_by_game(run_dir):
    records = visualize.read_metrics(run_dir / "metrics.jsonl")
    success_panel = visualize.FIGURES[1].panels[0]
    series = visualize.panel_series(success_panel, records)
    assert sorted(series) == ["leduc_poker", "liars_dice"]
    assert series["liars_dice"] == ([1, 2, 3, 4, 5], pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5]))


def test_null_values_are_left_out_of_a_series(run_dir):
    records = visualize.read_metrics(run_dir / "metrics.jsonl")
    losses = visualize.FIGURES[5]
    explained_variance = visualize.panel_series(losses.panels[3], records)
    assert explained_variance == {}  # every value was null (non-finite when logged)


def test_output_folder_option(run_dir, tmp_path):
    out = tmp_path / "elsewhere"
    assert visualize.main(["--run-dir", str(run_dir), "--output", str(out)]) == 0
    assert len(list(out.glob("*.png"))) == 7


def test_missing_metrics_file_is_a_clear_error(tmp_path, capsys):
    assert visualize.main(["--run-dir", str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_a_corrupt_line_in_the_middle_is_reported_with_its_number(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "env/score_mean": 0.1}\nnot json\n{"step": 2}\n')
    assert visualize.main(["--run-dir", str(tmp_path)]) == 2
    assert "line 2" in capsys.readouterr().err
