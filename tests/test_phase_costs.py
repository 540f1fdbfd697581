"""A step's phases as the run's log reports them (ppo_affine/phase_costs.py): the rollout's envs' time and local
generation's prefill and decode, the tokens each ran, each phase's peak resident memory and the memory plan's figure
beside it. Memory and token counts are checked; seconds only against each other, never against a clock."""
from __future__ import annotations

import json

import pytest
import torch

import train_ppo
from ppo_affine.phase_costs import (GenerationTime, PlannedPhases, peak_resident_bytes, phase_peak,
                                    planned_against_measured, reset_peak, resident_bytes)
from test_train import metrics, tiny_args

MB = 1e6


def test_a_phase_peak_is_the_rise_of_what_it_held_above_its_start():
    if not reset_peak():
        pytest.skip("this kernel cannot reset the resident high-water mark (/proc/self/clear_refs)")
    recorded = {}
    with phase_peak(recorded, "update"):
        held = torch.ones(50_000_000)  # 200 MB written: resident
        del held
    # that tensor and little else (what the process freed meanwhile may have made a little room)
    assert 190 * MB <= recorded["perf/update_rss_rise_bytes"] < 260 * MB
    assert recorded["perf/update_peak_rss_bytes"] >= recorded["perf/update_rss_rise_bytes"] + resident_bytes() - 60 * MB
    # the mark starts again at the next phase: a phase that holds nothing more rises by a few MB at most
    quiet = {}
    with phase_peak(quiet, "rollout"):
        pass
    assert quiet["perf/rollout_rss_rise_bytes"] < 10 * MB
    assert peak_resident_bytes() < recorded["perf/update_peak_rss_bytes"]


def test_overlapping_phases_record_no_peak():
    recorded = {}
    with phase_peak(recorded, "rollout", enabled=False):
        pass
    assert recorded == {}


def test_planned_against_measured_is_the_plans_share_of_the_rise():
    recorded = {"perf/update_rss_rise_bytes": 400 * MB}
    planned_against_measured(recorded, "update", 460 * MB)
    assert recorded["perf/update_planned_bytes"] == 460 * MB
    assert recorded["perf/update_planned_over_measured"] == pytest.approx(1.15)
    unmeasured = {}
    planned_against_measured(unmeasured, "rollout", 1 * MB)
    assert unmeasured == {"perf/rollout_planned_bytes": 1 * MB}


def test_the_planned_update_is_the_steps_largest_pass_and_leaves_the_random_state_alone(tiny_model_dir):
    from transformers import AutoConfig

    from ppo_affine.config import load_config
    from ppo_affine.memory_plan import activation_bytes, head_bytes

    train = load_config(overrides=[f"train.model.name_or_path={tiny_model_dir}", "train.ppo.micro_batch_tokens=1024",
                                   "train.model.gradient_checkpointing=false"]).train
    config = AutoConfig.from_pretrained(tiny_model_dir)
    planned = PlannedPhases(config, train)
    torch.manual_seed(7)
    expected_draw = torch.rand(1).item()
    torch.manual_seed(7)
    one = planned.update_bytes([300], 1024)  # the first call measures a layer, which seeds torch
    assert torch.rand(1).item() == expected_draw  # the run's draws go on as if it had not

    def plan_at(tokens: int) -> float:  # the plan's activations and LM head for a pass of `tokens` tokens
        import dataclasses

        shape = dataclasses.replace(planned.shape, micro_batch_tokens=tokens, context_tokens=tokens,
                                    longest_sequence=tokens)
        return activation_bytes(config, shape, planned._per_kind) + head_bytes(shape, planned._per_kind, 1024, 32)

    assert one == plan_at(300)  # one 300-token sequence: a pass of 300 tokens, not of the 1 024 a micro-batch holds
    assert planned.update_bytes([300, 300, 300, 300], 1024) == plan_at(1024)  # 1 200 tokens fill a micro-batch
    assert planned.update_bytes([300, 2000], 1024) == plan_at(2000)  # the longest, alone in its pass


def test_generation_time_names_its_metrics():
    spent = GenerationTime(prefill_seconds=1.5, decode_seconds=4.0, step_seconds=6.0, decode_tokens=90, prefill_rows=10)
    assert spent.metrics() == {"perf/generation_seconds": 6.0, "perf/prefill_seconds": 1.5, "perf/decode_seconds": 4.0,
                               "perf/decode_tokens": 90.0, "perf/prefill_rows": 10.0}


@pytest.mark.slow
def test_two_steps_of_a_tiny_model_log_each_phases_time_tokens_and_memory(tiny_model_dir, tmp_path):
    """2 steps of 4 leduc/liar's dice episodes with 3-token replies: every phase's numbers are in the log and add up."""
    assert train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2")) == 0
    records = metrics(tmp_path / "t")
    assert [r["step"] for r in records] == [1, 2]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    # keys and values of a token: 2 (K and V) x 2 layers x 2 KV heads x 8 (32 / 4 heads) x 4 bytes (float32)
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["hidden_size"],
            config["num_attention_heads"]) == (2, 2, 32, 4)
    for r in records:
        # the rollout's time: generation steps (their prefill and decode within) and the envs' time around them
        assert 0 < r["perf/prefill_seconds"] and 0 < r["perf/decode_seconds"]
        assert r["perf/prefill_seconds"] + r["perf/decode_seconds"] <= r["perf/generation_seconds"]
        assert r["perf/generation_seconds"] <= r["perf/rollout_seconds"]
        assert r["perf/env_seconds"] == pytest.approx(r["perf/rollout_seconds"] - r["perf/generation_seconds"])
        # the tokens: each turn's request joins by a prefill, which samples its first reply token; decode steps the
        # rest; together every token the episodes hold as replies
        turns = r["env/turns_mean"] * (r["env/episodes"] - r["env/episodes_failed"])
        assert r["perf/prefill_rows"] == turns
        assert r["perf/decode_tokens"] + r["perf/prefill_rows"] == r["perf/generated_tokens"]
        assert r["perf/generated_tokens"] == pytest.approx(r["perf/tokens_per_s"] * r["perf/rollout_seconds"])
        assert r["perf/prefill_tokens"] > 0
        # the update's time holds its scoring pass
        assert 0 < r["perf/score_seconds"] < r["perf/update_seconds"]
        # memory: each phase's peak, its rise above its start, and the plan's figure for it
        for phase in ("rollout", "update"):
            assert r[f"perf/{phase}_peak_rss_bytes"] >= r[f"perf/{phase}_rss_rise_bytes"] >= 0
        # the rollout's plan: those keys and values at the most tokens the caches held, and the folded adapter's copy
        # of each weight it adapts (q 32x32, k and v 32x16, o 32x32, gate and up 32x64, down 64x32: 9 216 weights a
        # layer, 2 layers, 4 bytes)
        assert r["perf/rollout_planned_bytes"] == r["perf/kv_peak_tokens"] * 256 + 9216 * 2 * 4
        assert r["perf/update_planned_bytes"] > 0
        if r["perf/update_rss_rise_bytes"]:
            assert r["perf/update_planned_over_measured"] == pytest.approx(
                r["perf/update_planned_bytes"] / r["perf/update_rss_rise_bytes"])
