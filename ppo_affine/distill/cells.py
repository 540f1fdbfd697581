"""DISTILL-V2 cells: the published teacher rollouts the env scores a model against, read into typed cells.

A cell is N rollouts of one teacher on one task. The publisher writes them as an append-only index and one
immutable parquet shard per cell:

    {base}/manifest.jsonl                  one JSON object a line: task_idx, env_name, task_id, teacher_name, ...
    {base}/tasks/{task_idx:08d}.parquet    one row per rollout; the trajectory is zstd-compressed JSON

`base` is an HTTP(S) URL (each shard downloaded once into a cache folder: shards never change; a bucket without a
manifest lists its cells in metadata.json) or a local folder with the same layout (a folder without a manifest:
every shard under tasks/). A shard that is missing or cannot be
read is skipped with one warning line; so is a cell whose trajectories do not decode (the env fails the whole cell
then). The rollouts the env drops as harness failures are dropped here the same way, before anything else.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

# The env's own default (affinetes environments/distill-v2/env.py): the public bucket miners read.
PUBLIC_BUCKET = "https://pub-f6e8aaa82d31450daad5b16e3ca040b1.r2.dev"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "ppo-affine" / "distill-v2"
MANIFEST = "manifest.jsonl"
METADATA = "metadata.json"  # {"tasks": {"completed_up_to": N, ...}}: the cheap index the env itself reads
# A grader whose `docker exec` met a dead sandbox reports the daemon's error as its test output: the reward of such
# a rollout says nothing about the trajectory, so the env drops it (when no test ran) before the z-scores.
DAEMON_ERROR_MARKER = "Error response from daemon"


# every rollout is scored whatever its status; the env only refuses a status it does not know
STATUSES = {"ok", "parse_failed", "truncated", "env_error", "teacher_error"}


def shard_key(task_idx: int) -> str:
    return f"tasks/{task_idx:08d}.parquet"


# ---------------------------------------------------------------------- the trajectory inside a row
class _Frozen(BaseModel):
    # extra="forbid" as the env's models: a trajectory with fields the env does not know fails there too
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolCall(_Frozen):
    id: str
    name: str
    arguments: dict[str, Any]
    malformed: bool = False


class Message(_Frozen):
    """One message of a trajectory; an assistant message may carry text, reasoning and tool calls at once."""
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None


class Trajectory(_Frozen):
    schema_version: str
    messages: list[Message]
    reward_breakdown: dict[str, Any] = Field(default_factory=dict)
    agent_trace: list[dict[str, Any]] | None = None
    teacher_meta: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class Rollout:
    rollout_id: str
    sample_idx: int
    status: str  # one of STATUSES
    reward: float | None  # None: no advantage (0), but the rollout is still scored
    messages: tuple[Message, ...]
    reward_breakdown: dict[str, Any]


@dataclass(frozen=True)
class Cell:
    task_idx: int  # the env's task_id argument: the shard's index in the manifest
    env_name: str
    task_id: int  # the task inside the teacher's env
    teacher_name: str
    rollouts: tuple[Rollout, ...]
    harness_dropped: int  # rows the env leaves out as harness failures


# ---------------------------------------------------------------------- decoding
def decompress_json(blob: bytes) -> Any:
    import zstandard

    # the publisher's frames may not record their size, which zstandard's one-shot decompress needs: stream it
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)) as reader:
        return json.loads(reader.read())


def is_harness_failure(breakdown: dict[str, Any]) -> bool:
    """No test ran (tests_total 0 or absent) and the test output is the Docker daemon's error."""
    if breakdown.get("tests_total") not in (0, None):
        return False
    return DAEMON_ERROR_MARKER in str(breakdown.get("raw_output") or "")


def harness_breakdown(blob: bytes) -> dict[str, Any] | None:
    """The trajectory's reward_breakdown as the env's harness filter reads it; None when the blob does not decode
    (the env keeps such a row, and fails the cell when it renders it)."""
    try:
        return (decompress_json(blob) or {}).get("reward_breakdown") or {}
    except Exception:  # noqa: BLE001 - any undecodable blob is kept, as the env keeps it
        return None


def cell_from_table(table, task_idx: int) -> Cell:
    """A shard's rows (a pyarrow table) as a cell, harness failures dropped."""
    rows = table.to_pylist()
    kept = [row for row in rows if not is_harness_failure(harness_breakdown(row["extra_compressed"]) or {})]
    rollouts = []
    for row in kept:
        if row["status"] not in STATUSES:  # the env's enum refuses it, failing the cell
            raise ValueError(f"rollout {row['rollout_id']} has status {row['status']!r}, not one of {sorted(STATUSES)}")
        try:
            trajectory = Trajectory.model_validate(decompress_json(row["extra_compressed"]))
        except Exception as exc:  # noqa: BLE001 - zstd, JSON or schema: the env fails the cell on any of them
            raise ValueError(f"rollout {row['rollout_id']}'s trajectory does not decode: {exc}") from None
        rollouts.append(Rollout(
            rollout_id=str(row["rollout_id"]), sample_idx=int(row["sample_idx"]), status=str(row["status"]),
            reward=None if row["reward"] is None else float(row["reward"]), messages=tuple(trajectory.messages),
            reward_breakdown=trajectory.reward_breakdown))
    first = rows[0] if rows else {}
    return Cell(task_idx=task_idx, env_name=str(first.get("env_name", "")), task_id=int(first.get("task_id", -1)),
                teacher_name=str(first.get("teacher_name", "")), rollouts=tuple(rollouts),
                harness_dropped=len(rows) - len(kept))


# ---------------------------------------------------------------------- where the bytes come from
def is_url(source: str | Path) -> bool:
    return str(source).startswith(("http://", "https://"))


class _Source:
    """Bytes of `manifest.jsonl` / `tasks/…parquet` under a base URL (cached in a folder) or a local folder."""

    def __init__(self, source: str | Path, cache_dir: Path | None, timeout_s: float):
        self.source = str(source).rstrip("/")
        self.remote = is_url(source)
        self.timeout_s = timeout_s
        if self.remote:
            # one folder per base URL, so two buckets never share a task index's file
            slug = re.sub(r"[^A-Za-z0-9]+", "-", self.source.split("://", 1)[1])[:60]
            digest = hashlib.sha256(self.source.encode()).hexdigest()[:8]
            self.folder = Path(cache_dir or DEFAULT_CACHE_DIR) / f"{slug}-{digest}"
        else:
            self.folder = Path(self.source)
            if not self.folder.is_dir():
                raise FileNotFoundError(f"{self.folder} is neither an http(s) URL nor a folder")

    def manifest_text(self) -> str | None:
        """The manifest (fetched anew each time from a URL: it grows); None when there is none."""
        if not self.remote:
            path = self.folder / MANIFEST
            return path.read_text() if path.is_file() else None
        response = httpx.get(f"{self.source}/{MANIFEST}", timeout=self.timeout_s, follow_redirects=True)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.text

    def published_count(self) -> int:
        """A bucket without a manifest: its metadata.json says how many cells are public (`completed_up_to`, else
        the publisher's `staged_up_to` or `total`); their task indices are 0 .. count - 1."""
        response = httpx.get(f"{self.source}/{METADATA}", timeout=self.timeout_s, follow_redirects=True)
        response.raise_for_status()
        tasks = response.json().get("tasks") or {}
        staged = tasks.get("staged_up_to") if tasks.get("staged_up_to") is not None else tasks.get("total", 0)
        return int(tasks.get("completed_up_to", staged))

    def shard_path(self, task_idx: int) -> Path:
        """The shard's local file, downloaded into the cache first when the source is a URL."""
        path = self.folder / shard_key(task_idx)
        if self.remote and not path.is_file():
            response = httpx.get(f"{self.source}/{shard_key(task_idx)}", timeout=self.timeout_s,
                                 follow_redirects=True)
            response.raise_for_status()
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".part{os.getpid()}")
            partial.write_bytes(response.content)
            partial.replace(path)  # a reader never sees half a shard
        return path

    def listed_task_indices(self) -> list[int]:
        text = self.manifest_text()
        if text is None and self.remote:
            return list(range(self.published_count()))
        if text is None:
            return sorted(int(p.stem) for p in (self.folder / "tasks").glob("*.parquet") if p.stem.isdigit())
        entries = [json.loads(line) for line in text.splitlines() if line.strip()]
        return sorted({int(entry["task_idx"]) for entry in entries})


# ---------------------------------------------------------------------- the reader
def read_cells(source: str | Path, cache_dir: Path | None = None, task_indices: list[int] | None = None,
               limit: int | None = None, timeout_s: float = 60.0) -> list[Cell]:
    """The cells under `source` (a base URL or a local folder) in task-index order: `task_indices` if given, else
    every cell the manifest lists (the first `limit` of them). Unreadable shards are skipped with one line each."""
    import pyarrow.parquet as pq

    where = _Source(source, cache_dir, timeout_s)
    wanted = sorted(task_indices) if task_indices is not None else where.listed_task_indices()
    if limit is not None:
        wanted = wanted[:limit]
    cells = []
    for task_idx in wanted:
        try:
            path = where.shard_path(task_idx)
            cell = cell_from_table(pq.read_table(path), task_idx)
        except httpx.HTTPError as exc:
            log.warning("distill cell %d skipped: %s could not be fetched (%s)", task_idx, shard_key(task_idx), exc)
            continue
        except FileNotFoundError:
            log.warning("distill cell %d skipped: %s is missing", task_idx, where.folder / shard_key(task_idx))
            continue
        except (ValidationError, ValueError, KeyError, OSError) as exc:  # pyarrow's errors are ValueError/OSError
            if where.remote:  # a cached copy that does not read is fetched anew next time
                (where.folder / shard_key(task_idx)).unlink(missing_ok=True)
            log.warning("distill cell %d skipped: %s does not read as a cell (%s: %s)", task_idx,
                        shard_key(task_idx), type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            continue
        if not cell.rollouts:
            log.warning("distill cell %d skipped: no rollouts left after %d harness failures", task_idx,
                        cell.harness_dropped)
            continue
        cells.append(cell)
    return cells


def read_cells_for(option: str, source: str | Path, cache_dir: Path | None = None, limit: int | None = None
                   ) -> list[Cell]:
    """`read_cells` for a program's option or config field named `option`: a source that cannot be read, or that
    holds no readable cell, is one ConfigError line naming it."""
    from ppo_affine.config import ConfigError

    try:
        cells = read_cells(source, cache_dir, limit=limit)
    except (OSError, httpx.HTTPError, ValueError) as exc:
        raise ConfigError(f"{option} {source}: cannot read the cells ({exc})") from None
    if not cells:
        raise ConfigError(f"{option} {source}: no cell could be read (see the lines above).")
    return cells
