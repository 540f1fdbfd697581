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
    assert activations.bytes == 1024 * (2 * 64 * 2 + 1.25 * 1000)  # each layer's input, one layer recomputed
    assert planned.vllm_share == pytest.approx(-(-planned.vllm_bytes * 100 // 1e10) / 100)
    local = plan(config, shape(backend="local"), 1e10, per_kind)
    assert not local.vllm and local.trainer[-1].name == "local generation caches"


def test_the_longest_sequence_sizes_the_pass_and_the_lm_head_holds_one_chunk():
    config = AutoConfig.for_model("qwen3", **QWEN3)
    per_kind = {"full_attention": 1000.0}

    def terms(**changes):
        return {t.name: t.bytes for t in plan(config, shape(**changes), 1e10, per_kind).trainer}

    # 8 192 + 1 024 tokens get a pass of their own, whatever the 1 024-token micro-batch budget
    checkpointed = terms(context_tokens=9216)
    assert checkpointed["activations"] == 9216 * (2 * 64 * 2 + 1.25 * 1000)
    # the head runs per chunk of 2^25 / 1000 = 33 554 rows (all 9 216 here): 3 bf16 copies and a float32 one a
    # logit, plus the gathered hidden states and their gradient (64 x 2 bytes x 2); with checkpointing, only what
    # exceeds the recomputed layer's 9 216 x 1 250 bytes, which is never alive beside it
    head = 9216 * 1000 * (3 * 2 + 4) + 9216 * 64 * 2 * 2
    assert checkpointed["logits"] == head - 9216 * 1250
    plain = terms(context_tokens=9216, gradient_checkpointing=False)
    assert plain["activations"] == 9216 * (2 * 1000 + 1000) and plain["logits"] == head
    # a sequence limit below the context (ppo.max_sequence_tokens) bounds the pass instead
    assert terms(context_tokens=9216, longest_sequence=2048)["activations"] == 2048 * (2 * 64 * 2 + 1.25 * 1000)


def test_the_longest_sequence_that_fits_is_the_last_that_does():
    from ppo_affine.memory_plan import longest_that_fits

    config = AutoConfig.for_model("qwen3", **QWEN3)
    per_kind = {"full_attention": 1000.0}
    gpu = 6e9  # 5.7 GB usable, 5 GB of it the CUDA and vLLM reserves
    longest = longest_that_fits(config, shape(), gpu, per_kind)
    assert 1024 < longest < 1 << 22
    assert plan(config, shape(longest_sequence=longest), gpu, per_kind).fits
    assert not plan(config, shape(longest_sequence=longest + 1), gpu, per_kind).fits


@pytest.mark.slow
def test_the_plan_of_a_16k_token_sequence_is_torchs_peak_within_15_percent_on_the_cpu():
    """The tiny qwen3_5_moe (Gated DeltaNet, full attention, experts) with LoRA, float32, checkpointing as the trainer
    turns it on: one pass over a 16 384-token reply, backward and an AdamW step, against the plan's trainer terms
    (no CUDA reserve, no caches: nothing is generated)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ppo_affine.architectures import default_lora_targets
    from ppo_affine.policy import Policy, resolve_lora_targets
    from ppo_affine.testing.live_bytes import LiveBytes
    from ppo_affine.testing.tiny import tiny_architecture_config

    tokens = 16384
    config = tiny_architecture_config("qwen3_5_moe_text", 1024, pad_token_id=0, eos_token_id=1)
    run = shape(dtype_bytes=4, lora_r=16, backend="local", episodes=0, context_tokens=tokens)
    predicted = sum(t.bytes for t in plan(config, run, 1e12).trainer if t.name != "CUDA reserve")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    targets = resolve_lora_targets(base, default_lora_targets(config), explicit=False)
    policy = Policy(get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets)),
                    tokenizer=None).train()
    optimizer = torch.optim.AdamW(policy.adapter_parameters(), lr=1e-4)
    frozen = sum(p.numel() * p.element_size() for p in policy.parameters() if not p.requires_grad)
    ids = torch.randint(0, 1024, (1, tokens), generator=torch.Generator().manual_seed(0))
    live = LiveBytes()
    with live.mode:
        policy.score(ids, None, torch.ones_like(ids), with_values=False).logprobs.sum().backward()
        optimizer.step()
    peak = frozen + live.peak  # the trainable weights, gradients and moments are in live.peak
    assert predicted == pytest.approx(peak, rel=0.15), (predicted / 1e6, peak / 1e6)


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
