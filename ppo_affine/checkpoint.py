"""Atomic checkpoints that survive kill -9 (see RELIABILITY.md).

Layout: `<run>/checkpoints/checkpoint-<step>/` holding `adapter/` (peft format), `value_head.pt`,
`trainer_state.pt` (optimizer, KL controller, curriculum, RNG states, counters) and a
`manifest.json` (sizes + sha256) written last. A checkpoint is built in a `.tmp-*` folder beside
the target, fsynced, renamed into place, and only then is `latest` updated and old ones pruned.
A write that fails (a full disk above all) removes its `.tmp-*` folder and leaves the previous
checkpoints as they were.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.pt"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (the disk is full); the previous ones are intact."""


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for path in [*sorted(p for p in folder.rglob("*") if p.is_dir()), folder]:
        _fsync_dir(path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(checkpoint_dir: Path, step: int, write_model: Callable[[Path], None],
                    trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint-<step> atomically; returns its path. CheckpointWriteError when the disk is full."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / f"checkpoint-{step}"
    tmp = checkpoint_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _write_files(tmp, step, write_model, trainer_state)
    except BaseException as exc:
        written = _tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space the next attempt needs
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            raise CheckpointWriteError(_disk_full_message(checkpoint_dir, step, written, exc)) from exc
        raise
    if final.exists():  # a re-save of the same step (e.g. after resume): move the old one aside first
        stale = checkpoint_dir / f".tmp-stale-{step}-{os.getpid()}"
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(checkpoint_dir)
    pointer_tmp = checkpoint_dir / f".latest.tmp-{os.getpid()}"
    pointer_tmp.write_text(final.name + "\n")
    with open(pointer_tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(pointer_tmp, checkpoint_dir / "latest")
    _fsync_dir(checkpoint_dir)
    _prune(checkpoint_dir, keep_last)
    return final


def _write_files(tmp: Path, step: int, write_model: Callable[[Path], None], trainer_state: dict[str, Any]) -> None:
    """Everything of one checkpoint into `tmp`, fsynced, the manifest last."""
    tmp.mkdir()
    write_model(tmp)
    torch.save(trainer_state, tmp / STATE_FILE)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {"step": step, "files": {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                                        for p in files}}
    _fsync_tree(tmp)
    with open(tmp / MANIFEST, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _tree_bytes(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0


def _disk_full_message(checkpoint_dir: Path, step: int, written: int, exc: OSError) -> str:
    """Names the folder, the space a checkpoint takes (the previous one's size, else what got written)
    and what is free, so that the fix is obvious."""
    previous = list_checkpoints(checkpoint_dir)
    if previous:
        needed = f"about {_megabytes(_tree_bytes(previous[-1][1]))} (the size of {previous[-1][1].name})"
        kept = f"The previous checkpoint {previous[-1][1].name} is intact; resume from it with --resume latest."
    else:
        needed = f"more than the {_megabytes(written)} written before the disk filled"
        kept = "No earlier checkpoint exists."
    try:
        free = _megabytes(shutil.disk_usage(checkpoint_dir).free)
    except OSError:
        free = "unknown"
    return (f"Disk full while writing checkpoint-{step} in {checkpoint_dir} ({exc.strerror}): a checkpoint needs "
            f"{needed}, {free} is free there. {kept} Free some space, lower checkpointing.keep_last, or move "
            "run.output_dir to a larger disk.")


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def list_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint folder, complete or not, by step."""
    found = []
    for path in checkpoint_dir.iterdir() if checkpoint_dir.is_dir() else []:
        match = CHECKPOINT_RE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _prune(checkpoint_dir: Path, keep_last: int) -> None:
    for _, path in list_checkpoints(checkpoint_dir)[:-keep_last]:
        # renamed first: a kill mid-delete leaves a .tmp- folder (cleaned at the next resume), never a
        # half-deleted checkpoint-N that looks like a checkpoint
        doomed = checkpoint_dir / f".tmp-pruned-{path.name}-{os.getpid()}"
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def verify(checkpoint: Path) -> bool:
    manifest_path = checkpoint / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        for name, entry in manifest["files"].items():
            path = checkpoint / name
            if path.stat().st_size != entry["size"] or _sha256(path) != entry["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError):
        return False


def clean_temporaries(checkpoint_dir: Path) -> None:
    for path in checkpoint_dir.glob(".tmp-*") if checkpoint_dir.is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed unfinished checkpoint %s", path.name)
    for path in checkpoint_dir.glob(".latest.tmp-*") if checkpoint_dir.is_dir() else []:
        path.unlink(missing_ok=True)


def find_resumable(checkpoint_dir: Path, clean: bool = True) -> Path | None:
    """The highest-step checkpoint whose manifest verifies (older ones are the fallback); `clean` removes
    unfinished ones first (in data-parallel runs rank 0 alone writes, so it alone cleans)."""
    if clean:
        clean_temporaries(checkpoint_dir)
    for step, path in reversed(list_checkpoints(checkpoint_dir)):
        if verify(path):
            return path
        log.warning("checkpoint %s is incomplete or corrupt; falling back to an older one", path.name)
    return None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)
