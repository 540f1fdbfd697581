"""bench/teacher_score.py: per-game records and the paired difference against an earlier run."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_teacher_score", ROOT / "bench" / "teacher_score.py")
teacher_score = importlib.util.module_from_spec(spec)
spec.loader.exec_module(teacher_score)


def _run(capsys, *argv: str) -> dict:
    teacher_score.main(["--game", "goofspiel", "--games-played", "4", "--workers", "1", *argv])
    return json.loads(capsys.readouterr().out)


def test_records_pair_with_a_later_run_on_the_same_seeds(tmp_path, capsys):
    earlier = tmp_path / "earlier.jsonl"
    first = _run(capsys, "--records", str(earlier))
    records = [json.loads(line) for line in earlier.read_text().splitlines()]
    assert len(records) == 4 and first["both_seats"]["games"] == 4
    assert sorted(r["llm_player_id"] for r in records) == [0, 0, 1, 1]
    # the same teacher on the same seeds plays the same games: every difference is 0
    again = _run(capsys, "--paired-with", str(earlier))
    assert again["minus_earlier"]["both_seats"] == {"games": 4, "score_diff": 0.0, "ci95": [0.0, 0.0]}
    # lower one earlier first-seat game by 0.5: this run is +0.5 on it, +0.25 over that seat's two games
    moved = next(r for r in records if r["llm_player_id"] == 0)
    moved["score"] -= 0.5
    earlier.write_text("".join(json.dumps(r) + "\n" for r in records))
    paired = _run(capsys, "--paired-with", str(earlier))["minus_earlier"]
    assert paired["by_seat"]["0"]["score_diff"] == pytest.approx(0.25)
    assert paired["by_seat"]["1"]["score_diff"] == 0.0
    assert paired["both_seats"]["score_diff"] == pytest.approx(0.125)


def test_paired_with_refuses_a_missing_file_and_foreign_seeds(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _run(capsys, "--paired-with", str(tmp_path / "missing.jsonl"))
    assert "--paired-with" in capsys.readouterr().err
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({"task_id": 1, "seed": -5, "score": 1.0, "messages": []}) + "\n")
    with pytest.raises(SystemExit):
        _run(capsys, "--paired-with", str(foreign))
    assert "no game shares a seed" in capsys.readouterr().err
