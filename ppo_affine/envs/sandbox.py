"""Run an untrusted Python program in a throwaway sandbox and capture what it prints.

Layers, strongest first (which ones are active is probed once and logged):
1. bubblewrap: new pid/net/ipc/uts namespaces, a tmpfs root holding read-only binds of /usr and
   of the base interpreter's standard library only, size-capped tmpfs /tmp, /dev/shm and working
   dir, no network device but loopback, killed with its parent. Programs run on the interpreter a
   virtual environment was made from, never on the trainer's venv: a base interpreter outside /usr
   (pyenv, conda, uv) appears at /opt/python, and every site-packages folder is an empty read-only
   tmpfs, so no folder of the user's home or of the trainer's environment exists inside.
2. An unprivileged uid, fresh for every run (root only): RLIMIT_NPROC ignores root, and a uid of
   its own makes the process count and the final kill-everything sweep exact per run.
3. rlimits on CPU seconds, address space, file size, process count; no core files.
4. A scrubbed environment, its own session (killed as a group), a wall timeout and output caps.

Without a working bubblewrap, `run_python` refuses to run anything (`SandboxUnavailable`, with
the command that installs it) unless the caller opts into the unsafe rlimit-only mode
(`use_bwrap=False`; the trace env's `unsafe_rlimit_only_sandbox`). There the program runs on the
host file system, an unprivileged uid only keeps it out of what is not world-writable, and the
network is reachable.
"""
from __future__ import annotations

import asyncio
import functools
import glob
import itertools
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Per-run uids come from a block no distribution or subuid range normally uses.
_UID_BASE = 1_500_000_000
_UIDS_PER_PROCESS = 1024
_run_counter = itertools.count()
# Run as a run's uid, kills every process of that uid but itself (the interpreter is known to be
# executable by that uid: the fallback probe ran a program with it).
_SWEEP = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\n"

# Inside the bubblewrap sandbox the program lives here (a tmpfs, gone when the sandbox ends).
SANDBOX_WORKDIR = "/sandbox"
# ... and a base interpreter installed outside /usr appears here, its own path (often in a home) hidden.
SANDBOX_PYTHON = "/opt/python"
KILL_GRACE_S = 5.0  # after a kill, how long the pipes may take to close before we stop waiting
PROGRAM_NAME = "main.py"

# Runs first inside the sandbox: sets the rlimits, drops to the run's uid, then becomes the
# program's interpreter. Doing this in a child process keeps `preexec_fn` (unsafe in a
# multi-threaded trainer) out of the parent.
LAUNCH_ERROR_EXIT = 125
_LAUNCH_ERROR_PREFIX = "sandbox launcher: "
_LAUNCHER = f"""\
import os, resource, sys
try:
    cpu, memory, file_size, processes, uid = map(int, sys.argv[1:6])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    if processes >= 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    if uid >= 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    os.umask(0o077)
    os.execv(sys.argv[6], sys.argv[6:])
except BaseException as exc:
    sys.stderr.write("{_LAUNCH_ERROR_PREFIX}" + type(exc).__name__ + ": " + str(exc) + "\\n")
    sys.stderr.flush()
    os._exit({LAUNCH_ERROR_EXIT})
"""


INSTALL_BWRAP = "apt-get install -y bubblewrap"


class SandboxUnavailable(RuntimeError):
    """No isolation layer works here and the caller did not opt into running code without one."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run resource limits; `cpu_seconds=None` means the wall timeout rounded up plus one."""

    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    max_processes: int = 32
    output_bytes: int = 1 << 20
    scratch_bytes: int = 64 << 20
    cpu_seconds: int | None = None

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "file_size_bytes", "max_processes", "output_bytes", "scratch_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.cpu_seconds is not None and self.cpu_seconds < 1:
            raise ValueError(f"SandboxLimits.cpu_seconds must be >= 1 or None, got {self.cpu_seconds}")


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed run produced. `returncode` is negative for a signal, None if it never started."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    killed_reason: str | None  # "timeout", "output_limit", "cpu_time", "signal SIGSEGV", "launch_error"
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


@dataclass(frozen=True)
class Protections:
    """Which layers this machine gives the sandbox."""

    bwrap_path: str | None  # None: bubblewrap missing or not working here
    drop_uid: bool  # we are root, so each run gets its own unprivileged uid
    process_limit: bool  # RLIMIT_NPROC is enforceable for the run
    bwrap_failure: str | None = None  # bubblewrap is installed but its probe failed: what it said

    def describe(self) -> str:
        active = ["rlimits (cpu, address space, file size)", "scrubbed environment", "own session",
                  "wall timeout", "output cap"]
        missing = []
        if self.bwrap_path:
            active.insert(0, "bubblewrap (pid/net/ipc/uts namespaces, read-only /usr and the base interpreter's "
                             "standard library without site-packages, private size-capped /tmp, /dev/shm and "
                             "working dir)")
        else:
            missing += ["bubblewrap: NO network isolation, host file system visible "
                        "(writable wherever the run's uid may write, e.g. /tmp)"]
        if self.drop_uid:
            active.append("unprivileged uid per run")
        else:
            missing.append("uid drop (the program runs as this process's user, root included)")
        if self.process_limit:
            active.append("process limit")
        else:
            missing.append("process limit (RLIMIT_NPROC does not bind root, and for another user it would "
                           "count all of that user's processes)")
        text = "sandbox active: " + ", ".join(active)
        return text + (". MISSING: " + "; ".join(missing) if missing else "")


_probe_lock = threading.Lock()
_probed: dict[bool, Protections] = {}


def detect_protections(use_bwrap: bool = True) -> Protections:
    """Probe once per process (per `use_bwrap`) which protections work here, and log them once."""
    with _probe_lock:
        if use_bwrap not in _probed:
            protections = _probe(use_bwrap)
            message = protections.describe()
            if protections.bwrap_path and protections.drop_uid:
                logger.info(message)
            elif protections.bwrap_path or not use_bwrap:  # a missing bwrap is require_isolation's error
                logger.warning(message)
            _probed[use_bwrap] = protections
        return _probed[use_bwrap]


def _probe(use_bwrap: bool) -> Protections:
    is_root = os.geteuid() == 0
    if use_bwrap:
        bwrap = shutil.which("bwrap")
        failure = None
        if bwrap:
            failure = _failure(Protections(bwrap_path=bwrap, drop_uid=is_root, process_limit=True))
            if failure is None:
                return Protections(bwrap_path=bwrap, drop_uid=is_root, process_limit=True)
            failure = f"{bwrap}: {failure}"
        return Protections(bwrap_path=None, drop_uid=False, process_limit=False, bwrap_failure=failure)
    if is_root:
        if not _runs_as_other_uid():
            logger.warning("%s cannot be executed by an unprivileged uid (e.g. it lives under /root), so without "
                           "bubblewrap sandboxed programs run as root", base_executable())
        elif _failure(Protections(bwrap_path=None, drop_uid=True, process_limit=True)) is None:
            return Protections(bwrap_path=None, drop_uid=True, process_limit=True)
    return Protections(bwrap_path=None, drop_uid=False, process_limit=False)


def _failure(candidate: Protections) -> str | None:
    """None when `candidate` runs a trivial program correctly, else what went wrong (its stderr)."""
    result = _run(candidate, "print(6 * 7)\n", "", 10.0, SandboxLimits())
    if result.returncode == 0 and result.stdout == "42\n":
        return None
    failure = f"exit {result.returncode}: {result.stderr.strip()[-500:] or '(no message)'}"
    logger.warning("sandbox variant %s does not work here (%s)", candidate, failure)
    return failure


def _runs_as_other_uid() -> bool:
    """Whether this interpreter starts under a fresh unprivileged uid (the fallback and its sweep need it)."""
    try:
        uid = _next_run_uid()
        return subprocess.run([base_executable(), "-I", "-S", "-c", "pass"], user=uid, group=uid, extra_groups=[],
                              env={}, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def require_isolation() -> Protections:
    """The protections of the default (bubblewrap) sandbox; SandboxUnavailable when bubblewrap does not work here."""
    protections = detect_protections(use_bwrap=True)
    if protections.bwrap_path is None:
        unsafe = ("Or, at your own risk, set the trace env's unsafe_rlimit_only_sandbox=true to run them with rlimits "
                  "only: no file-system or network isolation.")
        if protections.bwrap_failure:
            raise SandboxUnavailable(
                "Trace programs (model-written and dataset code) run only inside bubblewrap, which is installed but "
                f"failed its test run here: {protections.bwrap_failure}. Common causes: unprivileged user "
                "namespaces disabled (sysctl kernel.unprivileged_userns_clone / "
                "kernel.apparmor_restrict_unprivileged_userns), or a container without CAP_SYS_ADMIN. " + unsafe
            )
        raise SandboxUnavailable(
            "Trace programs (model-written and dataset code) run only inside bubblewrap, which is not installed "
            f"(no 'bwrap' on PATH). Install it: '{INSTALL_BWRAP}' (as root). " + unsafe
        )
    return protections


def run_python(
    code: str,
    stdin: str = "",
    timeout: float = 10.0,
    *,
    limits: SandboxLimits = SandboxLimits(),
    use_bwrap: bool = True,
) -> RunResult:
    """Run `code` as a Python program with `stdin` as its input, inside the sandbox; never raises for
    anything the program does, and returns within about `timeout` seconds plus cleanup.
    `use_bwrap=False` is the unsafe rlimit-only mode; by default a missing bubblewrap raises
    SandboxUnavailable."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    protections = require_isolation() if use_bwrap else detect_protections(use_bwrap=False)
    return _run(protections, code, stdin, timeout, limits)


async def run_python_async(
    code: str,
    stdin: str = "",
    timeout: float = 10.0,
    *,
    limits: SandboxLimits = SandboxLimits(),
    use_bwrap: bool = True,
) -> RunResult:
    """`run_python` in a worker thread, so the event loop keeps serving other episodes meanwhile."""
    return await asyncio.to_thread(run_python, code, stdin, timeout, limits=limits, use_bwrap=use_bwrap)


def _run(protections: Protections, code: str, stdin: str, timeout: float, limits: SandboxLimits) -> RunResult:
    start = time.monotonic()
    uid = _next_run_uid() if protections.drop_uid else -1
    cpu_seconds = limits.cpu_seconds or math.ceil(timeout) + 1
    launcher_args = [str(cpu_seconds), str(limits.memory_bytes), str(limits.file_size_bytes),
                     str(limits.max_processes if protections.process_limit else -1), str(uid)]
    workdir = None
    program_fd = None
    try:
        if protections.bwrap_path:
            # bwrap copies the program from this in-memory file into the sandbox's own tmpfs.
            program_fd = os.memfd_create("trace-program")
            with open(program_fd, "wb", closefd=False) as program_file:
                program_file.write(code.encode("utf-8", errors="surrogatepass"))
            os.lseek(program_fd, 0, os.SEEK_SET)
            cwd = None
            interpreter = sandbox_interpreter()
            argv = _bwrap_argv(protections, limits, program_fd, _environment(SANDBOX_WORKDIR) | interpreter.env,
                               interpreter)
            python = interpreter.executable
            program_path = f"{SANDBOX_WORKDIR}/{PROGRAM_NAME}"
            pass_fds: tuple[int, ...] = (program_fd,)
            env = {}
        else:
            workdir = tempfile.mkdtemp(prefix="trace-sandbox-")
            program_path = os.path.join(workdir, PROGRAM_NAME)
            with open(program_path, "w", encoding="utf-8", errors="surrogatepass") as program_file:
                program_file.write(code)
            os.chmod(program_path, 0o444)
            if uid >= 0:
                os.chown(workdir, uid, uid)
            cwd, argv, pass_fds, env = workdir, [], (), _environment(workdir)
            python = base_executable()
        argv += [python, "-I", "-S", "-c", _LAUNCHER, *launcher_args, *_python_argv(python, program_path)]
        try:
            process = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=cwd, env=env, pass_fds=pass_fds, start_new_session=True,
            )
        except OSError as exc:
            return RunResult("", f"{type(exc).__name__}: {exc}", None, False, "launch_error",
                             time.monotonic() - start)
        if program_fd is not None:
            os.close(program_fd)
            program_fd = None
        with process:
            stdout, stderr, timed_out, overflow, killed = _communicate(
                process, stdin.encode("utf-8", errors="surrogatepass"), start + timeout, limits.output_bytes,
                lambda: _kill(process, uid, protections),
            )
            if not killed:  # background processes that closed their pipes may still run
                _kill(process, uid, protections)
            returncode = process.wait()
    finally:
        if program_fd is not None:
            os.close(program_fd)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if protections.bwrap_path and 128 < returncode <= 128 + 64:
        returncode = -(returncode - 128)  # bwrap reports a signalled child as 128 + signal
    stdout_text, stderr_text = _decode(stdout), _decode(stderr)
    reason = _killed_reason(returncode, timed_out, overflow, stdout_text, stderr_text)
    return RunResult(stdout_text, stderr_text, returncode, timed_out, reason, time.monotonic() - start)


def _python_argv(python: str, program_path: str) -> list[str]:
    # Not -I: it would also ignore PYTHONHASHSEED. The environment is built from scratch, so -E buys
    # nothing, while a fixed hash seed makes a program's output (set order) the same on every run.
    return [python, "-s", "-P", program_path]


def _environment(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": home,
        "TMPDIR": "/tmp",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _bwrap_argv(protections: Protections, limits: SandboxLimits, program_fd: int, env: dict[str, str],
                interpreter: SandboxInterpreter) -> list[str]:
    argv = [
        protections.bwrap_path or "bwrap",
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "sandbox", "--die-with-parent", "--new-session",
    ]
    if protections.drop_uid:
        # Root: keep only what the launcher needs to switch to the run's uid; that switch clears them.
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user"]  # unprivileged bwrap needs a user namespace
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += [
        "--proc", "/proc", "--dev", "/dev",
        # Each tmpfs is RAM outside RLIMIT_AS, hence the size caps; /dev/shm serves multiprocessing.
        "--perms", "1777", "--size", str(limits.scratch_bytes), "--tmpfs", "/dev/shm",
        "--perms", "1777", "--size", str(limits.scratch_bytes), "--tmpfs", "/tmp",
        "--perms", "0777", "--size", str(limits.scratch_bytes), "--tmpfs", SANDBOX_WORKDIR,
        "--perms", "0444", "--ro-bind-data", str(program_fd), f"{SANDBOX_WORKDIR}/{PROGRAM_NAME}",
    ]
    argv += list(interpreter.binds)
    argv += ["--chdir", SANDBOX_WORKDIR, "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv + ["--"]


def base_executable() -> str:
    """The interpreter this one's virtual environment was made from (or this one): the same Python and standard
    library, none of the venv's packages."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (os.path.join(sys.base_prefix, "bin", name), getattr(sys, "_base_executable", None)):
        if candidate and os.access(candidate, os.X_OK):
            return os.path.realpath(candidate)
    return os.path.realpath(sys.executable)


@dataclass(frozen=True)
class SandboxInterpreter:
    """The base interpreter as programs see it inside bubblewrap."""

    executable: str  # its path inside the sandbox
    binds: tuple[str, ...]  # bwrap arguments: its standard library read-only, every site-packages folder emptied
    env: dict[str, str]  # LD_LIBRARY_PATH when a shared libpython moved to /opt/python with it


@functools.cache
def sandbox_interpreter() -> SandboxInterpreter:
    """Under /usr the base interpreter is already there; elsewhere its executable and lib folders are bound at
    /opt/python (Python finds its standard library next to the executable). Site-packages folders, of this
    Python and of any other under /usr, become empty read-only tmpfs mounts; so does a venv under /usr."""
    executable = base_executable()
    prefix = os.path.dirname(os.path.dirname(executable))
    binds: list[str] = []
    env: dict[str, str] = {}
    empty = sorted(glob.glob("/usr/lib/python3*/*-packages") + glob.glob("/usr/local/lib/python3*/*-packages"))
    if sys.prefix != sys.base_prefix and _is_under(os.path.realpath(sys.prefix), "/usr"):
        empty.append(os.path.realpath(sys.prefix))
    if _is_under(prefix, "/usr"):
        inside = executable
    else:
        inside = SANDBOX_PYTHON + executable[len(prefix):]
        for folder in ("/opt", SANDBOX_PYTHON, os.path.dirname(inside)):
            binds += ["--perms", "0755", "--dir", folder]
        binds += ["--ro-bind", executable, inside]
        for lib in sorted({"lib", sys.platlibdir}):
            if os.path.isdir(os.path.join(prefix, lib)):
                binds += ["--ro-bind", os.path.join(prefix, lib), f"{SANDBOX_PYTHON}/{lib}"]
                empty += [SANDBOX_PYTHON + path[len(prefix):]
                          for path in sorted(glob.glob(os.path.join(prefix, lib, "python3*", "*-packages")))]
        if sysconfig.get_config_var("Py_ENABLE_SHARED"):
            env["LD_LIBRARY_PATH"] = f"{SANDBOX_PYTHON}/lib"  # the executable's RUNPATH names the host's prefix
    for folder in empty:
        binds += ["--tmpfs", folder, "--remount-ro", folder]
    return SandboxInterpreter(executable=inside, binds=tuple(binds), env=env)


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def _next_run_uid() -> int:
    return _UID_BASE + (os.getpid() % 65536) * _UIDS_PER_PROCESS + next(_run_counter) % _UIDS_PER_PROCESS


def _communicate(
    process: subprocess.Popen, stdin: bytes, deadline: float, cap: int, kill: Callable[[], None]
) -> tuple[bytes, bytes, bool, bool, bool]:
    """Feed stdin and read both streams (keeping `cap` bytes of each) until EOF. At the deadline, or
    once a stream passes `cap`, or once the program has exited while something still holds its
    pipes, everything is killed and the pipes are drained to EOF, so that no process of the run is
    left when this returns. Returns (stdout, stderr, timed_out, overflow, killed)."""
    assert process.stdin and process.stdout and process.stderr
    stdin_fd, stdout_fd, stderr_fd = process.stdin.fileno(), process.stdout.fileno(), process.stderr.fileno()
    buffers = {stdout_fd: bytearray(), stderr_fd: bytearray()}
    received = {stdout_fd: 0, stderr_fd: 0}
    timed_out = overflow = killed = False
    offset = 0
    open_streams = 2

    def kill_now(grace: bool) -> None:
        nonlocal killed, deadline
        kill()
        killed = True
        if grace:
            deadline = time.monotonic() + KILL_GRACE_S

    with selectors.DefaultSelector() as selector:
        selector.register(stdout_fd, selectors.EVENT_READ)
        selector.register(stderr_fd, selectors.EVENT_READ)
        if stdin:
            os.set_blocking(stdin_fd, False)
            selector.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            process.stdin.close()
        while open_streams:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if timed_out or overflow:
                    break  # killed, yet the pipes stay open: give up rather than hang
                timed_out = True
                kill_now(grace=True)
                continue
            # Wake up now and then: a finished program's background children may hold the pipes open.
            events = selector.select(min(remaining, 0.1))
            if not events and not killed and _has_exited(process.pid):
                kill_now(grace=False)
            for key, _ in events:
                if key.fd == stdin_fd:
                    try:
                        offset += os.write(stdin_fd, stdin[offset:offset + 65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the program stopped reading; the rest of its input is moot
                        offset = len(stdin)
                    if offset >= len(stdin):
                        selector.unregister(stdin_fd)
                        process.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    open_streams -= 1
                    continue
                received[key.fd] += len(chunk)
                buffer = buffers[key.fd]
                buffer += chunk[: max(0, cap - len(buffer))]
                if received[key.fd] > cap and not (overflow or timed_out):
                    overflow = True
                    kill_now(grace=True)
    return bytes(buffers[stdout_fd]), bytes(buffers[stderr_fd]), timed_out, overflow, killed


def _has_exited(pid: int) -> bool:
    # WNOWAIT leaves the zombie in place, so its pid (our process group id) cannot be reused before the kill.
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill(process: subprocess.Popen, uid: int, protections: Protections) -> None:
    """Kill everything the run started: its process group and, outside bwrap's pid namespace
    (which dies with the sandbox), every process of the run's own uid."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid >= 0 and not protections.bwrap_path:
        # kill(-1) as that uid reaches exactly the run's processes, including ones that left the group.
        sweep = subprocess.run(
            [base_executable(), "-I", "-S", "-c", _SWEEP], user=uid, group=uid, extra_groups=[], env={},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30, check=False,
        )
        if sweep.returncode != 0:
            logger.error("could not kill the processes of sandbox uid %d: %s", uid, sweep.stderr.decode()[-300:])


def _decode(raw: bytes) -> str:
    # Same text as subprocess's text mode gives the real env: UTF-8 and universal newlines.
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def _killed_reason(returncode: int, timed_out: bool, overflow: bool, stdout: str, stderr: str) -> str | None:
    if timed_out:
        return "timeout"
    if overflow:
        return "output_limit"
    if returncode == LAUNCH_ERROR_EXIT and stderr.startswith(_LAUNCH_ERROR_PREFIX):
        return "launch_error"
    if returncode == 1 and not stdout and stderr.startswith("bwrap: "):
        return "launch_error"
    if returncode == -signal.SIGXCPU:
        return "cpu_time"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return None
