"""The QLoRA path on CPU (on TEST_DEVICE: a GPU where one is): a 4-bit NF4 base (bitsandbytes), LoRA on its
Linear4bit layers, the value head, gradient checkpointing, training, checkpoint and exact resume, the merge
onto the dequantised base and the weights exported for vLLM, all on the tiny model."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import merge
import prepare_model
import train_ppo
from ppo_affine.model_files import load_dequantised_base
from ppo_affine.policy import load_policy
from test_train import TEST_DEVICE, deterministic, metrics, tiny_args
from ppo_affine.config import ConfigError, LoraConfig, ModelConfig

ROOT = Path(__file__).resolve().parent.parent
DEVICE = torch.device(TEST_DEVICE)


def nf4(model_dir: Path, **fields) -> ModelConfig:
    return ModelConfig(name_or_path=str(model_dir), use_4bit=True, dtype="float32", **{
        "gradient_checkpointing": False, **fields})


def nf4_sets(model_dir: Path) -> list[str]:
    """The --set options of merge.py and prepare_model.py for the tiny model's 4-bit base."""
    return [f"model.name_or_path={model_dir}", "model.use_4bit=true", "model.dtype=float32",
            f"run.device={TEST_DEVICE}"]


def qlora_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return tiny_args(model_dir, out, "--set", "model.use_4bit=true", "--set", "model.gradient_checkpointing=true",
                     *extra)


def prompt_ids(n: int = 24, rows: int = 3) -> torch.Tensor:
    return torch.arange(rows * n).reshape(rows, n) % 900 + 10  # [B, T]


@pytest.fixture(scope="module")
def qlora_run(tiny_model_dir, tmp_path_factory) -> Path:
    """Two 4-bit training steps, a checkpoint after each."""
    out = tmp_path_factory.mktemp("qlora")
    assert train_ppo.main(qlora_args(tiny_model_dir, out, "--max-steps", "2", "--set",
                                     "checkpointing.save_every=1")) == 0
    return out / "t"


def test_the_base_loads_in_nf4_with_lora_on_its_linear4bit_layers(tiny_model_dir):
    policy = load_policy(nf4(tiny_model_dir), LoraConfig(), DEVICE)
    q_proj = policy.model.get_base_model().model.layers[0].self_attn.q_proj
    assert type(q_proj).__module__ == "peft.tuners.lora.bnb" and type(q_proj.base_layer).__name__ == "Linear4bit"
    assert q_proj.base_layer.weight.dtype == torch.uint8 and q_proj.base_layer.weight.quant_type == "nf4"
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or name.startswith("value_head.") for name in trainable)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_scores_without_gradients_equal_the_update_passes_and_every_adapter_layer_learns(tiny_model_dir,
                                                                                         checkpointing):
    """Old log-probs are scored without gradients; the update scores again with them: on a 4-bit base the
    two must agree exactly, or the first PPO ratio is not 1."""
    torch.manual_seed(0)
    policy = load_policy(nf4(tiny_model_dir, gradient_checkpointing=checkpointing), LoraConfig(), DEVICE)
    ids = prompt_ids().to(DEVICE)
    mask = torch.zeros_like(ids)
    mask[:, 12:] = 1
    with torch.no_grad():
        old = policy.score(ids, None, mask)
    policy.train()
    new = policy.score(ids, None, mask)
    assert torch.equal(old.logprobs, new.logprobs.detach()) and torch.equal(old.values, new.values.detach())
    (new.logprobs.sum() + new.values.sum()).backward()
    lora_b = [p for name, p in policy.model.named_parameters() if "lora_B" in name]
    assert all(p.grad is not None for p in policy.adapter_parameters())
    assert lora_b and all(p.grad.abs().sum() > 0 for p in lora_b)  # B starts at 0, so only B's gradient is non-zero


def test_the_dequantised_base_computes_what_the_4bit_base_computes_and_not_the_stored_weights(tiny_model_dir):
    ids = prompt_ids()  # the stored model runs on the CPU
    policy = load_policy(nf4(tiny_model_dir), LoraConfig(), DEVICE)
    dequantised = load_dequantised_base(nf4(tiny_model_dir), DEVICE)
    stored = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad(), policy.base():
        on_device = ids.to(DEVICE)
        nf4_logits = policy.model(input_ids=on_device).logits.cpu()
        assert (dequantised(input_ids=on_device).logits.cpu() - nf4_logits).abs().max() < 1e-5
        assert (stored(input_ids=ids).logits - nf4_logits).abs().max() > 0.1  # 4-bit rounding is not nothing
    assert {type(m).__name__ for m in dequantised.modules()}.isdisjoint({"Linear4bit", "Params4bit"})


def test_4bit_where_bitsandbytes_cannot_run_it_is_one_line_naming_the_field(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails, as without the package
    with pytest.raises(ConfigError) as raised:
        load_policy(nf4(tiny_model_dir), LoraConfig(), DEVICE)
    message = str(raised.value)
    assert "\n" not in message and "model.use_4bit" in message and "--set model.use_4bit=false" in message


@pytest.mark.slow
def test_the_trainer_stops_at_start_when_bitsandbytes_is_broken(tiny_model_dir, tmp_path):
    broken = tmp_path / "site" / "bitsandbytes"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('native library not found for this platform')\n")
    done = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"),
                           *qlora_args(tiny_model_dir, tmp_path / "runs", "--max-steps", "1")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "400", "PYTHONPATH": os.pathsep.join(
                              [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("Configuration error: model.use_4bit is true") and "native library not found" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_4bit_training_checkpoints_and_resumes_exactly(tiny_model_dir, qlora_run, tmp_path):
    records = metrics(qlora_run)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["env/episodes_failed"] == 0 and "policy/loss" in r and r["update/skipped"] == 0 for r in records)
    assert train_ppo.main(qlora_args(tiny_model_dir, tmp_path, "--max-steps", "1")) == 0
    assert train_ppo.main(qlora_args(tiny_model_dir, tmp_path, "--max-steps", "2", "--resume", "latest")) == 0
    assert [deterministic(r) for r in metrics(tmp_path / "t")] == [deterministic(r) for r in records]
    adapter = "checkpoints/checkpoint-2/adapter/adapter_model.safetensors"
    straight, resumed = load_file(str(qlora_run / adapter)), load_file(str(tmp_path / "t" / adapter))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def _trained_logits(model_dir: Path, checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    """The trained policy's logits: the 4-bit base with the checkpoint's adapter, as the trainer runs it."""
    policy = load_policy(nf4(model_dir), LoraConfig(), DEVICE)
    policy.load(checkpoint)
    with torch.no_grad():
        return policy.model(input_ids=ids.to(DEVICE)).logits.cpu()


@pytest.mark.slow
def test_a_4bit_adapter_merges_onto_the_dequantised_base(tiny_model_dir, qlora_run, tmp_path):
    checkpoint = qlora_run / "checkpoints" / "checkpoint-2"
    sets = nf4_sets(tiny_model_dir)
    output = tmp_path / "merged"
    assert merge.main(["--checkpoint", str(checkpoint), "--output", str(output),
                       *[arg for s in sets for arg in ("--set", s)]]) == 0
    assert "quantization_config" not in json.loads((output / "config.json").read_text())
    ids = prompt_ids()
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)(input_ids=ids).logits
    assert (merged - _trained_logits(tiny_model_dir, checkpoint, ids)).abs().max() < 1e-4


@pytest.mark.slow
def test_vllm_is_given_the_dequantised_base_that_with_the_adapter_is_the_trained_policy(tiny_model_dir, qlora_run,
                                                                                        tmp_path, capsys):
    from peft import PeftModel

    sets = [*nf4_sets(tiny_model_dir), f"model.cache_dir={tmp_path / 'cache'}"]
    args = [arg for s in sets for arg in ("--set", s)]
    assert prepare_model.main(args) == 0
    folder = Path(capsys.readouterr().out.split("base weights: ")[1].split("\n")[0])
    assert folder.parent == tmp_path / "cache" and "nf4-dequantised" in folder.name
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert prepare_model.main(args) == 0 and (folder / "model.safetensors").stat().st_mtime_ns == written  # once
    assert f"vllm serve {folder} --served-model-name {tiny_model_dir}" in capsys.readouterr().out

    checkpoint = qlora_run / "checkpoints" / "checkpoint-2"
    ids = prompt_ids()
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                       str(checkpoint / "adapter"))
    with torch.no_grad():
        assert (served(input_ids=ids).logits - _trained_logits(tiny_model_dir, checkpoint, ids)).abs().max() < 1e-4
