"""bench/endpoint_loop_block.py at CI size: it serves the call and reports both readings for each conversation."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_it_reports_the_on_loop_render_and_the_longest_loop_gap_with_the_worker():
    done = subprocess.run([sys.executable, "-m", "bench.endpoint_loop_block", "--small"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["tokenizer"] == "tiny" and [row["turns"] for row in report["rows"]] == [10]
    row = report["rows"][0]
    assert row["prompt_tokens"] > 1000 and row["on_loop_ms"] > 0 and row["worker_longest_gap_ms"] > 0
