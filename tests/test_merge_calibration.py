"""The bf16 merge calibrated on a run's recorded episodes: the split, the per-layer input second moments (experts over
the tokens routed to them only), error feedback inside the streaming merge, and the one-line errors."""
import json
from pathlib import Path

import pytest
import torch

import merge
from ppo_affine.calibration import RecordedEpisode, read_episodes, split_episodes
from ppo_affine.config import ConfigError, LoraConfig, ModelConfig


def write_samples(run: Path, episodes: int, vocab: int, seed: int = 0) -> Path:
    """A run folder's samples.jsonl with `episodes` recorded episodes of two model calls of random ids each."""
    generator = torch.Generator().manual_seed(seed)
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "samples.jsonl", "w") as handle:
        for step in range(1, episodes + 1):
            calls = [{"prompt_ids": torch.randint(3, vocab, (12,), generator=generator).tolist(),
                      "token_ids": torch.randint(3, vocab, (4,), generator=generator).tolist()} for _ in range(2)]
            handle.write(json.dumps({"step": step, "episode": 0, "calls": calls}) + "\n")
    return run


def episode(step: int, index: int = 0) -> RecordedEpisode:
    return RecordedEpisode((step, index), ((1, 2, 3),), (2,))


# ---------------------------------------------------------------------------------------------- the episodes
def test_every_other_episode_is_held_out_by_its_key_and_the_two_parts_never_overlap():
    recorded = [episode(5), episode(1), episode(2), episode(3), episode(4), episode(3)]  # step 3 recorded twice
    calibration, held_out = split_episodes(sorted(recorded, key=lambda e: e.key))
    # keys in order (1, 2, 3, 4, 5): the 2nd and 4th are held out; both records of step 3 calibrate
    assert [e.key[0] for e in calibration] == [1, 3, 3, 5]
    assert [e.key[0] for e in held_out] == [2, 4]
    assert not {e.key for e in calibration} & {e.key for e in held_out}
    assert split_episodes(sorted(recorded, key=lambda e: e.key)) == (calibration, held_out)  # deterministic


def test_one_episode_cannot_both_calibrate_and_judge():
    with pytest.raises(ConfigError, match="1 recorded episode"):
        split_episodes([episode(1)])


def test_the_recorded_calls_are_read_as_prompt_plus_sampled_ids(tmp_path):
    (tmp_path / "samples.jsonl").write_text(
        json.dumps({"step": 2, "episode": 1, "calls": [{"prompt_ids": [5, 6], "token_ids": [7]},
                                                       {"prompt_ids": [5, 6, 7, 8], "token_ids": [9, 10]}]}) + "\n"
        + json.dumps({"step": 1, "calls": [{"prompt_ids": [4], "token_ids": [3]}]}) + "\n")
    assert read_episodes(tmp_path) == [RecordedEpisode((1, 0), ((4, 3),), (1,)),
                                       RecordedEpisode((2, 1), ((5, 6, 7), (5, 6, 7, 8, 9, 10)), (2, 4))]


def test_a_missing_or_bad_episodes_file_is_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match=r"samples.jsonl does not exist: calibration reads a run's recorded"):
        read_episodes(tmp_path)
    (tmp_path / "samples.jsonl").write_text(json.dumps({"step": 1, "messages": []}) + "\n")
    with pytest.raises(ConfigError, match=r"samples.jsonl line 1 is not a recorded episode with model calls"):
        read_episodes(tmp_path)
    (tmp_path / "samples.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"line 1 is not a recorded episode.*JSONDecodeError"):
        read_episodes(tmp_path)


def test_merge_with_a_missing_episodes_file_stops_in_one_line_before_loading(tiny_model_dir, tmp_path, capsys):
    from ppo_affine.testing.tiny import save_checkpoint_with_active_adapter

    checkpoint = save_checkpoint_with_active_adapter(tiny_model_dir, tmp_path / "ckpt")
    sets = [f"model.name_or_path={tiny_model_dir}", "model.use_4bit=false", "run.device=cpu"]
    capsys.readouterr()  # the adapter's making
    args = ["--adapter", str(checkpoint / "adapter"), "--output", str(tmp_path / "m"), "--dtype", "bfloat16",
            "--rounding", "error-feedback", "--episodes", str(tmp_path / "no-run")]
    assert merge.main(args + [a for s in sets for a in ("--set", s)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "no-run does not exist: calibration reads a run's recorded episodes" in err
    assert "Traceback" not in err and "Loading weights" not in err  # before any model loads
    assert not (tmp_path / "m").exists()


def test_moments_that_would_not_fit_in_half_the_free_memory_are_refused_before_the_model_loads(monkeypatch):
    from types import SimpleNamespace

    from ppo_affine import calibration

    layers = {"q": SimpleNamespace(in_features=32), "down": SimpleNamespace(in_features=64)}
    assert calibration.moment_bytes(layers) == 32 * 32 * 4 + 64 * 64 * 4  # 20 480 bytes of float32 sums
    monkeypatch.setattr(calibration, "free_memory_bytes", lambda device: 81920)  # half: 40 960 = two sets, fits
    calibration.check_moment_memory(layers)
    monkeypatch.setattr(calibration, "free_memory_bytes", lambda device: 81918)
    with pytest.raises(ConfigError, match=r"would hold 0.0 GB .* 2 adapted weights.*pass --rounding nearest"):
        calibration.check_moment_memory(layers)


# ---------------------------------------------------------------------------------------------- storing
def test_stored_error_feedback_is_on_the_bf16_grid_and_nearest_for_uncorrelated_inputs_whatever_the_layout():
    from ppo_affine.rounding import store

    generator = torch.Generator().manual_seed(0)
    merged = torch.randn(2, 8, 16, generator=generator)  # a fused [experts, out, in] weight
    directions = torch.randn(3, 16, generator=generator)
    correlated = directions.T @ directions + 1e-3 * torch.eye(16)
    moments = torch.stack([correlated, torch.zeros(16, 16)])  # expert 1: no calibration token reached it
    stored = store("error-feedback", merged, torch.bfloat16, moments)
    assert stored.dtype == torch.bfloat16
    assert torch.equal(stored[1], merged[1].bfloat16())  # a zero moment: rounded to nearest
    assert not torch.equal(stored[0], merged[0].bfloat16())  # correlated inputs: errors moved
    def output_error(rounded: torch.Tensor) -> float:  # E|x·(stored − merged)ᵀ|² on inputs of that moment
        error = rounded.float() - merged[0]
        return float(((error @ correlated) * error).sum())

    assert output_error(stored[0]) < 0.5 * output_error(merged[0].bfloat16())
    diagonal = torch.diag(torch.rand(16, generator=generator) + 0.5)
    assert torch.equal(store("error-feedback", merged[0], torch.bfloat16, diagonal), merged[0].bfloat16())
    # stored [in, out] (not as_linear): the same rounding on the transpose
    assert torch.equal(store("error-feedback", merged[0].T.contiguous(), torch.bfloat16, correlated, as_linear=False),
                       stored[0].T)
    assert torch.equal(store("error-feedback", merged[0], torch.float32, correlated), merged[0])  # nothing to round


def test_act_order_is_nearest_for_uncorrelated_inputs_and_keeps_more_where_a_few_inputs_carry_the_energy():
    """Columns by input energy, largest first: the columns that matter most are rounded while every other column can
    still absorb their error. Inputs on 32 directions with a few channels far larger (as a layer's outlier
    channels): the release's order keeps 0.73 of the update on held-out inputs, act-order 0.98 (seeded)."""
    from ppo_affine.rounding import output_kept_share, round_error_feedback

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(64, 256, generator=generator).bfloat16().float()
    update = 1e-3 * torch.randn(64, 256, generator=generator) * base.abs().mean()
    merged = base + update
    scales = torch.rand(256, generator=generator) ** 4 * 10
    directions = torch.randn(32, 256, generator=generator)
    inputs = (torch.randn(8192, 32, generator=generator) @ directions
              + 0.05 * torch.randn(8192, 256, generator=generator)) * scales
    calibration, held_out = inputs[:4096].T @ inputs[:4096] / 4096, inputs[4096:].T @ inputs[4096:] / 4096
    diagonal = torch.diag(calibration.diagonal())
    assert torch.equal(round_error_feedback(merged, diagonal, act_order=True), merged.bfloat16())

    def kept(act_order: bool) -> float:
        stored = round_error_feedback(merged, calibration, damping=0.01, act_order=act_order).float()
        return output_kept_share(update, stored - merged, held_out)

    nearest = output_kept_share(update, merged.bfloat16().float() - merged, held_out)
    assert nearest < 0.3 and kept(False) == pytest.approx(0.726, abs=0.01) and kept(True) > 0.97


# ---------------------------------------------------------------------------------------------- the moments
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe_text"])
def test_each_expert_s_moments_are_over_the_tokens_routed_to_it_only(tmp_path, name):
    """On a tiny MoE with adapted experts: expert e's gate_up moment is the mean x xᵀ of the hidden states the router
    sent to e (recorded at the router), its down_proj moment that of act(gate)·up with the adapted gate_up (base +
    peft's delta); the attention projections' moment is over every token."""
    from ppo_affine.calibration import collect_moments
    from ppo_affine.policy import load_policy
    from ppo_affine.release_files import Update, adapted_layers
    from ppo_affine.testing.tiny import activate_adapter, make_tiny_architecture_dir

    folder = make_tiny_architecture_dir(tmp_path / name, name)
    torch.manual_seed(0)
    policy = load_policy(ModelConfig(name_or_path=str(folder), use_4bit=False, dtype="float32",
                                     gradient_checkpointing=False),
                         LoraConfig(adapt_experts=True, dropout=0.0), torch.device("cpu"))
    activate_adapter(policy.model, 0.1)
    model = policy.model.eval()
    layers = adapted_layers(model)
    sequences = [torch.randint(3, 100, (10,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]

    routed: list[tuple[torch.Tensor, torch.Tensor]] = []  # layer 0's router: (its input, the experts chosen)
    router = model.get_base_model().model.layers[0].mlp.gate
    handle = router.register_forward_hook(lambda module, args, out: routed.append((args[0].float(), out[2])))
    moments = collect_moments(model, layers, sequences)
    handle.remove()

    hidden = torch.cat([h for h, _ in routed])
    chosen = torch.cat([c for _, c in routed])
    assert len(hidden) == 30 and chosen.shape == (30, 2)  # 3 sequences of 10 tokens, top-2 of 4 experts
    stem = "model.layers.0.mlp.experts"
    gate_up = model.get_base_model().model.layers[0].mlp.experts
    gate_up = gate_up.get_base_layer() if hasattr(gate_up, "get_base_layer") else gate_up
    adapted_gate_up = gate_up.gate_up_proj.detach().float() + Update(layers[f"{stem}.gate_up_proj"]).delta()
    for expert in range(4):
        mine = (chosen == expert).any(dim=-1)
        assert 0 < int(mine.sum()) < 30  # some tokens, not all: the test tells routed from every token
        x = hidden[mine]
        assert torch.allclose(moments[f"{stem}.gate_up_proj"][expert], x.T @ x / len(x), atol=1e-5)
        gate, up = (x @ adapted_gate_up[expert].T).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        assert torch.allclose(moments[f"{stem}.down_proj"][expert], h.T @ h / len(h), atol=1e-5)
        assert not torch.allclose(moments[f"{stem}.gate_up_proj"][expert], hidden.T @ hidden / 30, atol=1e-3)
    assert moments[f"{stem}.gate_up_proj"].shape == (4, 32, 32) and moments[f"{stem}.down_proj"].shape == (4, 16, 16)


@pytest.mark.slow
def test_q_k_and_v_share_one_moment_over_every_token_of_the_layer_input(tiny_model_dir):
    from ppo_affine.calibration import collect_moments
    from ppo_affine.release_files import adapted_layers
    from ppo_affine.testing.tiny import activate_adapter, load_tiny_policy

    policy = load_tiny_policy(tiny_model_dir)
    activate_adapter(policy.model, 0.1)
    model = policy.model.eval()
    layers = adapted_layers(model)
    inputs: list[torch.Tensor] = []
    attention = model.get_base_model().model.layers[1].self_attn
    handle = attention.q_proj.register_forward_pre_hook(lambda module, args: inputs.append(args[0][0].float()))
    moments = collect_moments(model, layers, [[5, 6, 7, 8], [9, 10, 11]])
    handle.remove()
    x = torch.cat(inputs)  # 7 tokens
    expected = x.T @ x / 7
    stem = "model.layers.1.self_attn"
    assert torch.allclose(moments[f"{stem}.q_proj.weight"], expected, atol=1e-5)
    assert moments[f"{stem}.k_proj.weight"] is moments[f"{stem}.q_proj.weight"]  # counted once, shared
    assert moments[f"{stem}.v_proj.weight"] is moments[f"{stem}.q_proj.weight"]


# ---------------------------------------------------------------------------------------------- in the merge
@pytest.mark.slow
def test_error_feedback_inside_the_streaming_merge_rounds_each_tensor_with_its_calibration_moment(tmp_path, capsys):
    """merge.py --rounding error-feedback on a tiny bf16 qwen3 release: each written tensor is round_error_feedback
    of W + update with the moment of the calibration episodes (through the adapter on its bf16 base), and the
    per-layer kept share is printed as judged on the held-out episodes' inputs."""
    from safetensors import safe_open

    from ppo_affine.calibration import calibrate
    from ppo_affine.config import load_config
    from ppo_affine.release_files import Update, adapted_layers, adapter_on_skeleton
    from ppo_affine.rounding import ACT_ORDER, DAMPING, round_error_feedback
    from ppo_affine.testing.tiny import activate_adapter, make_tiny_architecture_dir
    from ppo_affine.policy import load_policy

    base = make_tiny_architecture_dir(tmp_path / "qwen3", "qwen3")
    torch.manual_seed(0)
    model_cfg = ModelConfig(name_or_path=str(base), use_4bit=False, dtype="float32", gradient_checkpointing=False)
    policy = load_policy(model_cfg, LoraConfig(), torch.device("cpu"))
    activate_adapter(policy.model, 0.01)
    policy.save(tmp_path / "ckpt")
    run = write_samples(tmp_path / "run", episodes=6, vocab=100)
    sets = [f"model.name_or_path={base}", "model.use_4bit=false", "model.dtype=float32", "run.device=cpu"]
    output = tmp_path / "merged"
    args = ["--adapter", str(tmp_path / "ckpt" / "adapter"), "--output", str(output), "--episodes", str(run)]
    assert merge.main(args + [a for s in sets for a in ("--set", s)]) == 0
    out = capsys.readouterr().out
    assert "calibration: 96 tokens of 3 recorded episodes; judged on 96 tokens of 3 others" in out  # 2 calls × 16
    assert "(error-feedback), the layers keep a median" in out and "on the held-out episodes' inputs" in out

    config = load_config(overrides=sets)
    found = calibrate(config.train.model, tmp_path / "ckpt" / "adapter", run, torch.device("cpu"))
    layers = adapted_layers(adapter_on_skeleton(str(base), tmp_path / "ckpt" / "adapter", "t"))
    name = "model.layers.2.mlp.down_proj.weight"
    with safe_open(str(base / "model.safetensors"), "pt") as handle:
        weight = handle.get_tensor(name)
    with safe_open(str(output / "model.safetensors"), "pt") as handle:
        written = handle.get_tensor(name)
    expected = round_error_feedback(weight.float() + Update(layers[name]).delta(), found.moments[name],
                                    torch.bfloat16, DAMPING, act_order=ACT_ORDER)
    assert written.dtype == torch.bfloat16 and torch.equal(written, expected)
    assert not torch.equal(written, (weight.float() + Update(layers[name]).delta()).bfloat16())
