"""The sandbox that runs trace programs: normal runs, and hostile programs that must hit a limit.

The default configuration runs programs only inside bubblewrap and refuses to run anything
without it (tested by hiding `bwrap`). The hostile suite runs through that default path and covers:
fork and process bombs, memory, disk fill, writes outside the sandbox's temp dirs and into the
project, reads of the user's home and of the project, network (host loopback, outside, DNS),
signals to the parent and other host processes, environment secrets, long sleeps, busy loops,
infinite output and shell escapes. `.ci/run` installs bubblewrap, so CI runs all of it; on a
machine without it they are skipped (and the refusal test says why that is safe).
Limits are small so each hostile program is stopped within about a second. The unsafe
rlimit-only mode is exercised with the system interpreter, which (unlike a pyenv interpreter
under /root) another uid may execute.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from ppo_affine.envs import sandbox
from ppo_affine.envs.sandbox import SandboxLimits, SandboxUnavailable, detect_protections, run_python, run_python_async

REPO = Path(__file__).resolve().parent.parent
SMALL = SandboxLimits(memory_bytes=256 << 20, file_size_bytes=1 << 20, max_processes=8,
                      output_bytes=64 << 10, scratch_bytes=8 << 20)
HAS_BWRAP = detect_protections().bwrap_path is not None
IS_ROOT = os.geteuid() == 0
# Programs run the default way only in bubblewrap; without it they are refused (see the refusal test).
needs_bwrap = pytest.mark.skipif(not HAS_BWRAP, reason="bubblewrap is not usable on this machine, so the default "
                                 "sandbox refuses to run programs (test_no_bubblewrap_means_no_program_runs)")
SYSTEM_PYTHON = "/usr/bin/python3"


def run(code: str, stdin: str = "", timeout: float = 5.0, limits: SandboxLimits = SMALL, **kwargs):
    return run_python(textwrap.dedent(code), stdin, timeout, limits=limits, **kwargs)


def leftover_sandbox_processes() -> list[int]:
    """Live (non-zombie) pids under this process's block of per-run uids, once the kernel has
    finished delivering the kills (polled for up to 5 s: process teardown is asynchronous)."""
    low = sandbox._UID_BASE + (os.getpid() % 65536) * sandbox._UIDS_PER_PROCESS
    for _ in range(50):
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = dict(line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines())
            except (OSError, ValueError):
                continue
            if low <= int(status["Uid"].split()[1]) < low + sandbox._UIDS_PER_PROCESS and \
                    not status["State"].strip().startswith("Z"):
                found.append(int(entry))
        if not found:
            return []
        time.sleep(0.1)
    return found


# ---------------------------------------------------------------- ordinary programs
@needs_bwrap
def test_prints_stdout_and_reads_stdin():
    result = run("""
        name = input()
        count = int(input())
        for i in range(count):
            print(name, i)
    """, stdin="ada\n3\n")
    assert result.stdout == "ada 0\nada 1\nada 2\n"
    assert (result.returncode, result.timed_out, result.killed_reason, result.ok) == (0, False, None, True)


@needs_bwrap
def test_crash_keeps_partial_stdout_and_the_traceback():
    result = run("""
        print('before')
        raise ValueError('boom')
    """)
    assert result.stdout == "before\n"
    assert result.stderr.strip().splitlines()[-1] == "ValueError: boom"
    assert (result.returncode, result.killed_reason, result.ok) == (1, None, False)


@needs_bwrap
def test_exit_code_is_passed_through():
    result = run("import sys\nprint('bye')\nsys.exit(3)")
    assert (result.stdout, result.returncode, result.killed_reason) == ("bye\n", 3, None)


@needs_bwrap
def test_string_hashes_are_fixed_so_set_order_is_reproducible():
    code = "print(hash('abc'), list({'pear', 'fig', 'kiwi', 'plum'}))"
    assert run(code).stdout == run(code).stdout
    assert run("print(hash('abc'))").stdout == "-4594863902769663758\n"  # hash seed 0


@needs_bwrap
def test_invalid_utf8_output_is_replaced_not_fatal():
    result = run("import sys\nsys.stdout.buffer.write(b'ok\\xff\\r\\n')")
    assert result.stdout == "ok\ufffd\n"


@needs_bwrap
def test_unread_large_stdin_does_not_block():
    result = run("print('ignored my input')", stdin="x" * (1 << 20))
    assert (result.stdout, result.returncode) == ("ignored my input\n", 0)


@needs_bwrap
def test_async_wrapper_runs_programs_concurrently():
    async def main():
        return await asyncio.gather(*(run_python_async(f"print({i} * {i})", limits=SMALL) for i in range(4)))

    assert [r.stdout for r in asyncio.run(main())] == ["0\n", "1\n", "4\n", "9\n"]


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=0)
    with pytest.raises(ValueError, match="timeout"):
        run_python("print(1)", timeout=0)


# ---------------------------------------------------------------- hostile programs
@needs_bwrap
def test_infinite_loop_is_killed_at_the_wall_timeout():
    result = run("""
        print('started', flush=True)
        while True:
            pass
    """, timeout=1.0)
    assert (result.timed_out, result.killed_reason, result.returncode) == (True, "timeout", -9)
    assert result.stdout == "started\n"
    assert leftover_sandbox_processes() == []


@needs_bwrap
def test_cpu_seconds_limit_stops_a_busy_program_before_the_wall_timeout():
    limits = SandboxLimits(cpu_seconds=1, memory_bytes=256 << 20)
    result = run("while True:\n    pass", timeout=20.0, limits=limits)
    assert (result.timed_out, result.killed_reason, result.returncode) == (False, "cpu_time", -24)  # SIGXCPU


@needs_bwrap
@pytest.mark.skipif(not IS_ROOT, reason="the per-run uid that makes RLIMIT_NPROC exact needs root")
def test_fork_bomb_is_capped_at_the_process_limit():
    result = run("""
        import os, time
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                children += 1
        except OSError as exc:
            print('refused after', children, 'children:', type(exc).__name__)
    """)
    # 8 processes for the run's uid: the program itself and 7 children.
    assert result.stdout == "refused after 7 children: BlockingIOError\n"
    assert (result.returncode, result.timed_out) == (0, False)
    assert leftover_sandbox_processes() == []  # the sleeping children died with the sandbox


@needs_bwrap
@pytest.mark.skipif(not IS_ROOT, reason="the per-run uid that makes RLIMIT_NPROC exact needs root")
def test_endless_fork_bomb_times_out_and_leaves_no_process():
    result = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, timeout=1.0)
    assert (result.timed_out, result.killed_reason) == (True, "timeout")
    assert leftover_sandbox_processes() == []


@needs_bwrap
def test_multi_gigabyte_allocation_raises_memory_error():
    result = run("""
        try:
            block = bytearray(4 << 30)
        except MemoryError:
            print('MemoryError')
        hoard = []
        while True:
            hoard.append(' ' * (1 << 20))
    """)
    assert result.stdout == "MemoryError\n"
    assert result.stderr.strip().splitlines()[-1] == "MemoryError"
    assert (result.returncode, result.timed_out) == (1, False)


@needs_bwrap
def test_writing_a_gigabyte_file_stops_at_the_file_size_limit():
    result = run("""
        import errno, os
        chunk = b'x' * (1 << 20)
        fd = os.open('big.bin', os.O_WRONLY | os.O_CREAT)
        try:
            for _ in range(1024):
                os.write(fd, chunk)
        except OSError as exc:
            print(errno.errorcode[exc.errno], os.path.getsize('big.bin'))
    """)
    assert result.stdout == "EFBIG 1048576\n"


@needs_bwrap
def test_many_files_stop_at_the_scratch_space_limit():
    result = run("""
        import errno
        written = 0
        try:
            for i in range(1000):
                with open(f'part{i}.bin', 'wb') as part:
                    part.write(b'x' * 500_000)
                written += 1
        except OSError as exc:
            print(errno.errorcode[exc.errno], written < 20)
    """)
    assert result.stdout == "ENOSPC True\n"  # 8 MiB of tmpfs, not the host disk


@needs_bwrap
def test_writes_outside_the_working_dir_never_reach_the_host():
    host_tmp_file = f"/tmp/sandbox-escape-{uuid.uuid4().hex}.txt"
    project_file = REPO / f"sandbox-escape-{uuid.uuid4().hex}.txt"
    result = run(f"""
        import errno
        for path in [{str(project_file)!r}, {host_tmp_file!r}, '/usr/pwned.txt', '/etc/pwned.txt', '/pwned.txt',
                     '/dev/pwned', '/dev/shm/segment', 'local.txt']:
            try:
                with open(path, 'w') as handle:
                    handle.write('x')
                print('written', path)
            except OSError as exc:
                print(errno.errorcode[exc.errno], path)
    """)
    assert result.stdout.splitlines() == [
        f"ENOENT {project_file}",  # the project folder does not exist in the sandbox
        f"written {host_tmp_file}",  # into the sandbox's private /tmp ...
        "EROFS /usr/pwned.txt",
        "ENOENT /etc/pwned.txt",
        "EACCES /pwned.txt",
        "EACCES /dev/pwned",
        "written /dev/shm/segment",  # a private, size-capped tmpfs
        "written local.txt",
    ]
    assert not os.path.exists(host_tmp_file)  # ... which the host never sees
    assert not project_file.exists()


@needs_bwrap
def test_parent_environment_secret_is_unreachable(monkeypatch):
    monkeypatch.setenv("TRACE_SANDBOX_TEST_SECRET", "hunter2")
    result = run(f"""
        import errno, os
        print(os.environ.get('TRACE_SANDBOX_TEST_SECRET'))
        print(sorted(os.environ))
        for pid in [{os.getpid()}, 1]:
            try:
                print(len(open(f'/proc/{{pid}}/environ', 'rb').read()))
            except OSError as exc:
                print(errno.errorcode[exc.errno])
    """)
    # LD_LIBRARY_PATH only where a shared libpython moved to /opt/python with its interpreter (pyenv builds)
    moved_libpython = ["LD_LIBRARY_PATH"] if sandbox.sandbox_interpreter().env else []
    assert result.stdout.splitlines() == [
        "None",
        str(sorted(["HOME", "LANG", "PATH", "PWD", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "PYTHONIOENCODING",
                    "TMPDIR", *moved_libpython])),
        "ENOENT",  # the trainer's pid does not exist in the sandbox's pid namespace
        "EACCES" if IS_ROOT else "0",  # pid 1 is bwrap's own reaper (root's, or ours with an empty env)
    ]
    assert "hunter2" not in result.stdout + result.stderr


@needs_bwrap
def test_no_connection_to_a_socket_on_the_host_loopback():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        result = run(f"""
            import socket
            for address in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:
                try:
                    socket.create_connection(address, timeout=2).close()
                    print('connected', address[0])
                except OSError as exc:
                    print(type(exc).__name__, address[0])
        """)
        assert result.stdout.splitlines() == ["ConnectionRefusedError 127.0.0.1", "OSError 1.1.1.1"]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's listener
    finally:
        listener.close()


@needs_bwrap
def test_a_spawned_shell_is_confined_like_the_program(monkeypatch):
    monkeypatch.setenv("TRACE_SANDBOX_TEST_SECRET", "hunter2")
    result = run("""
        import subprocess
        script = 'echo "secret=$TRACE_SANDBOX_TEST_SECRET"; id -u; touch /usr/pwned 2>/dev/null || echo touch refused'
        print(subprocess.run(['/bin/sh', '-c', script], capture_output=True, text=True).stdout, end='')
    """)
    secret_line, uid_line, touch_line = result.stdout.splitlines()
    assert secret_line == "secret="
    assert touch_line == "touch refused"
    if IS_ROOT:
        assert int(uid_line) >= sandbox._UID_BASE  # the shell runs as the run's unprivileged uid


@needs_bwrap
def test_runaway_recursion_ends_with_an_error_not_a_hang():
    default_limit = run("""
        def down(n):
            return down(n + 1) + 1
        down(0)
    """)
    assert default_limit.returncode == 1
    assert default_limit.stderr.strip().splitlines()[-1] == "RecursionError: maximum recursion depth exceeded"

    unlimited = run("""
        import sys
        sys.setrecursionlimit(10 ** 9)
        def down(n):
            return down(n + 1) + 1
        down(0)
    """, limits=SandboxLimits(memory_bytes=48 << 20))
    assert (unlimited.returncode, unlimited.timed_out) == (1, False)
    # Frames live on the heap in 3.11+: the address-space limit ends it (3.11 reports it as SystemError).
    assert unlimited.stderr.strip().splitlines()[-1].startswith(("MemoryError", "SystemError"))


@needs_bwrap
def test_output_flood_is_cut_at_the_cap_and_killed():
    result = run("while True:\n    print('x' * 1000)", timeout=10.0)
    assert (result.killed_reason, result.timed_out, result.returncode) == ("output_limit", False, -9)
    assert len(result.stdout) == 64 << 10
    assert set(result.stdout) == {"x", "\n"}


@needs_bwrap
def test_stderr_flood_is_cut_at_the_cap_too():
    result = run("import sys\nwhile True:\n    sys.stderr.write('e' * 4096)", timeout=10.0)
    assert (result.killed_reason, len(result.stderr), result.stdout) == ("output_limit", 64 << 10, "")


@needs_bwrap
def test_background_child_holding_the_pipe_does_not_stall_the_run():
    result = run("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(30)
            os._exit(0)
        print('parent done')
    """, timeout=4.0)
    assert (result.stdout, result.returncode, result.timed_out) == ("parent done\n", 0, False)
    assert leftover_sandbox_processes() == []


@needs_bwrap
def test_parent_keeps_its_file_descriptors_and_still_runs_programs():
    before = len(os.listdir("/proc/self/fd"))
    for code in ("while True:\n    print('y' * 100)", "raise SystemExit(7)", "import os\nos.kill(os.getpid(), 9)"):
        run(code, timeout=2.0)
    assert len(os.listdir("/proc/self/fd")) == before
    killed = run("import os\nos.kill(os.getpid(), 9)")
    assert (killed.returncode, killed.killed_reason) == (-9, "signal SIGKILL")
    assert run("print('still fine')").stdout == "still fine\n"


@needs_bwrap
def test_reads_of_the_users_home_the_project_and_the_trainers_environment_find_nothing():
    home = Path.home()
    private = [str(home), *(str(p) for p in sorted(home.iterdir())[:20]), sys.prefix, sys.base_prefix]
    private += [str(REPO / "train_ppo.py"), str(REPO / "config"), "/etc/shadow", "/etc/passwd", "/proc/1/environ"]
    private = [path for path in private if not path.startswith("/usr/")]  # a system Python's stdlib stays readable
    result = run(f"""
        import os
        for path in {private!r}:
            try:
                with open(path, 'rb') as handle:
                    handle.read(1)
                print('READ', path)
            except IsADirectoryError:
                print('LISTED', path, len(os.listdir(path)))
            except OSError as exc:
                print(type(exc).__name__, path)
    """)
    lines = result.stdout.splitlines()
    assert len(lines) == len(private) and not any(line.startswith(("READ", "LISTED")) for line in lines), lines


@needs_bwrap
def test_signals_reach_no_process_outside_the_sandbox():
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        result = run(f"""
            import os, signal
            for target in [os.getppid(), {os.getpid()}, {bystander.pid}, 1]:
                try:
                    os.kill(target, signal.SIGKILL)
                    print('sent', target)
                except OSError as exc:
                    print(type(exc).__name__, target)
            os.kill(-1, signal.SIGKILL)  # everything this uid may signal: only the sandbox's own processes
        """)
        assert result.killed_reason == "signal SIGKILL" or result.returncode is not None
        assert bystander.poll() is None, "a host process was killed from inside the sandbox"
    finally:
        bystander.kill()
        bystander.wait()
    assert leftover_sandbox_processes() == []


@needs_bwrap
def test_a_long_sleep_is_killed_at_the_wall_timeout():
    result = run("import time\nprint('napping', flush=True)\ntime.sleep(3600)", timeout=1.0)
    assert (result.timed_out, result.killed_reason, result.stdout) == (True, "timeout", "napping\n")
    assert result.duration_s < 1.0 + sandbox.KILL_GRACE_S
    assert leftover_sandbox_processes() == []


@needs_bwrap
def test_no_name_resolution_or_outside_traffic():
    result = run("""
        import socket
        for attempt in (lambda: socket.getaddrinfo('pypi.org', 443),
                        lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))):
            try:
                attempt()
                print('reached')
            except OSError as exc:
                print(type(exc).__name__)
    """)
    assert "reached" not in result.stdout and len(result.stdout.splitlines()) == 2


def test_no_bubblewrap_means_no_program_runs(monkeypatch, tmp_path):
    """The default configuration never falls back to a weaker sandbox on its own."""
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else "/usr/bin/" + name)
    monkeypatch.setattr(sandbox, "_probed", {})
    marker = tmp_path / "ran"
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap.*unsafe_rlimit_only_sandbox"):
        run_python(f"open({str(marker)!r}, 'w')")
    assert not marker.exists()
    from ppo_affine.envs.trace_env import TraceEnv

    with pytest.raises(SandboxUnavailable):
        TraceEnv()
    assert TraceEnv(unsafe_rlimit_only_sandbox=True).use_bwrap is False  # the explicit, unsafe opt-in


def test_a_bubblewrap_that_fails_is_quoted_not_called_missing(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(sandbox, "_probed", {})
    with pytest.raises(SandboxUnavailable) as raised:
        run_python("print(1)")
    message = str(raised.value)
    assert f"installed but failed its test run here: {fake}: exit 1: bwrap: setting up uid map: Permission denied" \
        in message
    assert "not installed" not in message


# What a program inside finds: the top folders, which of the host's paths exist and which paths it can reach
# outside the host's system folders name one of them, what sys knows, and which imports work.
_LOOK_AROUND = """
import json, os, sys
host_paths = sys.argv[1:]
system = {'usr', 'bin', 'sbin', 'lib', 'lib32', 'lib64', 'libx32', 'proc', 'dev', 'sys'}
reachable = []
for top in sorted(set(os.listdir('/')) - system):
    for folder, folders, files in os.walk('/' + top):
        reachable += [os.path.join(folder, name) for name in folders + files]
imports = {}
for module in ('json', 'hashlib', 'decimal', 'ssl', 'sqlite3', 'ctypes', 'numpy', 'torch', 'ppo_affine'):
    try:
        __import__(module)
        imports[module] = True
    except ImportError:
        imports[module] = False
site_folders = [p for p in sys.path if p.endswith('-packages')]
named = [p for p in reachable + sys.path + [sys.prefix, sys.executable, os.path.expanduser('~')]
         if any(p == host or p.startswith(host + '/') for host in host_paths)]
print(json.dumps({"top": sorted(os.listdir('/')), "executable": sys.executable, "imports": imports,
                  "existing": [p for p in host_paths if os.path.exists(p)], "named": named,
                  "site_contents": sum(len(os.listdir(p)) for p in site_folders if os.path.isdir(p))}))
"""

_VENV_DRIVER = """
import json, sys
from ppo_affine.envs.sandbox import detect_protections, run_python
program = "import sys; sys.argv[1:] = " + repr(sys.argv[2:]) + "\\n" + sys.argv[1]
result = run_python(program, timeout=20.0)
print(json.dumps({"bwrap": detect_protections().bwrap_path is not None, "stdout": result.stdout,
                  "stderr": result.stderr, "prefix": sys.prefix}))
"""


def _private_folder(where: str) -> Path:
    """A new folder under /tmp, /dev/shm, the user's home or the project: where a trainer's venv may live."""
    parents = {"/tmp": Path("/tmp"), "/dev/shm": Path("/dev/shm"), "home": Path.home() / ".cache", "project": REPO}
    parent = parents[where]
    if not os.access(parent, os.W_OK):
        pytest.skip(f"{parent} is not writable here")
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".sandbox-venv-", dir=parent))  # 0700, like a user's private folder


@needs_bwrap
@pytest.mark.parametrize("where", ["/tmp", "/dev/shm", "home", "project"])
def test_a_trainer_in_a_venv_anywhere_runs_programs_on_the_base_interpreter_alone(where):
    """The program gets the standard library of the interpreter the venv was made from: no venv, no
    site-packages, and no path of the home, the project or the venv exists inside."""
    scratch = _private_folder(where)
    venv = scratch / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                       check=True, timeout=120)
        host_paths = [str(venv), str(Path.home()), str(REPO), os.path.realpath(sys.base_prefix)]
        host_paths = [path for path in host_paths if not path.startswith("/usr/")]  # a system Python's is /usr
        completed = subprocess.run([str(venv / "bin" / "python"), "-c", _VENV_DRIVER, _LOOK_AROUND, *host_paths],
                                   cwd=REPO, check=False, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert completed.returncode == 0, completed.stderr
    outside = json.loads(completed.stdout)
    assert (outside["bwrap"], outside["prefix"], outside["stderr"]) == (True, str(venv), "")
    inside = json.loads(outside["stdout"])
    assert set(inside["top"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "tmp",
                                  "sandbox", "opt"}
    assert inside["executable"] == sandbox.sandbox_interpreter().executable
    assert inside["executable"].startswith(("/usr/", sandbox.SANDBOX_PYTHON + "/"))
    assert inside["imports"] == {"json": True, "hashlib": True, "decimal": True, "ssl": True, "sqlite3": True,
                                 "ctypes": True, "numpy": False, "torch": False, "ppo_affine": False}
    assert (inside["existing"], inside["named"], inside["site_contents"]) == ([], [], 0)


# ---------------------------------------------------------------- the unsafe rlimit-only mode
def test_fallback_still_enforces_timeout_output_cap_and_scrubbed_env(monkeypatch):
    monkeypatch.setenv("TRACE_SANDBOX_TEST_SECRET", "hunter2")
    assert run("while True:\n    pass", timeout=1.0, use_bwrap=False).killed_reason == "timeout"
    assert run("while True:\n    print('z' * 999)", use_bwrap=False).killed_reason == "output_limit"
    env = run("import os\nprint(sorted(os.environ))", use_bwrap=False)
    assert env.stdout == ("['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'PYTHONHASHSEED', 'PYTHONIOENCODING', "
                          "'TMPDIR']\n")
    big = run("""
        import errno, os
        fd = os.open('big.bin', os.O_WRONLY | os.O_CREAT)
        try:
            os.write(fd, b'x' * (2 << 20))
            os.write(fd, b'x')
        except OSError as exc:
            print(errno.errorcode[exc.errno], os.path.getsize('big.bin'))
    """, use_bwrap=False)
    assert big.stdout == "EFBIG 1048576\n"  # a partial first write, then the limit
    assert leftover_sandbox_processes() == []


# Drivers run another interpreter (isolated, maybe as another user), which loads the sandbox module
# from the checkout named by argv[1]: it needs nothing but the standard library.
_LOAD_SANDBOX = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("sandbox", os.path.join(sys.argv[1], "ppo_affine", "envs", "sandbox.py"))
sandbox = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
SandboxLimits, detect_protections, run_python = sandbox.SandboxLimits, sandbox.detect_protections, sandbox.run_python
"""


_FALLBACK_DRIVER = _LOAD_SANDBOX + """
import json, os, sys
limits = SandboxLimits(memory_bytes=256 << 20, max_processes=8)
programs = {
    "forks": "import os, time\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n"
             "            time.sleep(30)\\n            os._exit(0)\\n        n += 1\\nexcept OSError:\\n    print(n)",
    "escaped_child": "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(30)\\n    os._exit(0)\\n"
                     "print('parent done')",
    "project_write": "import errno\\ntry:\\n    open(%r, 'w')\\nexcept OSError as exc:\\n"
                     "    print(errno.errorcode[exc.errno])" % os.path.join(sys.argv[1], 'escape.txt'),
    "parent_environ": "import errno\\ntry:\\n    open('/proc/%d/environ').read()\\nexcept OSError as exc:\\n"
                      "    print(errno.errorcode[exc.errno])" % os.getppid(),
}
protections = detect_protections(use_bwrap=False)
report = {"drop_uid": protections.drop_uid, "process_limit": protections.process_limit}
for name, code in programs.items():
    result = run_python(code, timeout=4.0, limits=limits, use_bwrap=False)
    report[name] = [result.stdout, result.returncode, result.timed_out]
print(json.dumps(report))
"""


@pytest.mark.skipif(not (IS_ROOT and os.path.exists(SYSTEM_PYTHON)),
                    reason="needs root and a system interpreter another uid may execute")
def test_fallback_with_uid_drop_contains_forks_escapes_and_secrets():
    completed = subprocess.run([SYSTEM_PYTHON, "-I", "-c", _FALLBACK_DRIVER, str(REPO)],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report == {
        "drop_uid": True,
        "process_limit": True,
        "forks": ["7\n", 0, False],  # 8 processes for the run's uid
        "escaped_child": ["parent done\n", 0, False],  # the setsid() child is swept by uid
        "project_write": ["EACCES\n", 0, False],
        "parent_environ": ["EACCES\n", 0, False],
    }
    assert not (REPO / "escape.txt").exists()


_UNPRIVILEGED_DRIVER = _LOAD_SANDBOX + """
import json, sys
forks = ("import os, time\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n"
         "            time.sleep(30)\\n            os._exit(0)\\n        n += 1\\nexcept OSError:\\n    print(n)")
escape = ("import errno\\ntry:\\n    open('/usr/x', 'w')\\nexcept OSError as exc:\\n"
          "    print(errno.errorcode[exc.errno])")
limits = SandboxLimits(memory_bytes=256 << 20, max_processes=8)
protections = detect_protections()
report = {"bwrap": protections.bwrap_path is not None, "drop_uid": protections.drop_uid}
for name, code in {"forks": forks, "escape": escape}.items():
    result = run_python(code, timeout=4.0, limits=limits)
    report[name] = [result.stdout, result.returncode]
print(json.dumps(report))
"""


@pytest.mark.skipif(not (IS_ROOT and HAS_BWRAP and os.path.exists(SYSTEM_PYTHON) and shutil.which("setpriv")),
                    reason="needs root (to become another user), bubblewrap, setpriv and a system interpreter")
def test_unprivileged_user_gets_bubblewrap_through_a_user_namespace():
    completed = subprocess.run(
        ["setpriv", "--reuid", "12345", "--regid", "12345", "--clear-groups", SYSTEM_PYTHON, "-I", "-c",
         _UNPRIVILEGED_DRIVER, str(REPO)],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    if not report["bwrap"]:
        pytest.skip("unprivileged user namespaces are disabled on this kernel")
    assert report == {
        "bwrap": True,
        "drop_uid": False,
        "forks": ["6\n", 0],  # 8 processes in the user namespace: bwrap's reaper, the program, 6 children
        "escape": ["EROFS\n", 0],
    }
