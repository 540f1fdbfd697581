"""Writing the files a run keeps: a failed write (a full disk, a read-only or unwritable folder, a path under a regular
file, whatever exception torch's writer or the OS raises) becomes one `WriteFailed` line that names the path, what
failed and the free space there; a probe finds an unwritable folder before slow work; written files get the modes
the umask gives (some writers, safetensors among them, create theirs 0600)."""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# torch.save reports a failed write as a RuntimeError from its zip writer, not as an OSError
_TORCH_WRITER_MARKERS = ("inline_container", "PytorchStreamWriter", "file write failed")
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class WriteFailed(RuntimeError):
    """A file or folder could not be written; the message is one line naming the path, the cause and the free
    space."""


def is_write_error(exc: BaseException) -> bool:
    """An exception a write raises when the storage refuses it (as opposed to a bug in what is written)."""
    if isinstance(exc, OSError):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _TORCH_WRITER_MARKERS)


def free_space(path: Path) -> str:
    """Free space on the disk holding `path` (its nearest existing folder), e.g. '1.2 GB free there'."""
    place = Path(path).absolute()
    while not place.is_dir() and place != place.parent:
        place = place.parent
    try:
        return f"{megabytes(shutil.disk_usage(place).free)} free there"
    except OSError:
        return "free space unknown"


def megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def cause(exc: BaseException) -> str:
    """What failed, in a few words: the OS's reason, or the first line of torch's writer message."""
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ENOTDIR or (exc.errno == errno.EEXIST and exc.filename
                                           and Path(exc.filename).is_file()):
            reason += " (a file stands where a folder is needed)"
        return reason
    return " ".join(str(exc).split())[:300]


def write_failure(what: str, path: Path, exc: BaseException) -> str:
    """'Could not write <what> <path>: <cause>; <free space>.'"""
    where = exc.filename if isinstance(exc, OSError) and exc.filename else path
    return f"Could not write {what} {where}: {cause(exc)}; {free_space(Path(path))}."


@contextmanager
def writing(what: str, path: Path) -> Iterator[None]:
    """Turn a failed write inside the block into WriteFailed naming `what` and `path`."""
    try:
        yield
    except WriteFailed:
        raise
    except Exception as exc:
        if not is_write_error(exc):
            raise
        raise WriteFailed(write_failure(what, path, exc)) from exc


def probe_writable(folder: Path, what: str) -> None:
    """Create `folder` (and its parents) and write, fsync and remove a small file in it, so that a read-only disk, a
    folder this user may not write, a full disk or a file in the way is reported before anything slow starts."""
    probe = Path(folder) / f".write-probe-{os.getpid()}"
    with writing(what, Path(folder)):
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"probe")
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()


def is_out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _SPACE_ERRNOS


def umask() -> int:
    """This process's umask, read without changing it where Linux shows it (os.umask alone must set one)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give every file and folder under `folder` (itself included) the mode a plain open() or mkdir would have:
    0644 and 0755 under the usual umask 022."""
    mask = umask()
    for path in [Path(folder), *Path(folder).rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
