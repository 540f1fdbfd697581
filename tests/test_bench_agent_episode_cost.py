"""bench/agent_episode_cost.py's own arithmetic: the run it starts and the table it prints (the run itself is
measured in docs/benchmarks.md; its metrics are checked by tests/test_phase_costs.py and tests/test_harnesses.py)."""
import argparse
import json
from pathlib import Path

from bench import agent_episode_cost


def test_the_run_is_the_cpu_preset_through_mini_swe_agent_with_the_endpoints_turn_limit_above_the_step_limit():
    args = argparse.Namespace(out=Path("/tmp/x"), preset="cpu", episodes=2, turns=6, steps=2, max_new_tokens=128,
                              max_prompt_tokens=4096, set=["ppo.ppo_epochs=2"])
    command = agent_episode_cost.trainer_command(args, "http://127.0.0.1:9")
    sets = dict(command[i + 1].split("=", 1) for i, word in enumerate(command) if word == "--set")
    assert command[command.index("--preset") + 1] == "cpu" and command[command.index("--max-steps") + 1] == "2"
    env = json.loads(sets["env.envs"])["swe"]
    assert (env["mode"], env["url"], env["evaluate_kwargs"]) == ("url", "http://127.0.0.1:9",
                                                                 {"agent": "miniswe", "max_iterations": 6})
    assert (sets["ppo.batch_size"], sets["generation.max_concurrent_episodes"], sets["generation.max_turns"]) == \
        ("2", "2", "8")
    assert (sets["generation.max_new_tokens"], sets["generation.max_prompt_tokens"], sets["ppo.ppo_epochs"]) == \
        ("128", "4096", "2")


def test_the_table_has_a_column_a_step_and_the_rates_of_prefill_and_decode():
    record = {"step": 1, "perf/rollout_seconds": 10.0, "perf/env_seconds": 1.5, "perf/prefill_seconds": 2.0,
              "perf/prefill_tokens": 1000.0, "perf/decode_seconds": 5.0, "perf/decode_tokens": 50.0,
              "perf/update_peak_rss_bytes": 2.5e9}
    lines = agent_episode_cost.table([record], {"trainer": 3e9, "harness": 0.5e9})
    assert lines[:2] == ["| phase | step 1 |", "| --- | --- |"]
    assert "| rollout | 10.00 s |" in lines and "| rollout: env (harness + commands) | 1.50 s |" in lines
    assert "| prefill tokens | 1000 |" in lines and "| update peak RSS | 2.50 GB |" in lines
    assert "| update: scoring | - |" in lines  # not in the record
    assert "| prefill / decode tokens a second | 500 / 10.0 |" in lines  # 1 000 / 2 s, 50 / 5 s
    assert lines[-1] == "sampled peaks: trainer 3.00 GB, harness side 0.50 GB"
