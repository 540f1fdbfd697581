"""kill -9 safety, measured: SIGKILL a training run at random moments of its rollouts, updates and
checkpoint writes, resume it with `--resume latest` each time, and check what survived.

After every kill: every `checkpoint-*` folder left must verify against its manifest (zero
unreadable checkpoints), and `--resume latest` must pick the newest complete one. At the end the
killed-and-resumed run's metrics must equal those of an uninterrupted run with the same seed.

    python bench/crash_resume.py                   # 20 kills, tiny random model (CPU, ~5 min)
    python bench/crash_resume.py --kills 6 --steps 6

The run is the real train_ppo.py on a tiny randomly-initialised model (tests/tiny.py), started
through a small driver that records which phase is running, so kills can be aimed at each phase.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from checkpoint import CHECKPOINT_RE, find_resumable, verify  # noqa: E402

PHASES = ("rollout", "update", "checkpoint")

# Runs train_ppo.main and appends "<phase> <monotonic time>" to a file whenever a phase starts.
DRIVER = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{root!r}]
    import train_ppo
    phases = open({phases!r}, "a", buffering=1)
    def mark(name, function):
        def wrapped(*args, **kwargs):
            phases.write(name + " " + repr(time.monotonic()) + "\\n")
            return function(*args, **kwargs)
        return wrapped
    train_ppo.Trainer.rollout = mark("rollout", train_ppo.Trainer.rollout)
    train_ppo.Trainer.learn = mark("update", train_ppo.Trainer.learn)
    train_ppo.save_checkpoint = mark("checkpoint", train_ppo.save_checkpoint)
    sys.exit(train_ppo.main(sys.argv[1:]))
""")


def train_args(model_dir: Path, out: Path, steps: int) -> list[str]:
    stages = json.dumps([{"name": "s", "opponent": "random", "min_episodes": 1000,
                          "tasks": [{"env": "openspiel", "games": ["leduc_poker", "liars_dice"]}]}])
    sets = {"model.name_or_path": str(model_dir), "model.use_4bit": "false", "model.dtype": "float32",
            "model.gradient_checkpointing": "false", "run.device": "cpu", "run.name": "run",
            "generation.backend": "local", "generation.max_new_tokens": "3", "generation.max_turns": "6",
            "generation.max_concurrent_episodes": "4", "ppo.batch_size": "4", "ppo.ppo_epochs": "2",
            "checkpointing.save_every": "1", "checkpointing.keep_last": "3", "curriculum.stages": stages}
    args = ["--output-dir", str(out), "--max-steps", str(steps)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


def deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("perf/")}


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


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


def kill_once(command: list[str], phases_file: Path, phase: str, rng: random.Random, timeout: float) -> str | None:
    """Start the run, SIGKILL it a random moment into the 1st, 2nd or 3rd `phase` it starts (so runs make
    progress between kills); returns the phase it was killed in (None: the run finished first)."""
    seen = len(phases_file.read_text().splitlines()) if phases_file.exists() else 0
    occurrence = rng.randint(1, 3)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    # checkpoint writes of a tiny model take tens of ms: aim inside them; the other phases last seconds
    delay = rng.uniform(0.0, 0.03) if phase == "checkpoint" else rng.uniform(0.0, 0.5)
    while process.poll() is None and time.monotonic() < deadline:
        started = phases_file.read_text().splitlines()[seen:] if phases_file.exists() else []
        if sum(line.split()[0] == phase for line in started) >= occurrence:
            time.sleep(delay)
            break
        time.sleep(0.005)
    if process.poll() is not None:
        return None
    process.send_signal(signal.SIGKILL)
    process.wait()
    lines = phases_file.read_text().splitlines()[seen:]
    return lines[-1].split()[0] if lines else "start-up"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=12, help="steps of each run (a new run starts when one ends)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    args = parser.parse_args()
    from tiny import make_tiny_model_dir

    work = Path(tempfile.mkdtemp(prefix="crash-resume-"))
    model_dir = make_tiny_model_dir(work / "model")
    driver = work / "driver.py"
    rng = random.Random(args.seed)
    started = time.perf_counter()

    reference = work / "reference"
    subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), *train_args(model_dir, reference, args.steps)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    expected = [deterministic(r) for r in metrics(reference / "run")]

    kills: list[dict] = []
    runs: list[dict] = []
    run_index = 0
    while len(kills) < args.kills:
        out = work / f"killed-{run_index}"
        phases_file = out / "phases.txt"
        out.mkdir(parents=True)
        driver.write_text(DRIVER.format(root=str(ROOT), phases=str(phases_file)))
        base = [sys.executable, str(driver), *train_args(model_dir, out, args.steps)]
        resumes = 0
        while True:
            command = base + (["--resume", "latest"] if (out / "run" / "checkpoints" / "latest").exists() else [])
            resumes += "--resume" in command
            phase = PHASES[len(kills) % len(PHASES)]
            killed_in = kill_once(command, phases_file, phase, rng, timeout=600) if len(kills) < args.kills else None
            if killed_in is None:
                if len(kills) >= args.kills:  # finish the run without further kills
                    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                break
            report = checkpoint_report(out / "run" / "checkpoints")
            kills.append({"run": run_index, "aimed_at": phase, "killed_in": killed_in, **report})
            print(json.dumps(kills[-1]), file=sys.stderr)
        got = [deterministic(r) for r in metrics(out / "run")]
        runs.append({"run": run_index, "resumes": resumes, "steps": len(got),
                     "metrics_equal_uninterrupted": got == expected})
        run_index += 1

    summary = {
        "kills": len(kills),
        "killed_in": {phase: sum(k["killed_in"] == phase for k in kills) for phase in (*PHASES, "start-up")},
        "unreadable_checkpoints": sum(len(k["unreadable"]) for k in kills),
        "kills_mid_checkpoint_write": sum(k["half_written_left"] for k in kills),
        "resume_latest_found_newest_complete": sum(k["resume_picks_newest"] for k in kills),
        "runs": runs,
        "all_runs_reproduce_uninterrupted_metrics": all(r["metrics_equal_uninterrupted"] for r in runs),
        "seconds": round(time.perf_counter() - started),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
