"""run_log.py: a clean console; only the library warnings we know to be noise are silenced, and narrowly."""
import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ppo_affine.run_log import episode_summary, report_failure, silence_known_library_warnings

ROOT = Path(__file__).resolve().parent.parent


def test_known_library_noise_is_dropped_and_nothing_else(caplog):
    import ppo_affine  # noqa: F401  (the package drops bitsandbytes' notice as it is imported)

    ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        ops.warning("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'")
        ops.warning("some other bitsandbytes problem")
    assert [r.getMessage() for r in caplog.records] == ["some other bitsandbytes problem"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        silence_known_library_warnings()
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]


def test_a_failure_is_one_line_with_its_brackets_as_text_and_gives_the_exit_code(capsys):
    assert report_failure("Configuration error", ValueError("unknown games ['liars'] in [bold]x[/bold]"), 2) == 2
    assert capsys.readouterr().err == "Configuration error: unknown games ['liars'] in [bold]x[/bold]\n"
    assert report_failure("Stopped", "on another rank", 1, shown=False) == 1
    assert capsys.readouterr().err == ""


def test_every_program_reports_its_failures_through_the_one_helper(tmp_path, capsys):
    import visualize

    assert visualize.main(["--run-dir", str(tmp_path / "[red]run")]) == 2
    assert f"Error: {tmp_path / '[red]run' / 'metrics.jsonl'} does not exist" in " ".join(capsys.readouterr().err.split())
    programs = ["train_ppo.py", "evaluate.py", "sft_warmstart.py", "merge.py", "prepare_model.py", "visualize.py"]
    assert [p for p in programs if "report_failure(" not in (ROOT / p).read_text()] == []
    assert [p for p in programs if "console.print(f\"[red]" in (ROOT / p).read_text()] == []


@pytest.mark.slow
def test_a_training_run_prints_no_warning(tiny_model_dir, tmp_path):
    from test_train import tiny_args

    done = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), *tiny_args(tiny_model_dir, tmp_path),
                           "--max-steps", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    noisy = [line for line in (done.stdout + done.stderr).splitlines() if "warn" in line.lower()]
    assert noisy == []


def test_progress_without_a_terminal_prints_a_plain_line_per_interval(monkeypatch):
    import io

    from ppo_affine import run_log

    clock = iter([0.0, 10.0, 70.0, 80.0, 200.0])  # start, then one reading per finished episode
    monkeypatch.setattr(run_log.time, "monotonic", lambda: next(clock))
    log_file = io.StringIO()  # like a log file: not a terminal
    monkeypatch.setattr(run_log.console, "_file", log_file)  # rich's own slot; undone after the test
    with run_log.rollout_progress(4, "eval: episodes") as advance:
        for _ in range(4):
            advance()
    lines = [line for line in log_file.getvalue().splitlines() if line.strip()]
    # 10 s: too soon; 70 s: a line; 80 s: 10 s after the last line; the 4th episode ends the work silently
    assert lines == ["eval: episodes: 2/4 (70 s)"]


def test_a_steps_summary_adds_up_the_opponents_own_seconds_over_its_episodes():
    from ppo_affine.envs.tasks import Task
    from ppo_affine.rollout import Episode

    def episode(task_id: int, seconds: float | None, error: str | None = None) -> Episode:
        info = {} if seconds is None else {"opponent_seconds": seconds}
        return Episode(task=Task("openspiel", task_id, 0, "mcts", "s", False), env_kind="openspiel", done=True,
                       score=1.0, error=error, info=info)

    episodes = [episode(0, 0.25), episode(1, 1.5), episode(2, None), episode(3, 0.5, error="lost")]
    summary = episode_summary(episodes, rollout_seconds=2.0, rewards={id(e): 1.0 for e in episodes})
    # a failed episode's opponent still spent its time; an env that does not report it adds nothing
    assert summary["perf/opponent_seconds"] == pytest.approx(2.25)
    assert summary["env/episodes"] == 4 and summary["env/episodes_failed"] == 1


def test_a_resumed_run_drops_the_metrics_and_samples_of_the_steps_it_plays_again(tmp_path):
    from ppo_affine.config import LoggingConfig
    from ppo_affine.run_log import RunLogger

    lines = [json.dumps({"step": step, "episode": 0}) for step in (1, 2, 3, 4)]
    for name in ("metrics.jsonl", "samples.jsonl"):
        (tmp_path / name).write_text("\n".join(lines) + '\n{"step": 5, "epi')  # the kill tore the last line
    RunLogger(tmp_path, LoggingConfig(wandb_project=None), {}, resumed_step=2)
    for name in ("metrics.jsonl", "samples.jsonl"):
        assert [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()] == [1, 2], name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "samples.jsonl"]  # no staging left
