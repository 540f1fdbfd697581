"""bench/endpoint_overhead.py at CI size: both paths play the same games with the same replies, and it says so."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_both_paths_play_the_same_calls_and_the_overhead_is_their_difference():
    # a process of its own, as the bench runs: run in the test process after earlier tests had patched asyncio with
    # affinetes' nest_asyncio, it made pytest's later imports fail ("AST constructor recursion depth mismatch",
    # CPython 3.11.7)
    done = subprocess.run([sys.executable, "-m", "bench.endpoint_overhead", "--small", "--games", "4",
                           "--concurrency", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert set(report["settings"]) == {"concurrency_1", "concurrency_2"}
    for setting in report["settings"].values():
        native, endpoint = setting["native"], setting["endpoint"]
        assert setting["same_replies"] and native["calls"] == endpoint["calls"] > 4
        assert native["failed"] == endpoint["failed"] == 0
        expected = 1e3 * (endpoint["wall_s"] - native["wall_s"]) / native["calls"]
        assert abs(setting["overhead_ms_per_call"] - expected) < 1e-3 + 1e-3 * abs(expected)
