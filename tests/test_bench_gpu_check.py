"""`bash bench/gpu_rows.sh check`, the prepared GPU check, at CI size on the CPU: one JSON whose every field is there
and finite, so the check a lent GPU runs has not rotted. GPU-only readings are null on a CPU."""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_ONLY = {("decode_loop", "gpu_busy_percent"), ("cuda",)}


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
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run(["bash", "bench/gpu_rows.sh", "check"], cwd=ROOT, env=env, check=True, timeout=600)
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"decode_loop", "fold_gap", "token_trees", "train_bf16", "train_4bit", "vllm_installed"} <= set(result)
    assert {"steps", "forward_calls", "sync_warnings", "ms_per_step", "gpu_busy_percent"} <= set(result["decode_loop"])
    assert {"gap_fold", "gap_no_fold", "fold_over_no_fold", "delta_lost"} <= set(result["fold_gap"])
    for path, value in leaves(result):
        if path in GPU_ONLY:
            assert value is None, path
        elif not isinstance(value, str):
            assert isinstance(value, (int, float)) and math.isfinite(value), (path, value)
    assert result["decode_loop"]["steps"] > 0 and result["decode_loop"]["sync_warnings"] == 0
    assert result["decode_loop"]["ms_per_step_by_width"]  # at least one width's steps timed
    assert result["token_trees"]["passed"] == 1
    for run in ("train_bf16", "train_4bit"):
        assert result[run]["exit_codes"] == [0, 0] and result[run]["steps"] == [1, 2, 3]
