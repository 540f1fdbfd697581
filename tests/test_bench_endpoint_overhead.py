"""bench/endpoint_overhead.py at CI size: both paths play the same games with the same replies, and it says so."""
from bench import endpoint_overhead


def test_both_paths_play_the_same_calls_and_the_overhead_is_their_difference():
    report = endpoint_overhead.main(["--small", "--games", "4", "--concurrency", "2"])
    assert set(report["settings"]) == {"concurrency_1", "concurrency_2"}
    for setting in report["settings"].values():
        native, endpoint = setting["native"], setting["endpoint"]
        assert setting["same_replies"] and native["calls"] == endpoint["calls"] > 4
        assert native["failed"] == endpoint["failed"] == 0
        expected = 1e3 * (endpoint["wall_s"] - native["wall_s"]) / native["calls"]
        assert abs(setting["overhead_ms_per_call"] - expected) < 1e-3 + 1e-3 * abs(expected)
