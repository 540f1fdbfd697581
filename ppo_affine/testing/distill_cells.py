"""DISTILL-V2 cells in the published layout, written from a plain description (tests and the golden recorder).

A description is a list of cells: {"task_idx", "env_name", "task_id", "teacher_name", "rows": [{"reward",
"messages", "reward_breakdown"?, "status"?}]}. Each becomes tasks/{task_idx:08d}.parquet with the columns the env
reads (the trajectory zstd-compressed JSON), and the cells together a manifest.jsonl. Needs pyarrow and zstandard
only, so the recorder can import it beside the env's own package.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

SCHEMA_VERSION = "1.0-affent"


def rollout_uuid(task_idx: int, sample_idx: int) -> str:
    return str(uuid.UUID(int=task_idx * 1000 + sample_idx))


def compressed_trajectory(row: dict[str, Any]) -> bytes:
    import zstandard

    trajectory = {"schema_version": SCHEMA_VERSION, "messages": row["messages"],
                  "reward_breakdown": row.get("reward_breakdown") or {}, "teacher_meta": {}}
    return zstandard.ZstdCompressor(level=9).compress(json.dumps(trajectory).encode())


def shard_table(cell: dict[str, Any]):
    import pyarrow as pa

    rows = []
    for sample_idx, row in enumerate(cell["rows"]):
        blob = row["extra_compressed"].encode("latin-1") if "extra_compressed" in row else compressed_trajectory(row)
        rows.append({
            "rollout_id": rollout_uuid(cell["task_idx"], sample_idx), "env_name": cell["env_name"],
            "task_id": cell["task_id"], "teacher_name": cell["teacher_name"], "sample_idx": sample_idx,
            "temperature": 1.0, "top_p": None, "seed": None, "status": row.get("status", "ok"),
            "reward": row["reward"], "steps": len(row.get("messages", [])), "tokens_in": None, "tokens_out": None,
            "schema_version": SCHEMA_VERSION, "extra_compressed": blob,
            "extra_sha256": hashlib.sha256(blob).hexdigest(), "created_at": "2026-07-01T00:00:00Z",
        })
    schema = pa.schema([("rollout_id", pa.string()), ("env_name", pa.string()), ("task_id", pa.int64()),
                        ("teacher_name", pa.string()), ("sample_idx", pa.int64()), ("temperature", pa.float64()),
                        ("top_p", pa.float64()), ("seed", pa.int64()), ("status", pa.string()),
                        ("reward", pa.float64()), ("steps", pa.int64()), ("tokens_in", pa.int64()),
                        ("tokens_out", pa.int64()), ("schema_version", pa.string()),
                        ("extra_compressed", pa.binary()), ("extra_sha256", pa.string()),
                        ("created_at", pa.string())])
    return pa.Table.from_pylist(rows, schema=schema)


def write_cells(folder: Path, cells: list[dict[str, Any]], manifest: bool = True) -> Path:
    """The cells under `folder` in the published layout; returns `folder`."""
    import pyarrow.parquet as pq

    folder = Path(folder)
    (folder / "tasks").mkdir(parents=True, exist_ok=True)
    lines = []
    for cell in cells:
        key = f"tasks/{cell['task_idx']:08d}.parquet"
        pq.write_table(shard_table(cell), folder / key)
        rewards = [r["reward"] or 0.0 for r in cell["rows"]]
        lines.append(json.dumps({
            "task_idx": cell["task_idx"], "list_name": "synthetic", "env_name": cell["env_name"],
            "task_id": cell["task_id"], "teacher_name": cell["teacher_name"], "n_rollouts": len(cell["rows"]),
            "reward_mean": sum(rewards) / len(rewards), "reward_std": 0.0, "object_uri": key, "object_key": key,
            "committed_at": "2026-07-01T00:00:00Z"}))
    if manifest:
        (folder / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def fake_token_logprobs(input_ids: list[int]) -> list[float | None]:
    """Deterministic stand-in log-probs (no model): None at the first token, as a server reports it."""
    return [None] + [-(((token * 7 + position * 3) % 11) + 1) / 10 for position, token in
                     enumerate(input_ids) if position > 0]


# ---------------------------------------------------------------------- the golden cells: one rule each
DAEMON_OUTPUT = "Error response from daemon: container 2b0e9de06995 is not running\n"


def _agent_turns(answer: str, thought: str, command: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "Fix the failing test in café.py"},
        {"role": "assistant", "content": "Let me look.", "reasoning": thought,
         "tool_calls": [{"id": "c1", "name": "bash", "arguments": {"command": command, "timeout": 30}}]},
        {"role": "tool", "content": "1 failed, 2 passed", "tool_call_id": "c1"},
        {"role": "assistant", "content": answer, "reasoning": None, "tool_calls": []},
    ]


def golden_cells() -> list[dict[str, Any]]:
    """The cells the golden cases score (tests/data/distill_v2/golden.json holds the env's outputs on them)."""
    def cell(task_idx: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"task_idx": task_idx, "env_name": "swe-synth", "task_id": 100 + task_idx, "teacher_name": "teacher-a",
                "rows": rows}

    long_text = " ".join(f"line{i % 97} of the log" for i in range(9000))  # about 40 000 tokens
    return [
        # rewards spread, one without a reward, reasoning, tool calls, a tool result and non-ASCII arguments
        cell(0, [{"reward": 1.0, "messages": _agent_turns("Fixed: the loop bound was off by one.",
                                                          "The loop runs one step too far.", "pytest -x café.py")},
                 {"reward": 0.0, "messages": _agent_turns("I could not fix it.", "Maybe the import?", "ls")},
                 {"reward": 0.5, "messages": _agent_turns("Partly fixed.", "", "cat café.py | head")},
                 {"reward": None, "messages": _agent_turns("Done.", "Try again.", "pytest")}]),
        # longer than the case's max_seq_len: keep_head_tail
        cell(1, [{"reward": 1.0, "messages": _agent_turns("ok " * 40, "think " * 30, "echo " + "x" * 80)},
                 {"reward": 0.0, "messages": _agent_turns("no " * 50, "hmm " * 20, "echo y")}]),
        # a harness failure (dropped), a genuine 0/0 (kept), the marker in a real test run (kept)
        cell(2, [{"reward": 0.0, "messages": _agent_turns("Patched.", "", "make"),
                  "reward_breakdown": {"score": 0.0, "tests_passed": 0, "tests_total": 0, "exit_code": 1,
                                       "raw_output": DAEMON_OUTPUT}},
                 {"reward": 0.0, "messages": _agent_turns("Broke the collection.", "", "rm conftest.py"),
                  "reward_breakdown": {"score": 0.0, "tests_passed": 0, "tests_total": 0, "exit_code": 0,
                                       "raw_output": "collection error"}},
                 {"reward": 0.33, "messages": _agent_turns("One of three.", "", "pytest -k one"),
                  "reward_breakdown": {"score": 0.33, "tests_passed": 1, "tests_total": 3, "exit_code": 1,
                                       "raw_output": "2 failed " + DAEMON_OUTPUT}},
                 {"reward": 1.0, "messages": _agent_turns("All pass.", "", "pytest"),
                  "reward_breakdown": {"score": 1.0, "tests_passed": 3, "tests_total": 3, "exit_code": 0,
                                       "raw_output": "3 passed"}}]),
        # every reward equal: no advantage anywhere, the cell scores 0 whatever the model prefers
        cell(3, [{"reward": 1.0, "messages": _agent_turns(f"Variant {i}.", f"idea {i}", f"run {i}")}
                 for i in range(3)]),
        # one rollout: no contrast, 0
        cell(4, [{"reward": 1.0, "messages": _agent_turns("Alone.", "solo", "pytest")}]),
        # longer than the env's default 32 768 tokens
        cell(5, [{"reward": 1.0, "messages": [{"role": "user", "content": "Summarise the log."},
                                              {"role": "assistant", "content": long_text}]},
                 {"reward": 0.0, "messages": [{"role": "user", "content": long_text},
                                              {"role": "assistant", "content": "It is a log."}]}]),
    ]


# (case, task_idx, mask_reasoning, max_seq_len): every rule of the env's scoring has one
GOLDEN_CASES = [("mask_on", 0, True, 32768), ("mask_off", 0, False, 32768), ("truncation", 1, True, 64),
                ("harness_drop", 2, True, 32768), ("zero_std", 3, True, 32768), ("single_rollout", 4, True, 32768),
                ("default_truncation", 5, True, 32768)]
