"""Checkpoint writes that fail (a full disk leaves the previous checkpoint loadable and says what it needed) and
checkpoints gone bad: every reader checks the manifest, names the bad file, and sets a corrupt one aside."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from ppo_affine import checkpoint
from ppo_affine.checkpoint import (
    CONFIG_FILE, STATE_FILE, CheckpointError, CheckpointWriteError, check_checkpoint, checkpoint_holding,
    checkpoint_kind, find_resumable, load_trainer_state, save_checkpoint, saved_config, set_aside_newer, verify,
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
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-1"]  # partial folder removed
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


def torch_writer_fails(obj, path):
    """torch.save on a disk that filled mid-file: its zip writer raises a RuntimeError, not an OSError."""
    Path(path).write_bytes(b"s" * 1000)
    raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                       "data/0: file write failed")


def raises(error: OSError):
    def write_model(folder: Path) -> None:
        raise error

    return write_model


def assert_one_line_and_the_last_checkpoint_resumable(checkpoints: Path, message: str) -> None:
    assert len(message.splitlines()) == 1
    assert "free there" in message and "checkpoint-1 is intact" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-1"]  # no partial folder left
    assert find_resumable(checkpoints) == checkpoints / "checkpoint-1"
    assert load_trainer_state(checkpoints / "checkpoint-1") == {"step": 1}


def test_torch_writers_runtime_error_is_a_checkpoint_write_error_naming_the_folder(tmp_path, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    save_checkpoint(checkpoints, 1, write_weights(100), {"step": 1}, keep_last=3)
    monkeypatch.setattr(checkpoint.torch, "save", torch_writer_fails)
    with pytest.raises(CheckpointWriteError) as raised:
        save_checkpoint(checkpoints, 2, write_weights(100), {"step": 2}, keep_last=3)
    message = str(raised.value)
    assert message.startswith(f"Could not write checkpoint-2 in {checkpoints} ([enforce fail at inline_container.cc:672]")
    assert "file write failed" in message
    assert_one_line_and_the_last_checkpoint_resumable(checkpoints, message)


@pytest.mark.parametrize("code,reason", [(errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied"),
                                         (errno.ENOSPC, "No space left on device")])
def test_every_os_write_error_is_one_line_with_the_free_space(tmp_path, code, reason):
    checkpoints = tmp_path / "checkpoints"
    save_checkpoint(checkpoints, 1, write_weights(100), {"step": 1}, keep_last=3)
    with pytest.raises(CheckpointWriteError) as raised:
        save_checkpoint(checkpoints, 2, raises(OSError(code, reason)), {"step": 2}, keep_last=3)
    message = str(raised.value)
    assert f"checkpoint-2 in {checkpoints} ({reason})" in message
    assert_one_line_and_the_last_checkpoint_resumable(checkpoints, message)


def test_a_checkpoint_folder_under_a_regular_file_is_one_line(tmp_path):
    (tmp_path / "run").write_text("a file where the run folder should be")
    with pytest.raises(CheckpointWriteError) as raised:
        save_checkpoint(tmp_path / "run" / "checkpoints", 1, write_weights(10), {"step": 1}, keep_last=3)
    message = str(raised.value)
    assert len(message.splitlines()) == 1 and str(tmp_path / "run" / "checkpoints") in message
    assert "Not a directory" in message or "File exists" in message
    assert "free there" in message and "No earlier checkpoint exists" in message


def test_written_files_get_the_modes_of_the_umask(tmp_path):
    def write_0600(folder: Path) -> None:  # as safetensors writes the adapter
        (folder / "adapter").mkdir()
        weights = folder / "adapter" / "adapter_model.safetensors"
        weights.write_bytes(b"w")
        weights.chmod(0o600)

    saved = save_checkpoint(tmp_path, 1, write_0600, {"step": 1}, keep_last=3)
    mask = os.umask(0o022)
    os.umask(mask)
    assert oct(os.stat(saved / "adapter" / "adapter_model.safetensors").st_mode & 0o777) == oct(0o666 & ~mask)
    assert oct(os.stat(saved / STATE_FILE).st_mode & 0o777) == oct(0o666 & ~mask)
    assert oct(os.stat(saved).st_mode & 0o777) == oct(0o777 & ~mask)


def test_no_latest_pointer_is_written_and_an_old_one_is_removed(tmp_path):
    (tmp_path / "latest").write_text("checkpoint-9\n")  # left by an older version, now stale
    save_checkpoint(tmp_path, 1, write_weights(10), {"step": 1}, keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_a_crash_between_the_two_renames_of_a_resave_keeps_a_copy_of_the_step(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 4, write_weights(100), {"step": 4}, keep_last=3)
    original, renames = os.replace, []

    def killed_at_the_second_rename(source, target):
        renames.append(Path(source).name)
        if len(renames) == 2:
            raise KeyboardInterrupt  # stands in for kill -9: nothing after this line runs
        original(source, target)

    monkeypatch.setattr(checkpoint.os, "replace", killed_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 4, write_weights(100), {"step": 4, "again": True}, keep_last=3)
    monkeypatch.setattr(checkpoint.os, "replace", original)
    assert renames[0] == "checkpoint-4" and renames[1].startswith(".tmp-checkpoint-4-")
    assert not (tmp_path / "checkpoint-4").exists()  # the moment between the renames
    assert find_resumable(tmp_path) == tmp_path / "checkpoint-4"  # the old copy is put back, not deleted
    assert load_trainer_state(tmp_path / "checkpoint-4") == {"step": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


def test_a_resave_replaces_the_step_and_leaves_nothing_beside_it(tmp_path):
    save_checkpoint(tmp_path, 4, write_weights(100), {"step": 4}, keep_last=3)
    save_checkpoint(tmp_path, 4, write_weights(100), {"step": 4, "again": True}, keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert load_trainer_state(tmp_path / "checkpoint-4") == {"step": 4, "again": True}


def test_resuming_from_an_older_checkpoint_sets_the_newer_branch_aside(tmp_path):
    """Resumed from 1000 of {1000, 1500, 1700}: the newer two are renamed, never deleted; the saves of the new branch
    then prune only their own, and the newest checkpoint is the new branch's."""
    for step in (1000, 1500, 1700):
        save_checkpoint(tmp_path, step, write_weights(10), {"step": step}, keep_last=3)
    moved = set_aside_newer(tmp_path, tmp_path / "checkpoint-1000")
    assert [p.name for p in moved] == ["abandoned-checkpoint-1500", "abandoned-checkpoint-1700"]
    for step in (1500, 1600):
        save_checkpoint(tmp_path, step, write_weights(10), {"step": step, "branch": 2}, keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "abandoned-checkpoint-1500", "abandoned-checkpoint-1700", "checkpoint-1000", "checkpoint-1500",
        "checkpoint-1600"]
    assert find_resumable(tmp_path) == tmp_path / "checkpoint-1600"
    assert load_trainer_state(tmp_path / "abandoned-checkpoint-1700") == {"step": 1700}


def test_a_second_abandoned_branch_is_kept_beside_the_first(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, write_weights(10), {"step": step}, keep_last=3)
    set_aside_newer(tmp_path, tmp_path / "checkpoint-1")
    save_checkpoint(tmp_path, 2, write_weights(10), {"step": 2, "branch": 2}, keep_last=3)
    set_aside_newer(tmp_path, tmp_path / "checkpoint-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "abandoned-checkpoint-2", "abandoned-checkpoint-2-2", "checkpoint-1"]
    assert set_aside_newer(tmp_path, tmp_path / "checkpoint-1") == []  # resuming from the newest moves nothing


def test_an_adapter_reader_accepts_a_checkpoint_whose_trainer_state_is_corrupt_with_one_warning(tmp_path, caplog):
    def write_adapter(folder: Path) -> None:
        (folder / "adapter").mkdir()
        (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"w" * 100)

    config = {"train": {}, "env": {}, "curriculum": {}}
    saved = save_checkpoint(tmp_path, 5, write_adapter, {"step": 5, "config": config}, keep_last=3)
    truncate(saved / STATE_FILE, 10)
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt is 10 bytes"):
        checkpoint_holding(saved)  # training (and --init-adapter) refuses it as before
    with caplog.at_level("WARNING"):
        assert checkpoint_holding(saved, adapter_only=True) == saved
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "trainer_state.pt is 10 bytes" in warning and "Its adapter and configuration verify" in warning
    truncate(saved / "adapter" / "adapter_model.safetensors", 3)
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors is 3 bytes"):
        checkpoint_holding(saved, adapter_only=True)


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "corrupt-checkpoint-6"]

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
