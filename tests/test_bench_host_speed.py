"""bench/host_speed.py at CI size: the stand-in's busy time, the barrier's absence, operations per decode step."""
import pytest

from bench import host_speed

# torch operations of one decode step of the 2-layer tiny model with the adapter folded (232 when measured; the
# adapter path takes 372, generate 385): a change that brings back per-layer LoRA launches or per-row work fails
FOLDED_DECODE_OPS_CEILING = 280


@pytest.fixture(scope="module")
def small_run():
    return host_speed.main(["--small", "--episodes", "8", "--cost-ms", "20", "--skip", "othello/random"])


def test_both_batchings_play_the_same_games_and_report_the_stand_ins_share(small_run):
    for name, setting in small_run["settings"].items():
        turns = setting["null_model"]["turns"]
        for batching in ("wave", "continuous"):
            played = setting[batching]
            assert played["errors"] == 0 and played["turns"] == turns, name  # scripted replies: the same games
            assert 0 < played["busy_fraction"] <= 1.0 and played["bound_ratio"] >= 1.0
            assert played["busy_s"] == pytest.approx(played["forward_calls"] * 0.02)
    assert all(ms > 0 for ms in small_run["host_ms_per_turn"].values())


def test_the_folded_adapter_cuts_the_operations_of_a_decode_step(small_run):
    ops = small_run["ops_per_decode_step"]
    assert ops["decode_loop_folded"] <= FOLDED_DECODE_OPS_CEILING
    assert ops["decode_loop_folded"] < 0.75 * ops["decode_loop_adapter_path"]
    assert ops["decode_loop_folded"] < ops["generate_adapter_path"]
