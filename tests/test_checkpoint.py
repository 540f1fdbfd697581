"""Checkpoint writes that fail (a full disk leaves the previous checkpoint loadable and says what it needed) and
checkpoints gone bad: every reader checks the manifest, names the bad file, and sets a corrupt one aside."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from ppo_affine import checkpoint
from ppo_affine.checkpoint import (
    CONFIG_FILE, STATE_FILE, CheckpointError, CheckpointWriteError, check_checkpoint, checkpoint_holding,
    checkpoint_kind, find_resumable, load_trainer_state, save_checkpoint, saved_config, verify,
)


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



def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


def test_a_truncated_file_is_named_with_its_size_and_the_manifests(tmp_path):
    saved = save_checkpoint(tmp_path, 6, write_weights(3000), {"step": 6}, keep_last=3)
    truncate(saved / "adapter.bin", 1000)
    with pytest.raises(CheckpointError) as raised:
        check_checkpoint(saved)
    assert str(raised.value) == (f"{saved / 'adapter.bin'} is 1,000 bytes where its manifest says 3,000: "
                                 "the checkpoint is corrupt.")


def test_a_changed_byte_a_missing_file_and_a_missing_manifest_are_each_named(tmp_path):
    saved = save_checkpoint(tmp_path, 1, write_weights(3000), {"step": 1}, keep_last=3)
    (saved / "adapter.bin").write_bytes(b"x" * 3000)
    with pytest.raises(CheckpointError, match=r"adapter\.bin does not match the sha256 in its manifest"):
        check_checkpoint(saved)
    (saved / "adapter.bin").unlink()
    with pytest.raises(CheckpointError, match=r"adapter\.bin is missing: the checkpoint is incomplete"):
        check_checkpoint(saved)
    (saved / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"is not a finished checkpoint: it has no manifest\.json"):
        check_checkpoint(saved)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        check_checkpoint(tmp_path / "checkpoint-9")


def test_resume_sets_a_corrupt_newest_checkpoint_aside_and_pruning_keeps_the_good_one(tmp_path):
    """The scenario that lost a run: checkpoint-6 corrupt, resume falls back to checkpoint-3, and the saves after
    it must never delete checkpoint-3 while keeping the corrupt one."""
    for step in (3, 6):
        save_checkpoint(tmp_path, step, write_weights(2000), {"step": step}, keep_last=2)
    truncate(tmp_path / "checkpoint-6" / STATE_FILE, 10)

    assert find_resumable(tmp_path) == tmp_path / "checkpoint-3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "corrupt-checkpoint-6", "latest"]

    save_checkpoint(tmp_path, 4, write_weights(2000), {"step": 4}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "checkpoint-3", "checkpoint-4", "corrupt-checkpoint-6"]
    save_checkpoint(tmp_path, 5, write_weights(2000), {"step": 5}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "checkpoint-4", "checkpoint-5", "corrupt-checkpoint-6"]  # the set-aside one is never counted among the kept


def test_pruning_counts_only_checkpoints_that_verify(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, write_weights(2000), {"step": step}, keep_last=2)
    truncate(tmp_path / "checkpoint-2" / "adapter.bin", 5)  # goes bad on disk after it was written
    save_checkpoint(tmp_path, 3, write_weights(2000), {"step": 3}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "checkpoint-1", "checkpoint-3", "corrupt-checkpoint-2"]
    assert find_resumable(tmp_path) == tmp_path / "checkpoint-3"


def test_a_second_corrupt_copy_of_a_step_is_set_aside_beside_the_first(tmp_path):
    for _ in range(2):
        saved = save_checkpoint(tmp_path, 2, write_weights(100), {"step": 2}, keep_last=3)
        truncate(saved / "adapter.bin", 1)
        assert find_resumable(tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["corrupt-checkpoint-2", "corrupt-checkpoint-2-2"]


def test_a_reader_of_another_rank_warns_but_leaves_the_folder_where_it_is(tmp_path):
    saved = save_checkpoint(tmp_path, 2, write_weights(100), {"step": 2}, keep_last=3)
    truncate(saved / "adapter.bin", 1)
    assert find_resumable(tmp_path, clean=False) is None
    assert saved.is_dir()


def test_the_checkpoint_holding_an_adapter_folder_is_checked_and_a_bare_adapter_is_not(tmp_path):
    def write_adapter(folder: Path) -> None:
        (folder / "adapter").mkdir()
        (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"w" * 100)

    saved = save_checkpoint(tmp_path / "checkpoints", 5, write_adapter, {"step": 5, "kind": "sft-warmstart"}, 3)
    assert checkpoint_holding(saved / "adapter") == saved and checkpoint_holding(saved) == saved
    assert checkpoint_kind(saved) == "sft-warmstart"
    truncate(saved / "adapter" / "adapter_model.safetensors", 3)
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors is 3 bytes"):
        checkpoint_holding(saved / "adapter")
    bare = tmp_path / "bare"
    bare.mkdir()
    assert checkpoint_holding(bare) is None
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_holding(tmp_path / "nowhere")


def test_the_saved_configuration_is_readable_without_torch_load(tmp_path):
    config = {"train": {"model": {"name_or_path": "m"}}, "env": {}, "curriculum": {}}
    saved = save_checkpoint(tmp_path, 1, write_weights(10), {"step": 1, "config": config}, keep_last=3)
    assert json.loads((saved / CONFIG_FILE).read_text()) == config
    assert saved_config(saved) == config
    assert checkpoint_kind(saved) == "ppo"
    (saved / CONFIG_FILE).unlink()  # a checkpoint from before config.json: read from trainer_state.pt
    assert saved_config(saved) == config


def test_a_resume_on_fewer_gpus_restores_the_states_of_the_gpus_it_has_and_says_so(caplog):
    saved = [torch.full((4,), index, dtype=torch.uint8) for index in range(8)]  # an 8-GPU run's CUDA states
    given = []
    restored = checkpoint.restore_cuda_rng(saved, 2, lambda state, index: given.append((index, state[0].item())))
    assert restored == 2 and given == [(0, 0), (1, 1)]
    assert ("the checkpoint holds the CUDA random states of 8 GPUs and this process sees 2: restored 2, the states "
            "of GPUs 2..7 go unused") in caplog.text


def test_a_resume_on_more_gpus_restores_the_saved_ones_and_the_others_keep_their_seeded_state(caplog):
    given = []
    restored = checkpoint.restore_cuda_rng([torch.zeros(4, dtype=torch.uint8)], 4,
                                           lambda state, index: given.append(index))
    assert restored == 1 and given == [0]
    assert "restored 1, GPUs 1..3 keep their seeded state" in caplog.text


def test_a_resume_on_as_many_gpus_restores_every_state_without_a_warning(caplog):
    given = []
    assert checkpoint.restore_cuda_rng([torch.zeros(4, dtype=torch.uint8)] * 2, 2,
                                       lambda state, index: given.append(index)) == 2
    assert given == [0, 1] and caplog.text == ""


def test_a_cpu_checkpoint_resumed_on_a_cpu_restores_the_cpu_generators_and_logs_nothing(caplog):
    state = checkpoint.rng_state()
    expected = torch.rand(3)
    torch.rand(5)
    checkpoint.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected) and caplog.text == ""
