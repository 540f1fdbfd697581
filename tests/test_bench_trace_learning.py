"""bench/trace_learning.py at toy size with the tiny model: every phase runs, the table has its rows, a second
call with the same folder runs nothing again."""
import json

import pytest

from bench import trace_learning


@pytest.mark.slow
def test_the_trace_bench_runs_every_phase_and_resumes_without_rerunning(tiny_model_dir, tmp_path, monkeypatch):
    args = ["--levels", "0,1", "--eval-tasks", "2", "--sft-tasks", "4", "--sft-epochs", "1", "--steps", "2",
            "--min-episodes", "1", "--review", "0.5", "--max-new-tokens", "8", "--output-dir", str(tmp_path),
            "--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.gguf_package=null",
            "--set", "ppo.batch_size=2", "--set", "generation.max_concurrent_episodes=2"]
    result = trace_learning.main(args)
    table = result["table"]
    assert set(table) == {"level 0", "level 1"}
    for row in table.values():
        assert all(row[model]["episodes"] == 2 for model in trace_learning.MODELS)
        assert row["paired"]["sft+ppo - base"]["pairs"] == 2
    # a random tiny model answers nothing right: the run stays on its first stage
    assert [s["stage"] for s in result["stages"]] == ["level-0", "level-0"] and result["promotions"] == 0
    assert result["review"] == 0.5  # level-1's stage took it (the first stage cannot)
    evaluated = [json.loads(line) for line in (tmp_path / "eval-sft-ppo.jsonl").read_text().splitlines()]
    assert {r["task_id"] for r in evaluated} == {3_000_000, 3_000_001, 0, 1}  # the held-out ids
    sft_records = [json.loads(line) for line in (tmp_path / "sft" / "sft_data.jsonl").read_text().splitlines()]
    assert all(r["task_id"] % 1_000_000 >= 10_000 for r in sft_records)  # never a held-out task

    def no_more_work(*_, **__):
        raise AssertionError("a finished phase ran again")

    monkeypatch.setattr(trace_learning.train_ppo, "main", no_more_work)
    monkeypatch.setattr(trace_learning.sft_warmstart, "main", no_more_work)
    monkeypatch.setattr(trace_learning.evaluate, "evaluate", no_more_work)
    assert trace_learning.main(args)["table"] == table
