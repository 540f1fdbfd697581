"""The embedded trace env: the Affine trace env's injection, prompt, cleaning and scoring rules (docs/protocols.md,
'The trace env'), episodes, the degenerate-task option and the embedded program generator. Nothing here touches the Hub: the `hf`
source is fed rows directly."""
from __future__ import annotations

import ast
import asyncio
import re
from collections import Counter

import pytest

from ppo_affine.envs.sandbox import SandboxLimits, run_python
from ppo_affine.envs.tasks import trace_level_of, trace_level_range
from ppo_affine.envs.trace_env import (
    TraceEnv,
    build_prompt,
    clean_prediction,
    clean_program_source,
    inject_debug_prints,
    next_task_id,
    normalize_output,
    score_prediction,
)
from ppo_affine.envs.trace_programs import generate_program, repeats_a_held_out_program

LIMITS = SandboxLimits(memory_bytes=512 << 20, max_processes=16)
# A variable bound only in a branch that never runs: injected prints that pick `extra` crash.
HAZARD = "total = 0\nfor i in range(3):\n    if i > 5:\n        extra = i\n    total += i\nprint(total)\n"
DBG = re.compile(r"__DBG_(\d+)__")


def dbg_lines(program: str) -> list[str]:
    return [line for line in program.splitlines() if "__DBG_" in line]


def printed_names(line: str) -> set[str]:
    return set(re.findall(r"repr\((\w+)\)", line))


def env_for(rows: list[dict], **kwargs) -> TraceEnv:
    return TraceEnv(source="hf", dataset=rows, timeout=kwargs.pop("timeout", 5.0), sandbox_limits=LIMITS, **kwargs)


# ---------------------------------------------------------------- program cleaning and injection
@pytest.mark.parametrize("raw, cleaned", [
    ("```python\nprint(1)\n```", "print(1)"),
    ("  ```\nx = 1\n```  \n", "x = 1"),
    ("print(2)\n```", "print(2)"),
    ("```py", ""),  # a fence line and nothing else
    ("\n  y = 3  \n", "y = 3"),
])
def test_program_source_loses_its_fence_and_surrounding_whitespace(raw, cleaned):
    assert clean_program_source(raw) == cleaned


def test_injection_is_a_function_of_the_seed():
    source = "\n".join(f"v{i} = {i}" for i in range(12))
    assert inject_debug_prints(source, 7) == inject_debug_prints(source, 7)
    assert len({inject_debug_prints(source, seed)[0] for seed in range(10)}) == 10


def test_two_assignments_with_seed_1_get_two_prints():
    program, parsed = inject_debug_prints("x = 1\ny = x + 1\n", 1)
    assert parsed
    assert program == (
        "x = 1\n"
        "print('__DBG_0__', repr(x) if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__)\n"
        "y = x + 1\n"
        "print('__DBG_1__', repr(y) if isinstance(y, (int, float, str, bool, type(None))) else type(y).__name__, "
        "repr(x) if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__)"
    )


def test_at_most_six_prints_tagged_in_source_order():
    source = "\n".join(f"v{i} = {i}" for i in range(20))
    for seed in range(20):
        tags = [int(DBG.search(line).group(1)) for line in dbg_lines(inject_debug_prints(source, seed)[0])]
        assert tags == [0, 1, 2, 3, 4, 5]


def test_print_inside_an_if_is_numbered_before_the_print_after_it():
    lines = inject_debug_prints(HAZARD, 4)[0].splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "total = 0",
        "print('__DBG_0__'",
        "for i in range(3):",
        "    if i > 5:",
        "        extra = i",
        "        print('__DBG_1__'",  # inside the if: its body is processed first
        "    print('__DBG_2__'",  # after the whole if statement
        "    total += i",
        "    print('__DBG_3__'",
        "print(total)",
    ]


def test_statements_directly_inside_while_try_with_and_class_get_no_print():
    source = (
        "n = 0\nwhile n < 3:\n    n += 1\n    m = n\ntry:\n    t = 1\nexcept Exception:\n    t = 2\n"
        "with open('f') as fh:\n    w = 3\nclass K:\n    z = 4\n"
    )
    placements = Counter()
    for seed in range(40):
        lines = inject_debug_prints(source, seed)[0].splitlines()
        for index, line in enumerate(lines):
            if "__DBG_" in line:
                placements[(lines[index - 1], frozenset(printed_names(line)))] += 1
    # Only `n = 0` triggers a print, and only `n` is live there (nothing inside while/try/with/class is recorded).
    assert set(placements) == {("n = 0", frozenset({"n"}))}


def test_an_if_nested_in_a_while_is_still_processed():
    source = "c = 1\nwhile c:\n    if c:\n        q = 2\n    c = 0\n"
    inner = [line for seed in range(40) for line in dbg_lines(inject_debug_prints(source, seed)[0])
             if line.startswith("        print(")]
    assert inner  # prints after `q = 2`, inside the if inside the while
    assert set().union(*map(printed_names, inner)) == {"c", "q"}


def test_function_scope_starts_with_its_plain_positional_parameters():
    source = "g = 0\ndef f(a, /, b, *c, d, **e):\n    h = b\n    return h\n"
    inside = set()
    for seed in range(60):
        for line in dbg_lines(inject_debug_prints(source, seed)[0]):
            if line.startswith("    "):
                inside |= printed_names(line)
    assert inside == {"g", "b", "h"}  # never the positional-only, *args, keyword-only or **kwargs names


def test_only_assignment_and_for_targets_become_live_names():
    source = (
        "import os\nx: int = 1\n(y := 2)\ndef fn():\n    pass\nclass C:\n    pass\n"
        "with open('f') as w:\n    pass\ntry:\n    pass\nexcept Exception as err:\n    pass\n"
        "for i, (j, k) in []:\n    pass\nobj.attr = 1\nseq[0] = 1\np, [q, *r] = (1, [2, 3])\ns += 1\nu = 0\n"
    )
    seen = set()
    for seed in range(200):
        for line in dbg_lines(inject_debug_prints(source, seed)[0]):
            seen |= printed_names(line)
    assert seen == {"i", "j", "k", "p", "q", "s", "u"}


def test_syntax_error_becomes_a_comment_in_front_of_the_source():
    assert inject_debug_prints("```python\ndef broken(:\n```", 0) == (
        "# Syntax Error in source: invalid syntax (<unknown>, line 1)\ndef broken(:", False)


def test_debug_values_show_scalar_reprs_and_other_type_names():
    source = "s = 'a'\nn = None\nf = 1.5\nb = True\nxs = [1]\nd = {}\nclass K:\n    pass\nk = K()\n"
    result = run_python(inject_debug_prints(source, 3)[0], limits=LIMITS)
    assert result.stdout.splitlines() == [
        "__DBG_0__ 'a'", "__DBG_1__ 'a' 1.5 None", "__DBG_2__ None", "__DBG_3__ True dict None", "__DBG_4__ K",
    ]


# ---------------------------------------------------------------- prompt
def test_prompt_has_the_spec_structure():
    assert build_prompt("print(input())", "7\n") == (
        "Predict the exact and complete standard output (stdout) of the Python program below, including the "
        "output of every print statement.\n\n"
        "Debug prints that start with '__DBG_' have been injected into the program; include their output exactly "
        "as it would appear, together with everything else the program prints.\n\n"
        "Program:\n```python\nprint(input())\n```\n\n"
        "Input (stdin):\n```\n7\n\n```\n\n"  # stdin verbatim: its final newline leaves a blank line
        "Reply with the full stdout content only, with no explanation or commentary outside the predicted output."
    )


# ---------------------------------------------------------------- answer cleaning and scoring
@pytest.mark.parametrize("answer, cleaned", [
    ("<think>2 + 2</think>4", "4"),
    ("<think>a</think>x<think>b</think>y", "xy"),
    ("<THINK>upper case survives</THINK>5", "<THINK>upper case survives</THINK>5"),
    ("still thinking</think>\n 6 ", "6"),
    ("a</think>b</think> 7", "7"),
    ("<thinking>plan</thinking>8", "8"),
    ("<think>unclosed 9", "<think>unclosed 9"),
    ("Output:\n```text\n1\n2\n```\nand\n```\n3\n```", "1\n2"),
    ("```\n10\n```", "10"),
    ("```11```", "11"),
    ("```python\nunclosed fence", "```python\nunclosed fence"),
    ("  plain  \n", "plain"),
])
def test_answer_cleaning(answer, cleaned):
    assert clean_prediction(answer) == cleaned


def test_comparison_ignores_whitespace_and_case_only():
    assert normalize_output("__DBG_0__ 'a' 1\n3") == "__dbg_0__'a'13"
    assert score_prediction("__dbg_0__'A'1 3", "__DBG_0__ 'a' 1\n3") == 1.0
    assert score_prediction("<think>hmm</think>```\n__DBG_0__ 'a'\t1 3\n```", "__DBG_0__ 'a' 1\n3") == 1.0
    assert score_prediction('__DBG_0__ "a" 1\n3', "__DBG_0__ 'a' 1\n3") == 0.0  # quotes count
    assert score_prediction("__DBG_0__ 'a' 1", "__DBG_0__ 'a' 1\n3") == 0.0  # no partial credit


# ---------------------------------------------------------------- episodes
def test_episode_reset_step_state_stop():
    async def main():
        env = TraceEnv(sandbox_limits=LIMITS)
        reset = await env.reset(task_id=2_000_011, seed=5)
        challenge = await env.challenge(2_000_011)
        info = reset["info"]
        assert (reset["done"], reset["reward"], reset["observation"]) == (False, 0.0, challenge.prompt)
        assert info == {
            "task_id": 2_000_011, "requested_task_id": 2_000_011, "seed": 5, "game_name": "trace",
            "system_prompt": None, "turn_prompt": challenge.prompt, "parse_error": False, "step_count": 0,
            "score": 0.0, "degenerate": None, "difficulty": 3,
        }
        episode_id = reset["episode_id"]
        assert (await env.state(episode_id))["observation"] == challenge.prompt

        answer = "<think>trace it</think>\n```\n" + challenge.ground_truth.upper() + "\n```"
        step = await env.step(answer, episode_id)
        assert (step["reward"], step["done"], step["truncated"]) == (1.0, True, False)
        assert step["info"]["success"] is True and step["info"]["turn_prompt"] == ""
        assert step["observation"].startswith("**Score:** 1.0\n**Test Result:** 1/1\n")
        assert challenge.ground_truth in step["observation"]  # the report reveals the answer, like the real env

        again = await env.step("anything", episode_id)
        assert (again["reward"], again["done"], again["info"]["error"]["type"]) == (1.0, True, "episode_done")
        assert (await env.state(episode_id))["observation"] == "Episode completed with score 1.0."
        assert await env.stop(episode_id) == {"status": "ok", "stopped": True, "episode_id": episode_id}
        missing = await env.step("x", episode_id)
        assert (missing["truncated"], missing["info"]["error"]["type"]) == (True, "episode_not_found")
        no_id = await env.step("x", "")
        assert no_id["info"]["error"]["type"] == "no_episode_id"
        assert (await env.stop("nope"))["stopped"] is False
        await env.close()

    asyncio.run(main())


def test_wrong_answer_scores_zero_and_reports_both_outputs():
    async def main():
        env = env_for([{"program": "print('x' * 600)", "inputs": ""}])
        reset = await env.reset(task_id=0)
        step = await env.step("y", reset["episode_id"])
        assert (step["reward"], step["info"]["success"]) == (0.0, False)
        assert "**Test Result:** 0/1" in step["observation"]
        assert "x" * 500 + "...\n```" in step["observation"]  # the expected output, cut at 500 characters

    asyncio.run(main())


def test_hf_rows_are_picked_by_task_id_modulo_length_and_seeded_by_task_id():
    rows = [{"program": "a = 1\nprint(a)", "inputs": ""},
            {"program": "```python\nb = input()\nc = b * 2\nd = c + '!'\nprint(d)\n```", "inputs": "hi\n"}]

    async def main():
        env = env_for(rows)
        first, wrapped = await env.challenge(1), await env.challenge(3)
        assert (first.location, first.inputs, first.ground_truth.splitlines()[-1]) == ({"dataset_index": 1}, "hi\n",
                                                                                         "hihi!")
        assert wrapped.location == {"dataset_index": 1}
        strip = lambda program: [line for line in program.splitlines() if "__DBG_" not in line]  # noqa: E731
        assert strip(first.program) == strip(wrapped.program) == ["b = input()", "c = b * 2", "d = c + '!'", "print(d)"]
        assert first.program != wrapped.program  # same row, different injection seed
        reset = await env.reset(task_id=4)
        assert reset["info"]["dataset_index"] == 0

    asyncio.run(main())


def test_an_action_that_is_not_text_ends_the_episode_with_an_evaluation_error():
    async def main():
        env = env_for([{"program": "print(1)", "inputs": ""}])
        reset = await env.reset(task_id=0)
        step = await env.step(None, reset["episode_id"])
        assert (step["reward"], step["done"], step["info"]["success"]) == (0.0, True, False)
        assert (step["info"]["error"]["type"], step["info"]["error"]["retryable"]) == ("evaluation_error", False)

    asyncio.run(main())


def test_empty_ground_truth_lets_an_empty_answer_score_one_by_default():
    async def main():
        env = env_for([{"program": "def quiet():\n    return 1\nquiet()", "inputs": ""}])
        reset = await env.reset(task_id=0)
        assert reset["info"]["degenerate"] == "empty_output"
        step = await env.step("", reset["episode_id"])
        assert step["reward"] == 1.0  # the Affine env's scoring hole, reproduced

    asyncio.run(main())


def test_crash_from_an_injected_print_keeps_the_partial_output():
    async def main():
        env = env_for([{"program": HAZARD, "inputs": ""}])
        challenge = await env.challenge(3)
        assert (challenge.ground_truth, challenge.degenerate) == ("__DBG_0__ 0", "crashed")

    asyncio.run(main())


def test_skip_degenerate_moves_to_the_next_usable_row():
    rows = [{"program": HAZARD, "inputs": ""}]  # seeds 3 and 4 crash, seed 5 runs to the end

    async def main():
        env = env_for(rows, skip_degenerate=True)
        reset = await env.reset(task_id=3)
        assert (reset["info"]["task_id"], reset["info"]["requested_task_id"]) == (5, 3)
        assert (await env.challenge(5)).ground_truth == "3"
        step = await env.step("3", reset["episode_id"])
        assert step["reward"] == 1.0

    asyncio.run(main())


def test_skip_degenerate_drops_empty_and_timed_out_tasks():
    rows = [{"program": "pass", "inputs": ""}, {"program": "while True:\n    pass", "inputs": ""},
            {"program": "print('kept')", "inputs": ""}]

    async def main():
        env = env_for(rows, skip_degenerate=True, timeout=0.5)
        reset = await env.reset(task_id=0)
        assert (reset["info"]["task_id"], reset["info"]["requested_task_id"]) == (2, 0)
        timed_out = await env.challenge(1)
        assert (timed_out.ground_truth, timed_out.degenerate) == ("", "timeout")

    asyncio.run(main())


def test_skip_degenerate_gives_up_with_a_clear_error():
    async def main():
        env = env_for([{"program": "1 / 0", "inputs": ""}], skip_degenerate=True)
        reset = await env.reset(task_id=0, seed=1)
        assert (reset["done"], reset["truncated"], reset["episode_id"]) == (True, True, None)
        error = reset["info"]["error"]
        assert (error["type"], error["retryable"]) == ("generation_error", True)
        assert "skip_degenerate=False" in error["message"]
        assert reset["observation"].startswith("Error generating challenge:")

    asyncio.run(main())


def test_embedded_skip_stays_inside_the_difficulty_level_and_its_held_out_or_training_ids():
    assert next_task_id(1_000_021, "embedded") == 1_000_022
    assert next_task_id(999_999, "embedded") == 10_000  # a training id wraps to the level's first training id
    assert next_task_id(2_999_999, "embedded") == 2_010_000
    assert next_task_id(3_009_999, "embedded") == 3_000_000  # a held-out id wraps inside the held-out ids
    # 3_010_003's program is held-out task 3_004_534's ("text = 'radar'"): a training skip passes over it
    assert next_task_id(3_010_002, "embedded") == 3_010_004
    assert next_task_id(41, "hf") == 42

    async def main():
        # Task 1_000_021's injected prints read a variable its `if` never bound (found by scanning ids).
        faithful = await TraceEnv(sandbox_limits=LIMITS).challenge(1_000_021)
        assert faithful.degenerate == "crashed"
        reset = await TraceEnv(skip_degenerate=True, sandbox_limits=LIMITS).reset(task_id=1_000_021)
        assert (reset["info"]["task_id"], reset["info"]["requested_task_id"]) == (1_000_022, 1_000_021)
        assert reset["info"]["difficulty"] == 2

    asyncio.run(main())


def test_ground_truth_is_cached_and_shared_by_concurrent_resets():
    async def main():
        env = TraceEnv(sandbox_limits=LIMITS)
        resets = await asyncio.gather(*(env.reset(task_id=17) for _ in range(4)))
        assert env.sandbox_runs == 1
        assert len({r["episode_id"] for r in resets}) == 4
        await env.reset(task_id=17)
        await env.reset(task_id=18)
        assert env.sandbox_runs == 2

    asyncio.run(main())


def test_missing_task_id_and_seed_come_from_the_env_seed():
    async def main():
        first = await TraceEnv(seed=3, sandbox_limits=LIMITS).reset()
        second = await TraceEnv(seed=3, sandbox_limits=LIMITS).reset()
        assert (first["info"]["task_id"], first["info"]["seed"]) == (second["info"]["task_id"], second["info"]["seed"])
        assert first["observation"] == second["observation"]

    asyncio.run(main())


def test_bad_rows_and_an_unloadable_dataset_are_generation_errors(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no route to the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)

    async def main():
        bad_row = await env_for([{"code": "print(1)"}]).reset(task_id=0)
        assert "lacks 'program'/'inputs'" in bad_row["info"]["error"]["message"]
        unloadable = await TraceEnv(source="hf").reset(task_id=0)
        message = unloadable["info"]["error"]["message"]
        assert "could not load trace dataset 'satpalsr/rl-python'" in message and "no route to the Hub" in message

    asyncio.run(main())


def test_constructor_and_reset_reject_bad_arguments():
    with pytest.raises(ValueError, match="source"):
        TraceEnv(source="github")
    with pytest.raises(ValueError, match="timeout"):
        TraceEnv(timeout=0)
    with pytest.raises(ValueError, match="only used with source='hf'"):
        TraceEnv(dataset=[])
    with pytest.raises(TypeError, match="opponent"):
        asyncio.run(TraceEnv().reset(task_id=0, opponent="mcts"))
    with pytest.raises(ValueError, match="task_id must be >= 0"):
        asyncio.run(TraceEnv().reset(task_id=-1))


# ---------------------------------------------------------------- the embedded generator
def test_generator_is_deterministic_and_labels_the_difficulty():
    for task_id in (0, 999_999, 1_000_000, 2_500_000, 3_000_001):
        program = generate_program(task_id)
        assert program == generate_program(task_id)
        assert program.difficulty == trace_level_of(task_id)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_generator_is_diverse(level):
    low, _ = trace_level_range(level)
    sources = [generate_program(task_id).source for task_id in range(low, low + 200)]
    shapes = {tuple(type(node).__name__ for node in ast.walk(ast.parse(source))) for source in sources}
    assert len(set(sources)) > 190
    assert len(shapes) > 100  # different structures, not only different names and numbers


def test_level_0_is_one_print_of_a_value_a_copy_or_one_expression():
    low, high = trace_level_range(0)
    assert (low, high) == (3_000_000, 4_000_000) and trace_level_range(1) == (0, 1_000_000)  # levels 1-3 kept ids
    assert trace_level_of(low) == 0 and trace_level_of(high) == 1  # past the fourth block the ids wrap
    sources = [generate_program(task_id).source for task_id in range(low, low + 200)]
    assert len(set(sources)) > 150
    for source in sources:
        statements = ast.parse(source).body
        assert 2 <= len(statements) <= 3 and sum("print(" in line for line in source.splitlines()) == 1
    injected = [inject_debug_prints(source, task_id)[0] for task_id, source in enumerate(sources, low)]
    assert sum("__DBG_0__" in program for program in injected) > 150  # most carry the env's debug print


def test_generator_programs_grow_with_the_level():
    mean_lines = []
    for level in (0, 1, 2, 3):
        low, _ = trace_level_range(level)
        counts = [len(generate_program(task_id).source.splitlines()) for task_id in range(low, low + 100)]
        mean_lines.append(sum(counts) / len(counts))
    assert mean_lines[0] < mean_lines[1] < mean_lines[2] < mean_lines[3]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_generated_programs_run_cleanly_and_print(level):
    low, _ = trace_level_range(level)
    task_ids = list(range(low, low + 4))
    if level > 1:  # include one that reads stdin
        task_ids.append(next(t for t in range(low, low + 500) if generate_program(t).inputs))
    for task_id in task_ids:
        program = generate_program(task_id)
        result = run_python(program.source, program.inputs, limits=LIMITS)
        assert (result.returncode, result.killed_reason) == (0, None), (task_id, result.stderr)
        assert len(result.stdout.strip().splitlines()) >= 1


def test_line_credit_is_the_share_of_lines_right_in_place_over_the_longer_side():
    from ppo_affine.envs.trace_env import line_credit

    truth = "__DBG_0__ 3\n7\nDone"
    assert line_credit("```\n__DBG_0__ 3\n7\nDone\n```", truth) == 1.0
    assert line_credit("```\n__dbg_0__  3\n8\nDone\n```", truth) == pytest.approx(2 / 3)  # case and spaces ignored
    assert line_credit("__DBG_0__ 3\n7\nDone\nDone\nDone", truth) == pytest.approx(3 / 5)  # running on costs
    assert line_credit("7\n__DBG_0__ 3", truth) == 0.0  # in place: a shifted line is wrong
    assert line_credit("", "") == 1.0 and line_credit("x", "") == 0.0


def test_a_trace_step_reports_line_credit_beside_the_exact_score():
    async def play():
        env = TraceEnv(sandbox_limits=LIMITS)
        started = await env.reset(task_id=3_000_000)
        truth = (await env.challenge(3_000_000)).ground_truth
        wrong_last = "\n".join(truth.splitlines()[:-1] + ["nope"])
        return truth, await env.step(wrong_last, started["episode_id"])

    truth, result = asyncio.run(play())
    lines = len(truth.splitlines())
    assert result["reward"] == 0.0 and result["info"]["score"] == 0.0
    assert result["info"]["line_credit"] == pytest.approx((lines - 1) / lines)


def test_a_training_task_whose_program_is_a_held_out_tasks_is_recognised():
    assert generate_program(3_010_003).source == generate_program(3_004_534).source == "text = 'radar'\nprint(text)\n"
    assert repeats_a_held_out_program(3_010_003)
    assert not repeats_a_held_out_program(3_010_004) and not repeats_a_held_out_program(3_004_534)  # held out itself
