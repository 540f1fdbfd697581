"""memory_plan.py: each term's arithmetic on hand-counted tiny models, and the search for settings that fit."""
import pytest
import torch
from transformers import AutoConfig

import prepare_model
from ppo_affine.memory_plan import (ADAPTER_BYTES, NF4_BYTES, RunShape, fitting_settings, kv_bytes_per_token, meta_model,
                                    plan, trainable_parameters, weight_terms)

QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=1000, tie_word_embeddings=False)


def shape(**changes) -> RunShape:
    fields = dict(dtype_bytes=2, use_4bit=False, gradient_checkpointing=True, micro_batch_tokens=1024, lora_r=8,
                  lora_targets=None, adapt_experts=False, backend="vllm", episodes=4, context_tokens=512)
    return RunShape(**{**fields, **changes})


def test_weights_are_counted_by_what_4bit_quantises():
    model = meta_model(AutoConfig.for_model("qwen3", **QWEN3))
    # per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128, down 128x64 = 36 864 linear weights
    linear = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)
    other = 2 * 1000 * 64 + 2 * (64 + 64 + 16 + 16) + 64  # embeddings, lm_head; 4 norms a layer and the last
    assert [t.bytes for t in weight_terms(model, shape())] == [(linear + other) * 2]
    nf4, rest = weight_terms(model, shape(use_4bit=True))
    assert nf4.bytes == pytest.approx(linear * NF4_BYTES) and rest.bytes == other * 4  # k-bit prep: float32


def test_lora_counts_r_times_in_plus_out_per_adapted_layer_and_per_expert():
    model = meta_model(AutoConfig.for_model("qwen3", **QWEN3))
    per_layer = 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))
    assert trainable_parameters(model, shape()) == 2 * per_layer
    moe = meta_model(AutoConfig.for_model("qwen3_moe", **{**QWEN3, "moe_intermediate_size": 32, "num_experts": 4,
                                                          "num_experts_per_tok": 2}))
    attention = 2 * 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64))
    experts = 2 * 4 * 8 * ((64 + 2 * 32) + (32 + 64))  # gate_up [4, 64, 64] and down [4, 64, 32] per layer
    assert trainable_parameters(moe, shape()) == attention
    assert trainable_parameters(moe, shape(adapt_experts=True)) == attention + experts


def test_kv_bytes_count_full_attention_layers_and_linear_states():
    dense = AutoConfig.for_model("qwen3", **QWEN3)
    assert kv_bytes_per_token(dense, 2) == (2 * 2 * 2 * 16 * 2, 0.0)
    hybrid = AutoConfig.for_model("qwen3_5_moe_text", **{**QWEN3, "layer_types": ["linear_attention", "full_attention"],
                                                         "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                                                         "linear_num_value_heads": 4, "linear_value_head_dim": 8,
                                                         "linear_conv_kernel_dim": 4})
    per_token, state = kv_bytes_per_token(hybrid, 2)
    assert per_token == 2 * 1 * 2 * 16 * 2  # one full-attention layer
    assert state == (2 * 2 * 8 + 4 * 8) * 4 * 2 + 4 * 8 * 8 * 4  # conv window in 16 bits, recurrent state in float32


def test_a_plan_adds_every_term_and_gives_vllm_its_share():
    config = AutoConfig.for_model("qwen3", **QWEN3)
    per_kind = {"full_attention": 1000.0}
    planned = plan(config, shape(), 1e10, per_kind)
    names = [t.name for t in planned.trainer + planned.vllm]
    assert names == ["weights", "adapter + AdamW", "activations", "logits", "CUDA reserve", "vLLM weights",
                     "vLLM KV cache", "vLLM LoRA slots", "vLLM reserve"]
    adapter = next(t for t in planned.trainer if t.name == "adapter + AdamW")
    assert adapter.bytes == trainable_parameters(meta_model(config), shape()) * ADAPTER_BYTES
    activations = next(t for t in planned.trainer if t.name == "activations")
    assert activations.bytes == 1024 * (2 * 64 * 2 + 2 * 1000)  # each layer's input, one layer saved, its backward
    assert planned.vllm_share == pytest.approx(-(-planned.vllm_bytes * 100 // 1e10) / 100)
    local = plan(config, shape(backend="local"), 1e10, per_kind)
    assert not local.vllm and local.trainer[-1].name == "local generation caches"


def test_the_least_reluctant_change_that_fits_is_chosen(monkeypatch):
    import ppo_affine.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "probe_activations", lambda config, shape: {"full_attention": 1000.0})
    config = AutoConfig.for_model("qwen3", **QWEN3)
    roomy, changes = fitting_settings(config, shape(), 1e10)
    assert roomy.fits and changes == []
    needed = plan(config, shape(episodes=8, context_tokens=10**6), 1e9, {"full_attention": 1000.0})
    gpu = (needed.trainer_bytes + needed.vllm_bytes) / 0.95 + 1
    chosen, changes = fitting_settings(config, shape(episodes=16, context_tokens=10**6), gpu)
    assert chosen.fits and changes == ["generation.max_concurrent_episodes=8"]
    nothing, changes = fitting_settings(config, shape(), 1e6)
    assert not nothing.fits and changes == []


@pytest.mark.slow
def test_prepare_model_prints_the_plan_of_a_tiny_architecture(tmp_path, capsys):
    from ppo_affine.testing.tiny import make_tiny_architecture_dir

    folder = make_tiny_architecture_dir(tmp_path / "m", "qwen3_5_moe")
    args = ["--set", f"model.name_or_path={folder}", "--set", "model.gguf_package=null", "--plan", "--gpu-memory", "10"]
    assert prepare_model.main(args) == 0
    out = capsys.readouterr().out
    assert "memory plan for" in out and "fits" in out and "--gpu-memory-utilization" in out
    assert torch.isfinite(torch.tensor([float(line.split()[-1]) for line in out.splitlines()
                                        if "--gpu-memory-utilization" in line and line.strip().startswith("vLLM")]))
