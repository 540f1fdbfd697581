"""`bash bench/gpu_rows.sh long` (bench/long_episode.py), the prepared GPU row of a long agent episode, at CI size on
the CPU: both episodes in one JSON, the same conversation, the continued one prefilling its final length once."""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_long_row_writes_both_episodes_turn_by_turn_and_the_continued_one_prefills_each_token_once(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "LONG_MODEL": "tiny", "LONG_DEVICE": "cpu", "LONG_TURNS": "3",
           "LONG_FINAL_TOKENS": "400", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run(["bash", "bench/gpu_rows.sh", "long"], cwd=ROOT, env=env, check=True, timeout=600)
    result = json.loads((tmp_path / "long.json").read_text())
    continued, whole = result["episodes"]
    assert (continued["mode"], whole["mode"]) == ("continue", "reprefill") and result["turns"] == 3
    assert [t["prompt_tokens"] for t in continued["turns"]] == [t["prompt_tokens"] for t in whole["turns"]]
    assert continued["final_tokens"] == whole["final_tokens"] > 300
    # re-prefilling: every prompt whole; continuing: each turn's new tokens, up to the last prompt's length
    assert whole["prefilled_tokens"] == sum(t["prompt_tokens"] for t in whole["turns"])
    assert continued["prefilled_tokens"] <= continued["final_tokens"] and continued["prefix_break_rate"] == 0.0
    assert continued["peak_gb"] is None  # no allocator to read on a CPU
    for episode in (continued, whole):
        for turn in episode["turns"]:
            for key in ("prefill_s", "decode_s", "turn_s"):
                assert math.isfinite(turn[key]) and turn[key] > 0, (episode["mode"], turn["turn"], key)
