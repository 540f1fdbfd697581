"""Checkpoint writes that fail: a full disk leaves the previous checkpoint loadable and says what it needed."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ppo_affine import checkpoint
from ppo_affine.checkpoint import CheckpointWriteError, find_resumable, load_trainer_state, save_checkpoint, verify


def write_weights(size: int):
    def write_model(folder: Path) -> None:
        (folder / "adapter.bin").write_bytes(b"w" * size)

    return write_model


def disk_fills_after(size: int):
    """A model writer that writes `size` bytes, then finds the disk full."""

    def write_model(folder: Path) -> None:
        (folder / "adapter.bin").write_bytes(b"w" * size)
        raise OSError(errno.ENOSPC, "No space left on device")

    return write_model


def test_disk_full_keeps_the_previous_checkpoint_and_names_the_folder_and_the_size(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    save_checkpoint(checkpoints, 1, write_weights(3_000_000), {"step": 1}, keep_last=3)

    with pytest.raises(CheckpointWriteError) as raised:
        save_checkpoint(checkpoints, 2, disk_fills_after(1_000_000), {"step": 2}, keep_last=3)

    message = str(raised.value)
    assert f"Disk full while writing checkpoint-2 in {checkpoints} (No space left on device)" in message
    assert "a checkpoint needs about 3.0 MB (the size of checkpoint-1)" in message
    assert "checkpoint-1 is intact" in message and "checkpointing.keep_last" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-1", "latest"]  # partial folder removed
    assert (checkpoints / "latest").read_text() == "checkpoint-1\n"
    assert find_resumable(checkpoints) == checkpoints / "checkpoint-1"
    assert verify(checkpoints / "checkpoint-1")
    assert load_trainer_state(checkpoints / "checkpoint-1") == {"step": 1}


def test_disk_full_on_the_first_checkpoint_reports_what_was_written(tmp_path, monkeypatch):
    def full_disk_save(obj, path):
        Path(path).write_bytes(b"s" * 500_000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk_save)
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(CheckpointWriteError,
                       match=r"needs more than the 2\.5 MB written before the disk filled.*No earlier checkpoint"):
        save_checkpoint(checkpoints, 5, write_weights(2_000_000), {"step": 5}, keep_last=3)
    assert list(checkpoints.iterdir()) == []
    assert find_resumable(checkpoints) is None


def test_a_disk_full_resave_of_the_same_step_keeps_the_old_copy(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    save_checkpoint(checkpoints, 4, write_weights(1000), {"step": 4}, keep_last=3)
    with pytest.raises(CheckpointWriteError):
        save_checkpoint(checkpoints, 4, disk_fills_after(10), {"step": 4, "again": True}, keep_last=3)
    assert load_trainer_state(find_resumable(checkpoints)) == {"step": 4}


def test_other_write_errors_pass_through_unchanged_and_leave_no_partial_folder(tmp_path):
    def denied(folder: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(PermissionError):
        save_checkpoint(checkpoints, 1, denied, {"step": 1}, keep_last=3)
    assert list(checkpoints.iterdir()) == []

