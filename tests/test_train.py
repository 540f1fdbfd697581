"""train_ppo.py end to end on a tiny model: the real loop, resume equality, kill safety, bad input."""
import asyncio
import json
import logging
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_ppo
from ppo_affine.checkpoint import find_resumable, verify
from ppo_affine.testing import fake_vllm as fake_vllm_server

ROOT = Path(__file__).resolve().parent.parent
# a script outside the checkout imports the programs at its root the way they run: from the checkout
ROOT_ON_PATH = {**os.environ, "PYTHONPATH": str(ROOT)}
# CI has no GPU; on a CUDA machine `PPO_AFFINE_TEST_DEVICE=cuda pytest tests/test_quantized.py tests/test_train.py`
# runs the tiny model's training runs and the QLoRA tests on the GPU, with bitsandbytes' CUDA kernels.
TEST_DEVICE = os.environ.get("PPO_AFFINE_TEST_DEVICE", "cpu")
TWO_GAMES = ('[{"name": "s", "opponent": "random", "min_episodes": 1000, '
             '"tasks": [{"env": "openspiel", "games": ["leduc_poker", "liars_dice"]}]}]')


def tiny_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    """A run of the tiny model (on TEST_DEVICE) on the embedded game env; `extra` adds or overrides options."""
    sets = {
        "model.name_or_path": str(model_dir), "model.use_4bit": "false", "model.dtype": "float32",
        "model.gradient_checkpointing": "false", "run.device": TEST_DEVICE, "run.name": "t",
        "generation.backend": "local", "generation.max_new_tokens": "3", "generation.max_prompt_tokens": "8192",
        "generation.max_concurrent_episodes": "3", "generation.max_turns": "6",
        "ppo.batch_size": "4", "ppo.ppo_epochs": "2", "ppo.micro_batch_tokens": "16384",
        "curriculum.stages": TWO_GAMES,
    }
    args = ["--output-dir", str(out)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args + list(extra)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("perf/")}


@pytest.mark.slow
@pytest.mark.parametrize("advantage,strategy", [("gae", "full"), ("group", "truncated"), ("gae", "last")])
def test_real_loop_runs_and_checkpoints(tiny_model_dir, tmp_path, advantage, strategy):
    code = train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2",
                                    "--set", f"ppo.advantage={advantage}", "--set", f"generation.context_strategy={strategy}",
                                    "--set", "ppo.group_size=2", "--set", "logging.log_samples_every=1"))
    assert code == 0
    samples = [json.loads(line) for line in (tmp_path / "t" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 2]
    assert samples[0]["messages"][0]["role"] == "system" and samples[0]["messages"][-1]["role"] == "assistant"
    first_call = samples[0]["calls"][0]  # each model call as recorded, for `python -m ppo_affine.episodes show`
    assert first_call["prompt_ids"] and first_call["token_ids"] and samples[0]["model"]["name_or_path"]
    records = metrics(tmp_path / "t")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["env/episodes"] == 4 and record["env/episodes_failed"] == 0
        assert 0.0 <= record["env/score_mean"] <= 1.0
        assert {"policy/loss", "policy/clipfrac", "policy/approx_kl_k3", "update/grad_norm", "kl/coef"} <= set(record)
        assert ("value/loss" in record) == (advantage == "gae")
    games = {k.split("/")[1] for r in records for k in r if k.startswith("game/")}
    assert games <= {"leduc_poker", "liars_dice"} and games
    checkpoint = find_resumable(tmp_path / "t" / "checkpoints")
    assert checkpoint is not None and checkpoint.name == "checkpoint-2" and verify(checkpoint)


@pytest.mark.slow
def test_cut_off_episodes_are_neither_trained_on_nor_counted_by_the_curriculum(tiny_model_dir, tmp_path):
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "1",
                                    "--set", "generation.max_turns=1")) == 0
    [record] = metrics(tmp_path / "t")
    cut_off = record["env/episodes_cut_off"]
    assert cut_off > 0
    assert record["curriculum/stage_episodes"] == 4 - cut_off - record["env/episodes_failed"]
    assert ("policy/loss" in record) == (cut_off < 4)


def straight_and_resumed(args_for, tmp_path, *extra) -> tuple[Path, Path]:
    """One run made twice: four steps straight, and two steps then two more by `--resume latest`; their run folders
    (straight, split). `args_for(output_dir, *more)` gives a run's arguments; `extra` goes to every call (with
    checkpointing.save_every=2 the straight run saves where the split one stopped)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train_ppo.main(args_for(straight, "--max-steps", "4", *extra)) == 0
    assert train_ppo.main(args_for(split, "--max-steps", "2", *extra)) == 0
    assert train_ppo.main(args_for(split, "--max-steps", "4", "--resume", "latest", *extra)) == 0
    return straight / "t", split / "t"


@pytest.mark.slow
def test_resume_latest_reproduces_the_straight_run(tiny_model_dir, tmp_path):
    straight, split = straight_and_resumed(lambda out, *more: tiny_args(tiny_model_dir, out, *more), tmp_path,
                                           "--set", "checkpointing.save_every=2")
    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    if TEST_DEVICE != "cpu":
        # CUDA kernels do not repeat their rounding (an H100 run differed from itself at step 1: memory-efficient
        # attention's backward adds in no fixed order), so on a GPU only what the random streams decide must match
        def drawn(record: dict) -> dict:
            return {k: v for k, v in record.items() if k.startswith(("curriculum/episodes", "env/episodes"))}
        assert [drawn(r) for r in a] == [drawn(r) for r in b]
        return
    assert [deterministic(r) for r in a] == [deterministic(r) for r in b]
    adapter = "checkpoints/checkpoint-4/adapter/adapter_model.safetensors"
    wa, wb = load_file(str(straight / adapter)), load_file(str(split / adapter))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    import train_ppo
    from ppo_affine import checkpoint
    from pathlib import Path
    original = checkpoint.save_checkpoint
    def slow_save(checkpoint_dir, step, write_model, state, keep_last):
        def stall(folder):
            write_model(folder)
            if step == 2:  # the adapter is half written: signal the test and wait to be killed
                Path({marker!r}).write_text("writing")
                time.sleep(600)
        return original(checkpoint_dir, step, stall, state, keep_last)
    train_ppo.save_checkpoint = slow_save
    sys.exit(train_ppo.main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_sigkill_during_checkpoint_write_leaves_previous_checkpoint_resumable(tiny_model_dir, tmp_path):
    marker = tmp_path / "marker"
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_SCRIPT.format(marker=str(marker)))
    args = tiny_args(tiny_model_dir, tmp_path, "--max-steps", "3", "--set", "checkpointing.save_every=1")
    process = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, env=ROOT_ON_PATH)
    deadline = time.time() + 300
    while not marker.exists():
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "the run never reached its second checkpoint"
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    checkpoints = tmp_path / "t" / "checkpoints"
    assert any(p.name.startswith(".tmp-checkpoint-2") for p in checkpoints.iterdir())
    assert not (checkpoints / "latest").exists()  # no pointer to go stale: the newest that verifies is resumed
    assert find_resumable(checkpoints).name == "checkpoint-1"
    assert not any(p.name.startswith(".tmp-") for p in checkpoints.iterdir()), "leftovers were not cleaned"
    assert train_ppo.main(args + ["--resume", "latest"]) == 0
    assert [r["step"] for r in metrics(tmp_path / "t")] == [1, 2, 3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_fake_vllm(model_dir: Path, *flags: str):
    port = _free_port()
    process = fake_vllm_server.start(model_dir, port, *flags)
    yield f"http://127.0.0.1:{port}/v1"
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def fake_vllm_ignoring_adapters(tiny_model_dir):
    """A fake vLLM server of the test's own that accepts adapters but keeps serving the base model."""
    yield from _serve_fake_vllm(tiny_model_dir, "--ignore-adapters")


@pytest.mark.slow
def test_vllm_backend_hot_loads_adapters_and_reports_a_tiny_logprob_gap(tiny_model_dir, tmp_path, fake_vllm):
    code = train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2", "--set", "generation.backend=vllm",
                                    "--set", f"env.vllm_url={fake_vllm}", "--set", "ppo.learning_rate=1e-2"))
    assert code == 0
    records = metrics(tmp_path / "t")
    assert len(records) == 2
    assert all(r["vllm/logprob_gap"] < 1e-3 for r in records)  # the server samples with the trained adapter
    adapters = sorted(p.name for p in (tmp_path / "t" / "vllm_adapters").iterdir())
    assert adapters == ["step-2"], "older adapter folders should be gone once unloaded"


@pytest.mark.slow
def test_the_sampler_correction_weighs_the_vllm_sampled_tokens_and_logs_its_weights(tiny_model_dir, tmp_path,
                                                                                    fake_vllm):
    code = train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2", "--set", "generation.backend=vllm",
                                    "--set", f"env.vllm_url={fake_vllm}", "--set", "ppo.sampler_correction=true"))
    assert code == 0
    records = metrics(tmp_path / "t")
    assert len(records) == 2
    for record in records:
        # the fake server samples with the trainer's weights in float32: every weight is about 1, none capped
        assert record["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert record["tis/clip_fraction"] == 0.0
        assert "policy/loss" in record and "update/grad_norm" in record


def test_the_sampler_correction_the_gpu_config_turns_on_passes_silently_to_local_generation(caplog):
    """config/train_config.json turns the correction on for vLLM; the cpu preset (and `--set generation.backend=local`)
    generate with the trainer itself, where every weight is 1: nothing to warn about."""
    from ppo_affine.config import load_config

    cfg = load_config(presets=["cpu"]).train
    assert cfg.ppo.sampler_correction and cfg.generation.backend == "local"
    with caplog.at_level(logging.WARNING, logger="train_ppo"):
        train_ppo.check_can_train(cfg, world_size=1)
    assert caplog.text == ""


@pytest.mark.slow
def test_local_generation_logs_its_sampling_gap_and_the_correction_weighs_its_tokens(tiny_model_dir, tmp_path):
    """The local sampler (the adapter folded into float32 copies) reports each token's log-prob: the gap to the
    trainer's scores is float noise, every importance weight about 1."""
    code = train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2", "--set", "ppo.learning_rate=1e-2",
                                    "--set", "ppo.sampler_correction=true", "--set", "generation.temperature=0.7"))
    assert code == 0
    records = metrics(tmp_path / "t")
    assert len(records) == 2
    for record in records:
        assert 0.0 <= record["local/logprob_gap"] < 1e-4 and "vllm/logprob_gap" not in record
        assert record["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4) and record["tis/clip_fraction"] == 0.0
        # the KV budget's readings: a default budget from free memory, the batch and caches held within it
        assert 0 < record["perf/kv_peak_tokens"] <= record["perf/kv_budget_tokens"]
        assert record["perf/out_of_memory_retries"] == 0 and record["perf/kv_evicted_caches"] >= 0
        # the prompt tokens run through the model, beside what the episodes hold at their end
        assert 0 < record["perf/prefill_tokens"] and 0 < record["perf/final_tokens"]


def served_adapters(url: str) -> list[str]:
    import httpx

    return [m["id"] for m in httpx.get(f"{url}/models").json()["data"] if m.get("parent")]


@pytest.mark.slow
def test_resume_against_the_same_vllm_server_and_adapters_unloaded_at_exit(tiny_model_dir, tmp_path, fake_vllm):
    args = tiny_args(tiny_model_dir, tmp_path, "--set", "generation.backend=vllm", "--set", f"env.vllm_url={fake_vllm}")
    assert train_ppo.main(args + ["--max-steps", "1"]) == 0
    assert served_adapters(fake_vllm) == []  # the first process unloaded what it loaded
    assert train_ppo.main(args + ["--max-steps", "2", "--resume", "latest"]) == 0  # its names never collide
    assert served_adapters(fake_vllm) == [] and [r["step"] for r in metrics(tmp_path / "t")] == [1, 2]


@pytest.mark.slow  # uses the module's fake vLLM server (about 15 s to start)
def test_a_leftover_adapter_name_gets_a_fresh_one(tiny_policy, fake_vllm, tmp_path):
    from ppo_affine.generation import VLLMGenerator
    from ppo_affine.config import GenerationConfig

    tiny_policy.save(tmp_path)

    async def load_twice():
        model = fake_vllm_model(fake_vllm)
        first = VLLMGenerator(fake_vllm, model, tiny_policy.tokenizer, GenerationConfig(), 16, {0})
        second = VLLMGenerator(fake_vllm, model, tiny_policy.tokenizer, GenerationConfig(), 16, {0})
        second.instance = first.instance  # as if an earlier process had left this very name loaded
        names = [await first.load_adapter(tmp_path / "adapter", "run-step-1"),
                 await second.load_adapter(tmp_path / "adapter", "run-step-1")]
        await first.close()
        await second.close()
        return names

    first_name, second_name = asyncio.run(load_twice())
    assert second_name != first_name and second_name.startswith(first_name)
    assert served_adapters(fake_vllm) == []


def fake_vllm_model(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/models").json()["data"][0]["id"]


@pytest.mark.slow
def test_a_vllm_context_shorter_than_the_config_stops_at_start_with_the_flag(tiny_model_dir, tmp_path, fake_vllm):
    """The module's server runs the fake's default --max-model-len 32768; this run needs 32771."""
    result = _run_cli(*tiny_args(tiny_model_dir, tmp_path, "--set", "generation.backend=vllm",
                                 "--set", f"env.vllm_url={fake_vllm}", "--set", "generation.max_prompt_tokens=32768"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--max-model-len 32768" in result.stderr and "--max-model-len 32771" in result.stderr


@pytest.mark.slow
def test_a_vllm_serving_another_model_name_is_refused_with_the_flag(tiny_model_dir, tmp_path, fake_vllm):
    """The module's server serves the tiny model under its folder's name; this run's model is a copy elsewhere."""
    copy = shutil.copytree(tiny_model_dir, tmp_path / "tiny-model-copy")
    result = _run_cli(*tiny_args(copy, tmp_path, "--set", "generation.backend=vllm",
                                 "--set", f"env.vllm_url={fake_vllm}"))
    assert result.returncode == 1 and f"serves [{str(tiny_model_dir)!r}" in result.stderr
    assert f"--served-model-name {copy}" in result.stderr


@pytest.mark.slow
def test_a_server_that_ignores_adapters_is_caught_before_training(tiny_model_dir, tmp_path, fake_vllm_ignoring_adapters,
                                                                  capsys):
    """The start-up probe: a server that accepts adapters but serves the base model stops the run before its first
    sample, in one line naming the likely upstream bugs; the probe adapter is unloaded and its folder removed."""
    code = train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "3", "--set", "generation.backend=vllm",
                                    "--set", f"env.vllm_url={fake_vllm_ignoring_adapters}"))
    assert code == 1
    message = capsys.readouterr().err
    assert "does not apply LoRA adapters as the trainer does" in message and "vLLM #49354" in message
    assert "SGLang #30499" in message and "Traceback" not in message
    assert not (tmp_path / "t" / "metrics.jsonl").exists() or metrics(tmp_path / "t") == []
    assert not (tmp_path / "t" / "vllm_adapters" / "probe").exists()
    assert served_adapters(fake_vllm_ignoring_adapters) == []


@pytest.mark.slow
def test_without_the_probe_the_logprob_gap_exposes_a_server_that_ignores_the_adapter(tiny_model_dir, tmp_path,
                                                                                      fake_vllm_ignoring_adapters):
    """generation.check_adapter=false (for stand-in servers that run no model) trains on; the gap metric then shows
    what the probe would have stopped."""
    code = train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "3", "--set", "generation.backend=vllm",
                                    "--set", f"env.vllm_url={fake_vllm_ignoring_adapters}",
                                    "--set", "generation.check_adapter=false", "--set", "ppo.learning_rate=3e-2",
                                    "--set", "ppo.kl_stop=null"))
    assert code == 0
    records = metrics(tmp_path / "t")
    assert records[0]["vllm/logprob_gap"] < 1e-3  # step 1 samples the initial (zero) adapter == base
    assert records[-1]["vllm/logprob_gap"] > 1e-2  # later the trainer's weights moved, the server's did not


@pytest.mark.slow
def test_a_server_that_applies_adapters_passes_the_probe(tiny_model_dir, tmp_path, fake_vllm, capsys):
    code = train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "1", "--set", "generation.backend=vllm",
                                    "--set", f"env.vllm_url={fake_vllm}"))
    assert code == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if "applies the adapter" in line]
    moved, gap = (float(x) for x in re.findall(r"by up to ([0-9.e-]+) nats.*within ([0-9.e-]+) of", line)[0])
    assert moved >= 0.5 and gap < 1e-3  # the fake server runs the trainer's float32 weights


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_typo_in_a_config_key_is_one_paragraph_naming_file_and_field(tmp_path):
    bad = tmp_path / "train.json"
    bad.write_text(json.dumps({"ppo": {"learning_rat": 1e-5}}))
    result = _run_cli("--config", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert str(bad) in result.stderr and "ppo.learning_rat" in result.stderr and "unknown key" in result.stderr


def test_negative_learning_rate_is_rejected_with_the_field_and_value(tmp_path):
    result = _run_cli("--preset", "cpu", "--set", "ppo.learning_rate=-1e-5")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "ppo.learning_rate" in result.stderr and "greater than 0" in result.stderr and "-1e-05" in result.stderr


def test_per_game_mcts_budgets_name_known_games():
    from ppo_affine.config import ConfigError, load_config

    config = load_config(presets=["cpu"], overrides=['env.envs.openspiel.mcts_simulations={"liars_dice": 300}'])
    assert config.env.envs["openspiel"].mcts_simulations == {"liars_dice": 300}
    with pytest.raises(ConfigError, match=r"mcts_simulations.*unknown games \['liars'\]"):
        load_config(presets=["cpu"], overrides=['env.envs.openspiel.mcts_simulations={"liars": 300}'])


def test_missing_config_file_is_reported(tmp_path):
    result = _run_cli("--env-config", str(tmp_path / "nope.json"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "nope.json does not exist" in result.stderr


@pytest.mark.parametrize("sets,fields", [
    (["value_head.warmup_steps=2", "ppo.advantage=group"], ["value_head.warmup_steps", "ppo.advantage"]),
    (["value_head.warmup_steps=3"], ["value_head.warmup_steps", "run.max_steps"]),
    (["generation.temperature=0"], ["generation.temperature"]),
])
def test_options_that_cannot_train_together_are_a_one_line_error(sets, fields):
    result = _run_cli("--preset", "cpu", *[arg for s in sets for arg in ("--set", s)])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1 and all(field in message for field in fields), message


def test_a_fresh_start_refuses_a_run_folder_with_checkpoints(tmp_path):
    (tmp_path / "cpu-demo" / "checkpoints" / "checkpoint-3").mkdir(parents=True)
    result = _run_cli("--preset", "cpu", "--output-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "checkpoint-3" in result.stderr and "--resume latest" in result.stderr
    assert (tmp_path / "cpu-demo" / "checkpoints" / "checkpoint-3").is_dir()


def test_default_config_without_its_model_points_to_the_cpu_preset(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a machine that cannot reach the Hub and never downloaded Qwen3
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    result = _run_cli()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "model.name_or_path='Qwen/Qwen3-4B'" in result.stderr and "--preset cpu" in result.stderr


@pytest.mark.slow
def test_unreachable_vllm_url_is_one_paragraph_with_the_server_command(tiny_model_dir, tmp_path):
    result = _run_cli(*tiny_args(tiny_model_dir, tmp_path, "--set", "generation.backend=vllm",
                                 "--set", f"env.vllm_url=http://127.0.0.1:{_free_port()}/v1"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "not reachable" in result.stderr and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in result.stderr
    assert "--enable-lora" in result.stderr


@pytest.mark.slow
def test_sigterm_mid_run_saves_and_exits_cleanly(tiny_model_dir, tmp_path):
    args = tiny_args(tiny_model_dir, tmp_path, "--max-steps", "1000", "--set", "checkpointing.save_every=1000")
    process = subprocess.Popen([sys.executable, str(ROOT / "train_ppo.py"), *args], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics_file = tmp_path / "t" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 1):
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]  # a scheduler sees a preempted run
    step = len(metrics(tmp_path / "t"))
    checkpoint = find_resumable(tmp_path / "t" / "checkpoints")
    assert checkpoint is not None and checkpoint.name == f"checkpoint-{step}"
    assert os.path.exists(checkpoint / "adapter" / "adapter_config.json")


# Runs train_ppo with an update that, at step 2, signals the test after its first optimizer step and then
# waits: with {checks} the update looks for the stop flag again (as the real one does before every
# minibatch), without it the update ignores it (a long update that only a second signal may cut short).
SIGNAL_IN_UPDATE_SCRIPT = textwrap.dedent("""
    import sys, time
    import train_ppo
    from pathlib import Path
    original = train_ppo.ppo_update
    calls = []
    def ppo_update(*args, check_stop, **kwargs):
        calls.append(1)
        minibatches = []
        def wait_for_the_signal():
            minibatches.append(1)
            if len(calls) == 2 and len(minibatches) == 2:
                Path({marker!r}).write_text("updating")
                for _ in range(600):
                    if {checks}:
                        check_stop()
                    time.sleep(0.1)
            check_stop()
        return original(*args, check_stop=wait_for_the_signal, **kwargs)
    train_ppo.ppo_update = ppo_update
    sys.exit(train_ppo.main(sys.argv[1:]))
""")


def adapter_weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "t" / "checkpoints" / f"checkpoint-{step}" / "adapter" / "adapter_model.safetensors"))


def start_and_wait_for_the_update(tmp_path, args, checks: bool) -> subprocess.Popen:
    marker = tmp_path / "marker"
    script = tmp_path / "signal_in_update.py"
    script.write_text(SIGNAL_IN_UPDATE_SCRIPT.format(marker=str(marker),
                                                     checks=checks))
    process = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=ROOT_ON_PATH)  # one stream: the run's lines
    deadline = time.time() + 300
    while not marker.exists():
        assert process.poll() is None, process.stdout.read()[-2000:]
        assert time.time() < deadline, "the run never reached the update of its second step"
        time.sleep(0.2)
    return process


@pytest.mark.slow
def test_sigterm_during_the_update_saves_the_last_finished_step_and_resumes_as_if_never_stopped(tiny_model_dir,
                                                                                                 tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    # the reference runs in a fresh interpreter as the stopped run does: nothing earlier tests left in this
    # process can tell the two apart
    straight_run = _run_cli(*tiny_args(tiny_model_dir, straight, "--max-steps", "2", "--set",
                                       "checkpointing.save_every=1"))
    assert straight_run.returncode == 0, straight_run.stderr[-2000:]
    stopped.mkdir()
    args = tiny_args(tiny_model_dir, stopped, "--max-steps", "2", "--set", "checkpointing.save_every=1000")
    process = start_and_wait_for_the_update(stopped, args, checks=True)
    signalled = time.time()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, output[-2000:]
    assert time.time() - signalled < 30
    # the half-done update of step 2 was undone: checkpoint-1 holds exactly the weights step 1 left
    assert find_resumable(stopped / "t" / "checkpoints").name == "checkpoint-1"
    saved, reference = adapter_weights(stopped, 1), adapter_weights(straight, 1)
    differ = {k: (saved[k] - reference[k]).abs().max().item() for k in reference
              if not torch.equal(saved[k], reference[k])}
    assert not differ, (differ, metrics(stopped / "t"), metrics(straight / "t")[:1])
    assert [r["step"] for r in metrics(stopped / "t")] == [1]

    resumed = _run_cli(*args, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [deterministic(r) for r in metrics(stopped / "t")] == [deterministic(r) for r in metrics(straight / "t")]
    final, reference = adapter_weights(stopped, 2), adapter_weights(straight, 2)
    assert all(torch.equal(final[k], reference[k]) for k in reference)


@pytest.mark.slow
def test_a_second_signal_exits_at_once_leaving_the_last_checkpoint_resumable(tiny_model_dir, tmp_path):
    args = tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2", "--set", "checkpointing.save_every=1")
    process = start_and_wait_for_the_update(tmp_path, args, checks=False)
    process.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert process.poll() is None  # the first signal only asks the loop to stop at its next check
    signalled = time.time()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM and time.time() - signalled < 5, output[-2000:]
    assert "send again to exit at once" in " ".join(output.split())  # rich wraps the line
    assert find_resumable(tmp_path / "t" / "checkpoints").name == "checkpoint-1"
    assert train_ppo.main(args + ["--resume", "latest"]) == 0
    assert [r["step"] for r in metrics(tmp_path / "t")] == [1, 2]


def out_of_memory_once(original, budgets: list[int]):
    """`original` (the update), raising CUDA's out-of-memory error on its first call; records each call's budget."""

    def update(policy, optimizer, sequences, cfg, *args, **kwargs):
        budgets.append(cfg.micro_batch_tokens)
        if len(budgets) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(policy, optimizer, sequences, cfg, *args, **kwargs)

    return update


@pytest.mark.slow
def test_out_of_memory_in_the_update_halves_the_token_budget_and_retries_the_step(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    budgets: list[int] = []
    original = train_ppo.ppo_update
    monkeypatch.setattr(train_ppo, "ppo_update", out_of_memory_once(original, budgets))
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2")) == 0
    assert budgets == [16384, 8192, 8192]  # the failed try, its retry, then step 2 keeps the halved budget
    records = metrics(tmp_path / "t")
    assert [(r["step"], r["train/micro_batch_tokens"], r["train/oom_retries"]) for r in records] == \
        [(1, 8192, 1), (2, 8192, 0)]
    assert "policy/loss" in records[0]

    # the halved budget outlives a resume on the same setting; a setting changed since wins
    resumed: list[int] = []

    def recording(policy, optimizer, sequences, cfg, *args, **kwargs):
        resumed.append(cfg.micro_batch_tokens)
        return original(policy, optimizer, sequences, cfg, *args, **kwargs)

    monkeypatch.setattr(train_ppo, "ppo_update", recording)
    args = tiny_args(tiny_model_dir, tmp_path, "--resume", "latest")
    assert train_ppo.main(args + ["--max-steps", "3"]) == 0
    assert train_ppo.main(args + ["--max-steps", "4", "--set", "ppo.micro_batch_tokens=4096"]) == 0
    assert resumed == [8192, 4096]
    assert [r["train/micro_batch_tokens"] for r in metrics(tmp_path / "t")][2:] == [8192, 4096]


@pytest.mark.slow
def test_out_of_memory_on_an_episode_drops_it_and_the_step_goes_on_a_second_halves_the_budget_until_clean_steps(
        tiny_model_dir, tmp_path, monkeypatch):
    from ppo_affine.policy import Policy

    calls = []
    score = Policy.score

    def out_of_memory_twice(self, *args, **kwargs):  # the first two scoring passes of the run fail
        calls.append(1)
        if len(calls) <= 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return score(self, *args, **kwargs)

    monkeypatch.setattr(Policy, "score", out_of_memory_twice)
    args = tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2", "--set", "ppo.micro_batch_regrow_steps=1")
    assert train_ppo.main(args) == 0
    records = metrics(tmp_path / "t")
    summary = [(r["step"], r["train/episodes_dropped_oom"], r["train/oom_retries"], r["train/micro_batch_tokens"])
               for r in records]
    # step 1: the first error drops an episode, the second halves 16384; step 2 runs clean and doubles it back
    assert summary == [(1, 1, 2, 8192), (2, 0, 0, 16384)]
    assert "policy/loss" in records[0] and records[0]["env/episodes"] == 4


@pytest.mark.slow
def test_an_episode_longer_than_the_sequence_limit_is_dropped_before_the_update(tiny_model_dir, tmp_path, capsys):
    # every episode of the tiny game is a few hundred tokens: a 64-token limit drops the batch, the run goes on
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "1",
                                    "--set", "ppo.max_sequence_tokens=64")) == 0
    record = metrics(tmp_path / "t")[0]
    assert record["train/episodes_too_long"] == 4 and record["train/longest_dropped_tokens"] > 64
    assert "policy/loss" not in record
    assert "over ppo.max_sequence_tokens=64" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_a_single_sequence_that_does_not_fit_stops_with_the_generation_limits(tiny_model_dir, tmp_path, monkeypatch,
                                                                              capsys):
    def always_out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(train_ppo, "score_sequences", always_out_of_memory)
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2")) == 1
    message = " ".join(capsys.readouterr().err.split())
    assert "CUDA ran out of memory on a single sequence" in message
    assert "generation.max_prompt_tokens (8192)" in message and "generation.max_new_tokens (3)" in message
    assert not (tmp_path / "t" / "metrics.jsonl").exists() or metrics(tmp_path / "t") == []


@pytest.mark.slow
def test_a_vllm_server_that_dies_mid_rollout_is_waited_for_and_its_episodes_replayed(tiny_model_dir, tmp_path):
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}/v1"
    servers = [fake_vllm_server.start(tiny_model_dir, port, "--exit-after-completions", "3")]

    def restart_once_it_died():
        servers[0].wait()
        time.sleep(2.0)  # down long enough for the trainer's quick retries to be spent
        servers.append(fake_vllm_server.start(tiny_model_dir, port))

    restarter = threading.Thread(target=restart_once_it_died, daemon=True)
    restarter.start()
    try:
        code = train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2", "--set",
                                        "generation.backend=vllm", "--set", f"env.vllm_url={url}",
                                        "--set", "generation.request_retries=1", "--set", "ppo.learning_rate=1e-2"))
        restarter.join(timeout=60)
        stats = httpx.get(f"http://127.0.0.1:{port}/test/stats").json()
    finally:
        for server in servers:
            server.kill()
            server.wait()
    assert code == 0 and len(servers) == 2
    records = metrics(tmp_path / "t")
    assert [r["env/episodes_failed"] for r in records] == [0, 0]
    assert records[0]["env/episodes_replayed"] >= 1 and records[1]["env/episodes_replayed"] == 0
    assert records[0]["curriculum/stage_episodes"] == 4 - records[0]["env/episodes_cut_off"]  # each counted once
    # the restarted server got the step-0 adapter back before serving the replays, then each new one
    assert [name.split("-step-")[1].split("-")[0] for name in stats["loaded"]] == ["0", "1", "2"]
    assert all(r["vllm/logprob_gap"] < 1e-3 for r in records)


def corrupt_cpu_checkpoint(folder: Path, bad_file: str = "trainer_state.pt") -> Path:
    """checkpoint-6 of a cpu-preset run under `folder`, `bad_file` in it truncated as a crashed copy leaves it."""
    from ppo_affine.checkpoint import save_checkpoint
    from ppo_affine.config import load_config

    config = load_config(presets=["cpu"]).model_dump(mode="json")

    def write_model(checkpoint: Path) -> None:
        (checkpoint / "adapter").mkdir()
        (checkpoint / "adapter" / "adapter_config.json").write_text('{"r": 16}')

    saved = save_checkpoint(folder / "cpu-demo" / "checkpoints", 6, write_model, {"step": 6, "config": config},
                            keep_last=2)
    with open(saved / bad_file, "r+b") as handle:
        handle.truncate(3)
    return saved


# training reads all of a checkpoint; evaluate.py and merge.py its adapter and configuration alone
@pytest.mark.parametrize("program,bad_file", [("train_ppo.py --resume", "trainer_state.pt"),
                                              ("train_ppo.py --resume", "adapter/adapter_config.json"),
                                              ("evaluate.py --games leduc_poker --checkpoint",
                                               "adapter/adapter_config.json"),
                                              ("merge.py --output OUT --checkpoint", "adapter/adapter_config.json")])
def test_a_corrupt_checkpoint_is_one_line_naming_the_file_before_any_model_loads(tmp_path, program, bad_file):
    checkpoint = corrupt_cpu_checkpoint(tmp_path, bad_file)
    before = sorted(p for p in tmp_path.rglob("*"))
    script, *options = program.replace("OUT", str(tmp_path / "merged")).split()
    result = subprocess.run([sys.executable, str(ROOT / script), *options, str(checkpoint)], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)  # no preset: the default model is never loaded
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert f"{checkpoint / bad_file} is 3 bytes where its manifest says" in message
    assert sorted(p for p in tmp_path.rglob("*")) == before  # no run folder, no output folder, nothing renamed


def test_resume_latest_without_a_checkpoint_says_where_it_looked_and_creates_nothing(tmp_path):
    result = _run_cli("--preset", "cpu", "--output-dir", str(tmp_path / "runs"), "--resume", "latest")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"no complete checkpoint under {tmp_path / 'runs' / 'cpu-demo' / 'checkpoints'}" in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_good_one_outlives_it(tiny_model_dir, tmp_path, capfd):
    run = tmp_path / "t"
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2", "--set",
                                    "checkpointing.save_every=1", "--set", "checkpointing.keep_last=2")) == 0
    with open(run / "checkpoints" / "checkpoint-2" / "trainer_state.pt", "r+b") as handle:
        handle.truncate(1000)
    capfd.readouterr()
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "3", "--resume", "latest")) == 0
    printed = " ".join(capfd.readouterr().out.split())  # the console wraps long lines
    assert "trainer_state.pt is 1,000 bytes where its manifest says" in printed
    assert "set aside as corrupt-checkpoint-2" in printed
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["checkpoint-2", "checkpoint-3", "corrupt-checkpoint-2"]  # steps 2 and 3 trained again from 1
    assert verify(run / "checkpoints" / "checkpoint-2") and verify(run / "checkpoints" / "checkpoint-3")
    assert [r["step"] for r in metrics(run)][-2:] == [2, 3]


@pytest.mark.slow
def test_an_owned_vllm_server_is_started_used_restarted_after_a_crash_and_stopped(tiny_model_dir, tmp_path):
    """generation.vllm_server.python: the trainer starts the server itself (here the stand-in, which takes vLLM's
    flags), serves from it, starts it again when it dies mid-rollout, and stops it at the end."""
    import httpx

    port = _free_port()
    marker = tmp_path / "crashed-once"
    extra = json.dumps(["--exit-after-completions", "3", "--exit-once-marker", str(marker)])
    code = train_ppo.main(tiny_args(
        tiny_model_dir, tmp_path, "--max-steps", "2", "--set", "generation.backend=vllm",
        "--set", f"generation.vllm_server.python={sys.executable}",
        "--set", "generation.vllm_server.module=ppo_affine.testing.fake_vllm",
        "--set", f"generation.vllm_server.port={port}", "--set", f"generation.vllm_server.extra_args={extra}",
        "--set", "generation.request_retries=1"))
    assert code == 0 and marker.exists()
    log = (tmp_path / "t" / "vllm.log").read_text()
    assert log.count("==> ") == 2  # started, crashed on its 3rd completion, started again
    assert "--enable-lora" in log and f"--port {port}" in log
    records = metrics(tmp_path / "t")
    assert [r["env/episodes_failed"] for r in records] == [0, 0] and records[0]["env/episodes_replayed"] >= 1
    with pytest.raises(httpx.HTTPError):  # stopped with the run
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2.0)


# ---------------------------------------------------------------------- write failures, time-based saves, branches, train.log
def the_one_line(err: str) -> str:
    """What a run printed on standard error besides the libraries' progress bars: must be one line."""
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def torch_writer_fails_at(step: int, original):
    """torch.save whose zip writer gives up (as on a full disk) when it writes the trainer state of `step`."""

    def save(obj, path, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == step:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed")
        return original(obj, path, *args, **kwargs)

    return save


@pytest.mark.slow
def test_torchs_writer_failing_mid_run_is_one_line_and_the_last_checkpoint_resumes(tiny_model_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    from ppo_affine import checkpoint

    args = tiny_args(tiny_model_dir, tmp_path, "--set", "checkpointing.save_every=1")
    monkeypatch.setattr(checkpoint.torch, "save", torch_writer_fails_at(2, torch.save))
    assert train_ppo.main(args + ["--max-steps", "3"]) == 1
    message = the_one_line(capsys.readouterr().err)
    assert message.startswith(f"Stopped: Could not write checkpoint-2 in {tmp_path / 't' / 'checkpoints'} "
                              "([enforce fail at inline_container.cc:672]")
    assert "free there" in message and "checkpoint-1 is intact" in message
    assert "Stopped: Could not write checkpoint-2" in (tmp_path / "t" / "train.log").read_text()  # the log has it
    checkpoints = tmp_path / "t" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-1"]
    monkeypatch.undo()
    assert train_ppo.main(args + ["--max-steps", "2", "--resume", "latest"]) == 0
    assert [r["step"] for r in metrics(tmp_path / "t")] == [1, 2]


@pytest.mark.slow
def test_a_full_disk_under_the_metrics_is_one_line_with_the_file(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from ppo_affine import run_log

    def full_after_one_line(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and mode == "a" and Path(path).exists():
            raise OSError(28, "No space left on device")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(run_log, "open", full_after_one_line, raising=False)
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "3",
                                    "--set", "checkpointing.save_every=1")) == 1
    message = the_one_line(capsys.readouterr().err)
    assert message.startswith(f"Stopped: Could not write the metrics {tmp_path / 't' / 'metrics.jsonl'}: "
                              "No space left on device; ") and message.endswith("MB free there.")
    assert find_resumable(tmp_path / "t" / "checkpoints").name == "checkpoint-1"


@pytest.mark.parametrize("code,reason", [(30, "Read-only file system"), (13, "Permission denied"),
                                         (28, "No space left on device")])
def test_an_unwritable_run_folder_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys, code, reason):
    from ppo_affine import file_writes

    def refused(path, *args, **kwargs):
        raise OSError(code, reason, str(path))

    monkeypatch.setattr(file_writes, "open", refused, raising=False)  # the probe's write
    monkeypatch.setattr(train_ppo, "Trainer", lambda *a, **k: pytest.fail("the model was loaded"))
    assert train_ppo.main(["--preset", "cpu", "--output-dir", str(tmp_path)]) == 1
    message = the_one_line(capsys.readouterr().err)
    assert message.startswith(f"Stopped: Could not write the run folder {tmp_path / 'cpu-demo' / '.write-probe-'}")
    assert f": {reason}; " in message and message.endswith("MB free there.")


def test_a_run_folder_under_a_regular_file_is_one_line_before_the_model_loads(tmp_path):
    (tmp_path / "runs").write_text("not a folder")
    result = _run_cli("--preset", "cpu", "--output-dir", str(tmp_path / "runs"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert str(tmp_path / "runs") in message and "a file stands where a folder is needed" in message
    assert "free there" in message


@pytest.mark.slow
def test_a_read_only_run_folder_at_resume_is_one_line_and_the_checkpoint_stays(tiny_model_dir, tmp_path, monkeypatch,
                                                                               capsys):
    from ppo_affine import file_writes

    args = tiny_args(tiny_model_dir, tmp_path)
    assert train_ppo.main(args + ["--max-steps", "1"]) == 0
    capsys.readouterr()

    def read_only(path, *a, **k):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(file_writes, "open", read_only, raising=False)
    assert train_ppo.main(args + ["--max-steps", "2", "--resume", "latest"]) == 1
    message = the_one_line(capsys.readouterr().err)
    assert "Read-only file system" in message and "free there" in message
    assert verify(tmp_path / "t" / "checkpoints" / "checkpoint-1")


def test_the_time_to_save_is_rank_0s_clock_on_every_rank():
    """Rank 1's own clock says 30 minutes have passed; rank 0's, which `from_main` delivers, says not: no save."""
    from types import SimpleNamespace

    from ppo_affine.config import load_config

    config = load_config(presets=["cpu"], overrides=["checkpointing.save_every=50", "run.max_steps=100"])
    asked = []

    class RankOne:
        is_main = False

        def from_main(self, compute):
            asked.append(compute)
            return False  # rank 0's answer

    trainer = SimpleNamespace(config=config, step=7, ranks=RankOne(), saved_at=time.monotonic() - 3600,
                              stopping=lambda: False)
    assert train_ppo.Trainer.save_due(trainer) is False and len(asked) == 1
    assert asked[0]() is True  # this rank's own clock would have saved
    trainer.step = 50
    assert train_ppo.Trainer.save_due(trainer) is True


@pytest.mark.slow
def test_save_every_minutes_saves_between_the_step_checkpoints(tiny_model_dir, tmp_path):
    common = ["--max-steps", "3", "--set", "checkpointing.save_every=1000", "--set", "checkpointing.keep_last=5"]
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path / "timed", *common,
                                    "--set", "checkpointing.save_every_minutes=0.0001")) == 0
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path / "steps", *common,
                                    "--set", "checkpointing.save_every_minutes=null")) == 0
    names = lambda out: sorted(p.name for p in (out / "t" / "checkpoints").iterdir())  # noqa: E731
    assert names(tmp_path / "timed") == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]  # each step took > 6 ms
    assert names(tmp_path / "steps") == ["checkpoint-3"]


@pytest.mark.slow
def test_resuming_an_older_checkpoint_sets_the_newer_branch_aside_and_latest_follows_the_new_one(tiny_model_dir,
                                                                                                  tmp_path, capfd):
    args = tiny_args(tiny_model_dir, tmp_path, "--set", "checkpointing.save_every=1", "--set",
                     "checkpointing.keep_last=2")
    assert train_ppo.main(args + ["--max-steps", "3"]) == 0
    checkpoints = tmp_path / "t" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    old_three = adapter_weights(tmp_path, 3)
    capfd.readouterr()
    assert train_ppo.main(args + ["--max-steps", "3", "--resume", str(checkpoints / "checkpoint-2")]) == 0
    printed = " ".join(capfd.readouterr().out.split())
    assert "the newer checkpoint-3 of the branch it ends set aside as abandoned-checkpoint-3" in printed
    assert sorted(p.name for p in checkpoints.iterdir()) == ["abandoned-checkpoint-3", "checkpoint-2", "checkpoint-3"]
    abandoned = load_file(str(checkpoints / "abandoned-checkpoint-3" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(abandoned[k], old_three[k]) for k in old_three)  # kept as it was
    assert train_ppo.main(args + ["--max-steps", "4", "--resume", "latest"]) == 0  # goes on from the new branch's 3
    assert sorted(p.name for p in checkpoints.iterdir()) == ["abandoned-checkpoint-3", "checkpoint-3", "checkpoint-4"]
    assert [r["step"] for r in metrics(tmp_path / "t")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_train_log_holds_the_lines_before_the_run_folder_was_known_and_the_summary(tiny_model_dir, tmp_path):
    """A resume that sets a corrupt checkpoint aside: the warning (written before the run folder is known), the resume,
    the step lines and the closing summary all reach train.log."""
    args = tiny_args(tiny_model_dir, tmp_path, "--set", "checkpointing.save_every=1")
    assert train_ppo.main(args + ["--max-steps", "2"]) == 0
    with open(tmp_path / "t" / "checkpoints" / "checkpoint-2" / "trainer_state.pt", "r+b") as handle:
        handle.truncate(1000)
    assert train_ppo.main(args + ["--max-steps", "3", "--resume", "latest"]) == 0
    log = (tmp_path / "t" / "train.log").read_text()
    for line in ("trainer_state.pt is 1,000 bytes where its manifest says", "set aside as corrupt-checkpoint-2",
                 "resumed from", "STEP step     2", "STEP step     3", "run folder:  ", "last step:   3"):
        assert line in log, line
    assert log.index("set aside as corrupt-checkpoint-2") < log.index("resumed from") < log.index("STEP step     3")


@pytest.mark.slow
def test_a_fresh_run_moves_an_earlier_metrics_file_aside_with_one_line(tiny_model_dir, tmp_path, capfd):
    run = tmp_path / "t"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "env/score_mean": 0.25}\n{"step": 2, "env/score_mean": 0.5}\n')
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "1")) == 0
    [kept] = run.glob("metrics.before-*.jsonl")
    assert kept.read_text() == '{"step": 1, "env/score_mean": 0.25}\n{"step": 2, "env/score_mean": 0.5}\n'
    assert [r["step"] for r in metrics(run)] == [1]
    printed = " ".join(capfd.readouterr().out.split())
    assert f"already held metrics.jsonl of an earlier run: renamed to {kept.name}" in printed


@pytest.mark.slow
def test_evaluate_after_a_run_with_its_own_vllm_server_starts_one_as_the_run_did(tiny_model_dir, tmp_path):
    """The README's evaluation command after a GPU run: the checkpoint alone, no --set. The run started its own server
    (here the stand-in), so evaluate.py starts one the same way, plays through it and stops it."""
    import httpx

    port = _free_port()
    assert train_ppo.main(tiny_args(
        tiny_model_dir, tmp_path, "--max-steps", "1", "--set", "generation.backend=vllm",
        "--set", f"generation.vllm_server.python={sys.executable}",
        "--set", "generation.vllm_server.module=ppo_affine.testing.fake_vllm",
        "--set", f"generation.vllm_server.port={port}")) == 0
    out = tmp_path / "eval"
    done = subprocess.run([sys.executable, str(ROOT / "evaluate.py"),
                           "--checkpoint", str(tmp_path / "t" / "checkpoints" / "checkpoint-1"), "--games", "leduc_poker",
                           "--episodes", "2", "--opponent", "random", "--max-new-tokens", "3", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["backend"] == "vllm" and summary["settings"]["temperature"] == 0.0
    assert summary["models"]["adapter"]["leduc_poker"]["episodes"] == 2
    assert all(e["error"] is None for e in map(json.loads, (out / "episodes.jsonl").read_text().splitlines()))
    server_log = (out / "vllm.log").read_text()
    assert server_log.count("==> ") == 1 and "-m ppo_affine.testing.fake_vllm" in server_log
    assert f"--port {port}" not in server_log  # a free port of its own: the run's may still be taken
    assert "stopped the vLLM server of this run" in done.stdout
