"""One `codex app-server` turn as SWE-INFINITE drives it, stdlib only.

What is SWE-INFINITE's (affinetes environments/SWE-INFINITE/agents/codex.py, read for facts): `@openai/codex` 0.94.0,
a `config.toml` naming one model provider with the run's `base_url`, `env_key = "CODEX_API_KEY"` and
`wire_api = "chat"` (Chat Completions, streamed, with tools); `codex app-server` spoken to over JSON lines on
stdin/stdout: `initialize` (client info), the `initialized` notification, `thread/start` (model, cwd, approval
policy never, full access, ephemeral), `turn/start` with the prompt as text input, then notifications until
`turn/completed`, whose `turn.status` is "completed" for a finished run; a JSON-RPC error ends it. No turn cap.
What is ours: CODEX_HOME is a temporary folder rather than /root/.codex, and codex runs inside bubblewrap (the
system read-only, the repository and CODEX_HOME writable, the network shared so that it reaches the endpoint)
instead of inside the task's Docker container.
"""
from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

KEPT_EVENTS = {"error", "item/completed", "turn/completed", "thread/tokenUsage/updated"}


@dataclass
class CodexTurn:
    status: str | None  # turn.status of turn/completed ("completed", "failed", ...); None: never completed
    events: list[dict] = field(default_factory=list)  # the KEPT_EVENTS notifications, in order
    error: str | None = None  # a JSON-RPC error, an early exit or the timeout
    stderr: str = ""

    def errors(self) -> list[dict]:
        """The errors codex reported ({message, codexErrorInfo, ...}): `error` notifications, a failed turn's."""
        found = []
        for event in self.events:
            params = event.get("params") or {}
            if event.get("method") == "error" and isinstance(params.get("error"), dict):
                found.append(params["error"])
            elif event.get("method") == "turn/completed" and isinstance((params.get("turn") or {}).get("error"), dict):
                found.append(params["turn"]["error"])
        return found


def write_codex_home(home: Path, model: str, base_url: str) -> Path:
    """CODEX_HOME with the one provider SWE-INFINITE configures (wire_api chat, key from CODEX_API_KEY)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f"model = {json.dumps(model)}\nmodel_provider = \"trainer\"\n\n[model_providers.trainer]\n"
        f"name = \"trainer\"\nenv_key = \"CODEX_API_KEY\"\nbase_url = {json.dumps(base_url)}\nwire_api = \"chat\"\n")
    return home


def codex_command(codex: str) -> list[str]:
    """The app-server command of a codex binary, or of the npm package's bin/codex.js (run by node)."""
    return ["node", codex, "app-server"] if codex.endswith(".js") else [codex, "app-server"]


def in_bubblewrap(command: list[str], readable: Path, writable: list[Path], cwd: Path) -> list[str]:
    """`command` in bubblewrap: the system read-only with a private /tmp, `readable` (codex's package, which may
    live under /tmp) read-only, `writable` writable."""
    jail = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--ro-bind", str(readable), str(readable)]
    for folder in writable:
        jail += ["--bind", str(folder), str(folder)]
    return [*jail, "--chdir", str(cwd), "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            *command]


def run_codex_turn(codex: str, codex_home: Path, repo: Path, model: str, prompt: str, api_key: str,
                   timeout: float) -> CodexTurn:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(codex_home), "CODEX_HOME": str(codex_home),
           "CODEX_API_KEY": api_key or "EMPTY", "RUST_LOG": "warn"}
    package = Path(codex).resolve().parent.parent  # bin/codex.js's package, or the binary's platform folder
    command = in_bubblewrap(codex_command(codex), package, [repo, codex_home], repo)
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, bufsize=1, env=env)
    lines: queue.Queue[str | None] = queue.Queue()
    stderr: list[str] = []
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout] + [lines.put(None)],
                     daemon=True).start()
    threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True).start()
    turn = CodexTurn(status=None)
    deadline = time.monotonic() + timeout

    def send(message: dict) -> None:
        process.stdin.write(json.dumps(message) + "\n")
        process.stdin.flush()

    def read_until(done) -> dict:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"codex app-server: no turn/completed within {timeout} s") from None
            if line is None:
                raise RuntimeError(f"codex app-server exited (code {process.wait()}) before the turn completed")
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("method") in KEPT_EVENTS:
                turn.events.append(message)
            if message.get("id") is not None and "error" in message:
                raise RuntimeError(f"codex app-server refused a request: {json.dumps(message['error'])}")
            if done(message):
                return message

    try:
        send({"method": "initialize", "id": 0,
              "params": {"clientInfo": {"name": "ppo_affine_tests", "title": "tests", "version": "1"}}})
        read_until(lambda m: m.get("id") == 0)
        send({"method": "initialized", "params": {}})
        send({"method": "thread/start", "id": 1, "params": {"model": model, "cwd": str(repo), "approvalPolicy": "never",
                                                             "sandbox": "danger-full-access", "ephemeral": True}})
        thread_id = read_until(lambda m: m.get("id") == 1)["result"]["thread"]["id"]
        send({"method": "turn/start", "id": 2, "params": {
            "threadId": thread_id, "input": [{"type": "text", "text": prompt}], "cwd": str(repo),
            "approvalPolicy": "never", "sandboxPolicy": {"type": "dangerFullAccess"}}})
        completed = read_until(lambda m: m.get("method") == "turn/completed")
        turn.status = (completed.get("params") or {}).get("turn", {}).get("status")
    except (TimeoutError, RuntimeError, KeyError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
    finally:
        process.stdin.close()
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        turn.stderr = "".join(stderr)[-4000:]
    return turn
