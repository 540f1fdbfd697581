"""The interpreter as the trace env's teacher (ppo_affine/warm_start/trace_teacher.py) and `sft_warmstart.py --trace`."""
import json

import pytest

import sft_warmstart
from ppo_affine.config import ConfigError, load_config
from ppo_affine.envs.sandbox import SandboxLimits, run_python
from ppo_affine.envs.tasks import TRACE_HELD_OUT, trace_level_of
from ppo_affine.envs.trace_env import build_prompt, inject_debug_prints, score_prediction
from ppo_affine.envs.trace_programs import generate_program, repeats_a_held_out_program
from ppo_affine.warm_start import trace_teacher
from ppo_affine.warm_start.sft import read_records


def test_task_ids_cycle_the_levels_above_the_held_out_tasks_and_never_repeat():
    ids = trace_teacher.trace_task_ids([0, 1], 40, seed=7)
    assert [trace_level_of(t) for t in ids] == [0, 1] * 20
    assert len(set(ids)) == 40 and all(t % 1_000_000 >= TRACE_HELD_OUT for t in ids)
    assert ids == trace_teacher.trace_task_ids([0, 1], 40, seed=7) != trace_teacher.trace_task_ids([0, 1], 40, seed=8)


def test_task_ids_pass_over_the_held_out_tasks_programs_under_other_ids():
    ids = trace_teacher.trace_task_ids([0], 400, seed=7)  # the trace bench's SFT set is 400 tasks
    assert len(ids) == 400 and not any(repeats_a_held_out_program(t) for t in ids)


def test_every_records_reply_is_the_programs_real_stdout_in_the_envs_prompt_and_format():
    records = trace_teacher.interpreter_records(load_config(), [0, 1, 2], 6, seed=3)
    assert [r["level"] for r in records] == [0, 1, 2, 0, 1, 2]
    for record in records:
        program = generate_program(record["task_id"])
        shown, _ = inject_debug_prints(program.source, record["task_id"])
        ran = run_python(shown, program.inputs, limits=SandboxLimits(memory_bytes=512 << 20, max_processes=16))
        user, reply = record["messages"]
        assert user == {"role": "user", "content": build_prompt(shown, program.inputs)}
        assert reply["role"] == "assistant" and reply["content"] == f"```\n{ran.stdout.strip()}\n```"
        assert ran.stdout.strip() and score_prediction(reply["content"], ran.stdout) == 1.0
        assert record["env"] == "trace" and record["expert"] == "interpreter" and record["score"] == 1.0


def test_a_held_out_trace_task_is_refused_as_training_data(tmp_path):
    record = {"env": "trace", "task_id": 3_000_005, "seed": 1, "game": "trace",
              "messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "```\n1\n```"}]}
    (tmp_path / "data.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match="trace task 3000005 is a held-out task"):
        read_records(tmp_path / "data.jsonl")


def test_a_trace_task_repeating_a_held_out_program_is_refused_as_training_data(tmp_path):
    record = {"env": "trace", "task_id": 3_010_003, "seed": 1, "game": "trace",  # held-out 3_004_534's program
              "messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "```\nradar\n```"}]}
    (tmp_path / "data.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match="trace task 3010003's program is a held-out task's program"):
        read_records(tmp_path / "data.jsonl")


def test_sft_on_interpreter_records_alone_writes_them_and_a_checkpoint(tiny_model_dir, tmp_path):
    sets = ["--set", f"model.name_or_path={tiny_model_dir}", "--set", "model.use_4bit=false",
            "--set", "model.dtype=float32", "--set", "run.device=cpu", "--set", "model.gradient_checkpointing=false"]
    assert sft_warmstart.main(["--games", "", "--trace", "4", "--trace-levels", "0", "--epochs", "1",
                               "--output-dir", str(tmp_path / "sft"), *sets]) == 0
    records = [json.loads(line) for line in (tmp_path / "sft" / "sft_data.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["env"] == "trace" and r["level"] == 0 for r in records)
    assert list((tmp_path / "sft" / "checkpoints").glob("checkpoint-*"))


@pytest.mark.parametrize("args,expected", [
    (["--trace-levels", "0,7"], "--trace-levels: [0, 7] are not all in (0, 1, 2, 3)"),
    (["--trace-levels", "easy"], "--trace-levels: expected comma-separated levels"),
    (["--trace", "-1"], "--trace must be at least 0"),
    (["--games", ""], "--games is empty"),
])
def test_bad_trace_options_are_one_line_naming_the_option(args, expected, capsys):
    assert sft_warmstart.main(["--preset", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
