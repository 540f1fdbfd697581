"""Atomic checkpoints that survive kill -9 (docs/reliability.md).

Layout: `<run>/checkpoints/checkpoint-<step>/` holding `adapter/` (peft format), `value_head.pt`,
`trainer_state.pt` (optimizer, KL controller, curriculum, RNG states, counters) and a
`manifest.json` (sizes + sha256) written last. A checkpoint is built in a `.tmp-*` folder beside
the target, fsynced, renamed into place, and only then are old ones pruned. The newest checkpoint
that verifies is the one to resume: there is no `latest` pointer to go stale (one left by an older
version is removed at the next save). A write that fails (a full disk, a read-only folder, torch's
writer giving up) removes its `.tmp-*` folder, leaves the previous checkpoints as they were and
raises `CheckpointWriteError`, one line. Every reader checks a checkpoint against its manifest before
it loads anything (`check_checkpoint`); a corrupt one is set aside as `corrupt-checkpoint-<step>`,
and a run resumed from an older checkpoint sets the newer ones aside as `abandoned-checkpoint-<step>`:
both outside the pattern that resume and pruning count, so pruning keeps the newest checkpoints of
the branch being trained that verify. `config.json` holds the configuration the run was written
with, for the programs that read it.
"""
from __future__ import annotations

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

from ppo_affine.config import ConfigError
from ppo_affine.file_writes import (WriteFailed, apply_umask, cause, free_space, is_out_of_space, is_write_error,
                                    megabytes)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.json"  # the run's resolved configuration (also inside trainer_state.pt)
SET_ASIDE_PREFIX = "corrupt-"
ABANDONED_PREFIX = "abandoned-"  # newer checkpoints of a branch a resume from an older one left
REPLACED_PREFIX = "replaced-"  # the old copy of a step saved again, until the new copy is in place
LEGACY_POINTER = "latest"  # older versions wrote it; nothing reads it
PPO_KIND = "ppo"  # a checkpoint's kind in its manifest: a PPO run resumes, an SFT warm start (its own kind) does not
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointWriteError(WriteFailed):
    """A checkpoint could not be written (a full disk, a read-only folder, ...); the previous ones are intact."""


class CheckpointError(ConfigError):
    """A checkpoint that is missing, unfinished or corrupt; the message names the file that is wrong."""


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
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    restore_cuda_rng(state.get("cuda", []), visible, torch.cuda.set_rng_state)


def restore_cuda_rng(saved: list[torch.Tensor], visible: int,
                     set_device_state: Callable[[torch.Tensor, int], None]) -> int:
    """Give each visible GPU the state the saving run's GPU of the same index had; returns how many were restored.
    A resume on fewer GPUs (or none) restores what it can, on more the extra GPUs keep their seeded state; either
    way the log says so, since sampling on the GPUs left out no longer repeats the saved run's."""
    restored = min(len(saved), visible)
    for index in range(restored):
        set_device_state(saved[index], index)
    if len(saved) != visible:
        rest = (f"GPUs {restored}..{visible - 1} keep their seeded state" if visible > restored else
                f"the states of GPUs {restored}..{len(saved) - 1} go unused")
        log.warning("the checkpoint holds the CUDA random states of %d GPUs and this process sees %d: restored %d, %s",
                    len(saved), visible, restored, rest)
    return restored


def save_checkpoint(checkpoint_dir: Path, step: int, write_model: Callable[[Path], None],
                    trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint-<step> atomically; returns its path. CheckpointWriteError, one line, when the storage refuses
    any part of the write; the checkpoints already there stay as they were."""
    final = checkpoint_dir / f"checkpoint-{step}"
    tmp = checkpoint_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        _write_files(tmp, step, write_model, trainer_state)
    except BaseException as exc:
        written = _tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space the next attempt needs
        if isinstance(exc, Exception) and is_write_error(exc):
            raise CheckpointWriteError(_write_failure_message(checkpoint_dir, step, written, exc)) from exc
        raise
    try:
        _move_into_place(tmp, final, step)
        (checkpoint_dir / LEGACY_POINTER).unlink(missing_ok=True)
        _fsync_dir(checkpoint_dir)
    except OSError as exc:
        raise CheckpointWriteError(_write_failure_message(checkpoint_dir, step, _tree_bytes(tmp), exc)) from exc
    _VERIFIED[final.resolve()] = _signature(final)  # its hashes were computed from these very files
    _prune(checkpoint_dir, keep_last)
    return final


def _move_into_place(tmp: Path, final: Path, step: int) -> None:
    """Rename the finished folder to checkpoint-<step>. A re-save of a step (e.g. after a resume) first renames the old
    copy to replaced-checkpoint-<step>, outside the `.tmp-*` names that cleaning deletes: a crash between the two
    renames leaves that whole copy, which `clean_temporaries` puts back."""
    if not final.exists():
        os.replace(tmp, final)
        return
    replaced = final.with_name(REPLACED_PREFIX + final.name)
    shutil.rmtree(replaced, ignore_errors=True)  # a copy an earlier crash left, with checkpoint-<step> in place
    os.replace(final, replaced)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def _write_files(tmp: Path, step: int, write_model: Callable[[Path], None], trainer_state: dict[str, Any]) -> None:
    """Everything of one checkpoint into `tmp`, fsynced, the manifest last."""
    tmp.mkdir()
    write_model(tmp)
    torch.save(trainer_state, tmp / STATE_FILE)
    if "config" in trainer_state:  # readable without torch.load, before any model is loaded
        (tmp / CONFIG_FILE).write_text(json.dumps(trainer_state["config"], indent=1) + "\n")
    apply_umask(tmp)  # safetensors writes the adapter 0600
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    entries = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    manifest = {"step": step, "kind": trainer_state.get("kind", PPO_KIND), "files": entries}
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


def _write_failure_message(checkpoint_dir: Path, step: int, written: int, exc: BaseException) -> str:
    """One line: the folder, what failed, the free space and, for a full disk, the space a checkpoint takes (the
    previous one's size, else what got written), so that the fix is obvious."""
    previous = list_checkpoints(checkpoint_dir)
    if previous:
        kept = f"The previous checkpoint {previous[-1][1].name} is intact; resume from it with --resume latest."
    else:
        kept = "No earlier checkpoint exists."
    free = free_space(checkpoint_dir)
    if not is_out_of_space(exc):
        return f"Could not write checkpoint-{step} in {checkpoint_dir} ({cause(exc)}); {free}. {kept}"
    if previous:
        needed = f"about {megabytes(_tree_bytes(previous[-1][1]))} (the size of {previous[-1][1].name})"
    else:
        needed = f"more than the {megabytes(written)} written before the disk filled"
    return (f"Disk full while writing checkpoint-{step} in {checkpoint_dir} ({cause(exc)}): a checkpoint needs "
            f"{needed}, {free}. {kept} Free some space, lower checkpointing.keep_last, or move run.output_dir to a "
            "larger disk.")


def list_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint folder, complete or not, by step."""
    found = []
    for path in checkpoint_dir.iterdir() if checkpoint_dir.is_dir() else []:
        match = CHECKPOINT_RE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _prune(checkpoint_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints that verify; one that does not is set aside, never counted."""
    kept = 0
    for _, path in reversed(list_checkpoints(checkpoint_dir)):
        if kept < keep_last:
            try:
                check_checkpoint(path)
                kept += 1
            except CheckpointError as exc:
                set_aside(path, exc)
            continue
        # renamed first: a kill mid-delete leaves a .tmp- folder (cleaned at the next resume), never a
        # half-deleted checkpoint-N that looks like a checkpoint
        doomed = checkpoint_dir / f".tmp-pruned-{path.name}-{os.getpid()}"
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


# Checkpoints this process has hashed, by folder, with the sizes and times of their files then: pruning after
# every save re-hashes none of the kept ones unless a file changed since.
_VERIFIED: dict[Path, tuple] = {}


def _signature(checkpoint: Path) -> tuple:
    return tuple((str(p.relative_to(checkpoint)), p.stat().st_size, p.stat().st_mtime_ns)
                 for p in sorted(checkpoint.rglob("*")) if p.is_file())


def check_checkpoint(checkpoint: Path, files: Callable[[str], bool] | None = None) -> None:
    """Raise CheckpointError naming the first file that is missing or differs from the manifest (size, then sha256);
    a folder with no manifest is not a checkpoint (an unfinished save, or another kind of folder). `files` picks the
    manifest's entries to check (by their path in the checkpoint); default all."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist (expected a folder "
                              "<run>/checkpoints/checkpoint-<step>).")
    manifest_path = checkpoint / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{checkpoint} is not a finished checkpoint: it has no {MANIFEST}.")
    try:
        signature = _signature(checkpoint)
        if _VERIFIED.get(checkpoint.resolve()) == signature:
            return
        entries = json.loads(manifest_path.read_text())["files"]
        for name, entry in entries.items():
            if files is None or files(name):
                _check_file(checkpoint / name, entry)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path} is unreadable ({type(exc).__name__}: {exc}): the checkpoint "
                              "cannot be checked.") from None
    if files is None:
        _VERIFIED[checkpoint.resolve()] = signature


def _check_file(path: Path, entry: dict[str, Any]) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete.")
    size = path.stat().st_size
    if size != entry["size"]:
        raise CheckpointError(f"{path} is {size:,} bytes where its manifest says {entry['size']:,}: "
                              "the checkpoint is corrupt.")
    if _sha256(path) != entry["sha256"]:
        raise CheckpointError(f"{path} does not match the sha256 in its manifest: the checkpoint is corrupt.")


def verify(checkpoint: Path) -> bool:
    try:
        check_checkpoint(checkpoint)
        return True
    except CheckpointError:
        return False


def _unused_name(path: Path, prefix: str) -> Path:
    """<prefix><name>, or <prefix><name>-k with the first k from 2 that no folder has yet."""
    target, copy = path.with_name(prefix + path.name), 1
    while target.exists():
        copy += 1
        target = path.with_name(f"{prefix}{path.name}-{copy}")
    return target


def set_aside(checkpoint: Path, problem: Exception) -> Path:
    """Rename a bad checkpoint to corrupt-checkpoint-<step>[-k] (kept for inspection, never resumed or counted)."""
    target = _unused_name(checkpoint, SET_ASIDE_PREFIX)
    os.replace(checkpoint, target)
    log.warning("%s: set aside as %s (delete it once you have looked)", problem, target.name)
    return target


def clean_temporaries(checkpoint_dir: Path) -> None:
    """Remove what unfinished saves and prunes left (`.tmp-*`), and put back the old copy of a step whose re-save
    died between its two renames (then no checkpoint-<step> exists)."""
    if not checkpoint_dir.is_dir():
        return
    for path in checkpoint_dir.glob(".tmp-*"):
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed unfinished checkpoint %s", path.name)
    for path in checkpoint_dir.glob(".latest.tmp-*"):  # an older version's pointer, half written
        path.unlink(missing_ok=True)
    for path in checkpoint_dir.glob(REPLACED_PREFIX + "checkpoint-*"):
        original = path.with_name(path.name[len(REPLACED_PREFIX):])
        if original.exists():
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.replace(path, original)
            log.warning("%s was being saved again when the run stopped: its earlier copy is back in place",
                        original.name)


def set_aside_newer(checkpoint_dir: Path, resumed: Path) -> list[Path]:
    """A run resumed from an older checkpoint starts a new branch: rename the checkpoints of later steps to
    abandoned-checkpoint-<step>[-k] (kept, never deleted), so that pruning never counts them and `--resume latest`
    follows the branch being trained. Returns their new paths."""
    resumed_step = int(CHECKPOINT_RE.match(resumed.name).group(1))
    moved = []
    for step, path in list_checkpoints(checkpoint_dir):
        if step <= resumed_step:
            continue
        target = _unused_name(path, ABANDONED_PREFIX)
        os.replace(path, target)
        moved.append(target)
    if moved:
        _fsync_dir(checkpoint_dir)
        log.warning("resuming from %s: the newer %s of the branch it ends set aside as %s (kept; delete them once "
                    "you are sure)", resumed.name, ", ".join(p.name[len(ABANDONED_PREFIX):] for p in moved),
                    ", ".join(p.name for p in moved))
    return moved


def find_resumable(checkpoint_dir: Path, clean: bool = True) -> Path | None:
    """The highest-step checkpoint whose manifest verifies (older ones are the fallback); `clean` removes
    unfinished ones first and sets corrupt ones aside (in data-parallel runs rank 0 alone writes, so it alone
    cleans)."""
    if clean:
        clean_temporaries(checkpoint_dir)
    for step, path in reversed(list_checkpoints(checkpoint_dir)):
        try:
            check_checkpoint(path)
            return path
        except CheckpointError as exc:
            if clean:
                set_aside(path, exc)
            else:
                log.warning("%s", exc)
            log.warning("falling back to an older checkpoint than %s", path.name)
    return None


def checkpoint_holding(path: Path, adapter_only: bool = False) -> Path | None:
    """The checkpoint that `path` is, or sits in (its adapter folder), checked against its manifest before anything
    loads it; None for a bare adapter folder, which has no manifest to check against. `adapter_only` (a program that
    reads the adapter and the configuration alone, e.g. evaluate.py) accepts a checkpoint whose other files (the
    trainer state, the value head) do not verify, with one warning."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist.")
    for candidate in (path, path.parent):
        if (candidate / MANIFEST).is_file():
            try:
                check_checkpoint(candidate)
            except CheckpointError as problem:
                if not adapter_only:
                    raise
                check_checkpoint(candidate, _adapter_and_config(candidate))
                log.warning("%s Its adapter and configuration verify, so it is read all the same (training cannot "
                            "resume from it).", problem)
            return candidate
    return None  # saves are renamed into place whole, so a folder without a manifest was never one of ours


def _adapter_and_config(checkpoint: Path) -> Callable[[str], bool]:
    """The manifest entries a reader of the adapter needs: the adapter folder and where the configuration comes from
    (config.json; trainer_state.pt in checkpoints from before it)."""
    entries = json.loads((checkpoint / MANIFEST).read_text())["files"]
    config = CONFIG_FILE if CONFIG_FILE in entries else STATE_FILE
    return lambda name: name.startswith("adapter/") or name == config


def checkpoint_kind(checkpoint: Path) -> str | None:
    """The kind in the manifest (PPO_KIND, or sft_warmstart's); None for a checkpoint from before manifests named it."""
    return json.loads((Path(checkpoint) / MANIFEST).read_text()).get("kind")


def saved_config(checkpoint: Path) -> dict[str, Any] | None:
    """The configuration a checkpoint was written with ({"train", "env", "curriculum"}), or None for a folder that
    holds none (a bare adapter). Checkpoints from before config.json read it from trainer_state.pt."""
    checkpoint = Path(checkpoint)
    if (checkpoint / CONFIG_FILE).is_file():
        return json.loads((checkpoint / CONFIG_FILE).read_text())
    if (checkpoint / STATE_FILE).is_file():
        return load_trainer_state(checkpoint).get("config")
    return None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)
