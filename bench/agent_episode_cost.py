"""What an agent episode costs on the CPU, phase by phase: a short PPO run through mini-swe-agent (the harness env of
tests/harness_env behind affinetes' template server, url mode), and for each step the rollout split into the envs'
own time and local generation's prefill and decode, the update split into scoring and the PPO epochs, with each
phase's peak resident memory and what the memory plan said that phase would add (ppo_affine/phase_costs.py).

The trainer runs as its own process (`python train_ppo.py`), so its memory is its own; the metrics are the run's own
(its metrics.jsonl). Beside them, sampled every 0.5 s: the trainer's resident memory (its whole life: loading and
saving too) and the harness side's (the env server and every harness and command it starts).

    MINISWE_PYTHON=~/.cache/ppo-affine/miniswe-venv/bin/python python -m bench.agent_episode_cost --out ~/runs/x
    ... --episodes 2 --turns 6 --max-new-tokens 128 --max-prompt-tokens 4096 --steps 2   # the defaults
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
HARNESS_ENV = ROOT / "tests" / "harness_env"
GB = 1e9


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process under it."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class PeakSampler(threading.Thread):
    """The most resident memory each watched process tree held at one sample, every `interval` seconds."""

    def __init__(self, pids: dict[str, int], interval: float = 0.5):
        super().__init__(daemon=True)
        self.pids, self.interval, self.peaks, self.stopping = pids, interval, dict.fromkeys(pids, 0), threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            for name, pid in self.pids.items():
                self.peaks[name] = max(self.peaks[name], tree_rss(pid))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_harness_server(log_path: Path, miniswe_python: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "MINISWE_PYTHON": miniswe_python, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", "serve:app", "--app-dir", str(HARNESS_ENV),
                                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                               stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the harness env server did not start; see {log_path}")
        time.sleep(0.5)


def trainer_command(args, url: str) -> list[str]:
    env = {"swe": {"kind": "evaluate", "mode": "url", "url": url, "timeout": 1800,
                   "evaluate_kwargs": {"agent": "miniswe", "max_iterations": args.turns}}}
    stages = [{"name": "swe", "min_episodes": 1000, "tasks": [{"env": "swe", "task_id_ranges": [[0, 2]]}]}]
    sets = {"run.name": "cost", "env.envs": json.dumps(env), "curriculum.stages": json.dumps(stages),
            "ppo.batch_size": args.episodes, "generation.max_concurrent_episodes": args.episodes,
            # the endpoint's turn limit above the harness's step limit: the harness ends the episode, never the limit
            "generation.max_turns": args.turns + 2, "generation.max_new_tokens": args.max_new_tokens,
            "generation.max_prompt_tokens": args.max_prompt_tokens, "generation.request_timeout": 1800,
            "checkpointing.save_every": 1000}
    command = [sys.executable, str(ROOT / "train_ppo.py"), "--preset", args.preset, "--output-dir", str(args.out),
               "--max-steps", str(args.steps)]
    for key, value in {**sets, **dict(s.split("=", 1) for s in args.set)}.items():
        command += ["--set", f"{key}={value}"]
    return command


ROWS = (  # (label, metric, scale, unit)
    ("rollout", "perf/rollout_seconds", 1, "s"),
    ("rollout: env (harness + commands)", "perf/env_seconds", 1, "s"),
    ("rollout: generation steps", "perf/generation_seconds", 1, "s"),
    ("generation: prefill", "perf/prefill_seconds", 1, "s"),
    ("generation: decode", "perf/decode_seconds", 1, "s"),
    ("update", "perf/update_seconds", 1, "s"),
    ("update: scoring", "perf/score_seconds", 1, "s"),
    ("prefill tokens", "perf/prefill_tokens", 1, ""),
    ("decode tokens", "perf/decode_tokens", 1, ""),
    ("model calls (turns)", "evaluate/calls", 1, ""),
    ("KV budget, tokens (half the free memory)", "perf/kv_budget_tokens", 1, ""),
    ("KV tokens held at most (kept + running)", "perf/kv_peak_tokens", 1, ""),
    ("tokens the episodes end with", "perf/final_tokens", 1, ""),
    ("rollout peak RSS", "perf/rollout_peak_rss_bytes", GB, "GB"),
    ("rollout: RSS rise", "perf/rollout_rss_rise_bytes", GB, "GB"),
    ("rollout: planned (KV at the peak + folded copies)", "perf/rollout_planned_bytes", GB, "GB"),
    ("update peak RSS", "perf/update_peak_rss_bytes", GB, "GB"),
    ("update: RSS rise", "perf/update_rss_rise_bytes", GB, "GB"),
    ("update: planned (activations + LM head)", "perf/update_planned_bytes", GB, "GB"),
)


def table(records: list[dict], sampled: dict[str, int]) -> list[str]:
    lines = ["| phase | " + " | ".join(f"step {r['step']}" for r in records) + " |",
             "| --- |" + " --- |" * len(records)]
    for label, key, scale, unit in ROWS:
        cells = [(f"{r[key] / scale:.2f} {unit}" if unit else f"{r[key]:.0f}").strip() if key in r else "-"
                 for r in records]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for record in records:
        if record.get("perf/prefill_seconds"):
            record["prefill_tokens_per_s"] = record["perf/prefill_tokens"] / record["perf/prefill_seconds"]
        if record.get("perf/decode_seconds"):
            record["decode_tokens_per_s"] = record["perf/decode_tokens"] / record["perf/decode_seconds"]
    lines.append("| prefill / decode tokens a second | " + " | ".join(
        f"{r.get('prefill_tokens_per_s', 0):.0f} / {r.get('decode_tokens_per_s', 0):.1f}" for r in records) + " |")
    lines.append(f"sampled peaks: trainer {sampled['trainer'] / GB:.2f} GB, "
                 f"harness side {sampled['harness'] / GB:.2f} GB")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the run and its results")
    parser.add_argument("--preset", default="cpu", help="the model's preset (default: cpu, SmolLM2-135M)")
    parser.add_argument("--episodes", type=int, default=2, help="episodes a step, all at once (default: 2)")
    parser.add_argument("--turns", type=int, default=6, help="mini-swe-agent's step limit (default: 6)")
    parser.add_argument("--steps", type=int, default=2, help="PPO steps (default: 2)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="the reply cap (default: 128)")
    parser.add_argument("--max-prompt-tokens", type=int, default=4096, help="the prompt limit (default: 4096)")
    parser.add_argument("--set", action="append", default=[], help="further train_ppo --set KEY=VALUE")
    args = parser.parse_args()
    args.out = args.out.expanduser().resolve()
    miniswe = os.environ.get("MINISWE_PYTHON") or os.path.expanduser("~/.cache/ppo-affine/miniswe-venv/bin/python")
    if not os.access(miniswe, os.X_OK):
        raise SystemExit(f"MINISWE_PYTHON={miniswe}: no Python there; .ci/run installs mini-swe-agent into it")
    args.out.mkdir(parents=True, exist_ok=True)
    server, url = start_harness_server(args.out / "harness_server.log", miniswe)
    started = time.monotonic()
    try:
        with open(args.out / "train.log", "w") as log:
            trainer = subprocess.Popen(trainer_command(args, url), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            sampler = PeakSampler({"trainer": trainer.pid, "harness": server.pid})
            sampler.start()
            code = trainer.wait()
            sampler.stopping.set()
            sampler.join()
    finally:
        server.terminate()
        server.wait(10)
    if code != 0:
        raise SystemExit(f"train_ppo.py exited {code}; see {args.out / 'train.log'}")
    records = [json.loads(line) for line in (args.out / "cost" / "metrics.jsonl").read_text().splitlines()]
    lines = table(records, sampler.peaks)
    print("\n".join(lines))
    result = {"wall_seconds": round(time.monotonic() - started, 1), "sampled_peak_bytes": sampler.peaks,
              "settings": vars(args) | {"out": str(args.out)},
              "steps": [{k: v for k, v in r.items() if k.startswith(("perf/", "evaluate/", "env/", "step"))}
                        for r in records]}
    (args.out / "cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"wall_seconds": result["wall_seconds"], "sampled_peak_gb": {
        k: round(v / GB, 2) for k, v in sampler.peaks.items()}}))


if __name__ == "__main__":
    main()
