"""`python -m ppo_affine.episodes show RUN --step S --episode N`: one recorded episode's calls, as
`logging.log_samples_every` wrote them, and whether re-rendering each recorded request reproduces its prompt ids."""
from __future__ import annotations

import asyncio
import json

import pytest

from ppo_affine.config import EndpointConfig, GenerationConfig, LoggingConfig
from ppo_affine.endpoint import ChatEndpoint
from ppo_affine.envs.tasks import Task
from ppo_affine.episodes import first_difference, main
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import RolloutRunner
from ppo_affine.run_log import RunLogger
from test_endpoint import HERMES, TOOLS_TEMPLATE, Actor, ScriptedGenerator

TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class Quiz:
    """The foreign env's quiz, played in process against the episode's endpoint."""
    call_timeout = 30

    async def methods(self):
        return ["evaluate"]

    async def close(self):
        pass

    async def evaluate(self, timeout, task_id, base_url, **kwargs):
        return await Actor().evaluate(task_id=task_id, base_url=base_url, timeout=timeout)


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A run folder whose samples.jsonl holds one quiz episode played through the endpoint, and its tokenizer."""
    from ppo_affine.testing.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    folder = tmp_path_factory.mktemp("run")
    tokenizer.save_pretrained(folder / "tokenizer")
    cfg = GenerationConfig(max_new_tokens=64, max_prompt_tokens=2048, max_concurrent_episodes=1)
    generator = ScriptedGenerator(tokenizer, [TOOL_CALL, "It is 5", "5"])
    prompts = PromptBuilder(tokenizer, cfg.max_prompt_tokens)
    endpoint = ChatEndpoint(generator, prompts, cfg, HERMES, "tiny", EndpointConfig())
    runner = RolloutRunner({"quiz": ("evaluate", Quiz())}, generator, prompts, cfg, endpoint=endpoint)

    async def play():
        try:
            return await runner.run([Task(env="quiz", task_id=32, seed=5, opponent=None, stage="s", replay=False)], 3)
        finally:
            await endpoint.close()

    [episode] = asyncio.run(play())
    logger = RunLogger(folder, LoggingConfig(), {"train": {"model": None}}, fresh=True)
    logger.log_sample(3, episode)
    return folder, tokenizer


def show(capsys, *argv) -> tuple[int, str]:
    code = main(["show", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_show_prints_each_call_recorded_and_checks_its_re_render(recorded_run, capsys):
    folder, tokenizer = recorded_run
    code, out = show(capsys, folder, "--step", 3, "--episode", 0, "--model", folder / "tokenizer")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("step 3 episode 0: env quiz task 32 seed 5 | score 1.0 | error None | cut off False | "
                        "3 calls")
    record = json.loads((folder / "samples.jsonl").read_text())
    first = record["calls"][0]
    assert f"--- call 0: prompt {len(first['prompt_ids'])} ids, sampled {len(first['token_ids'])} ids, finish " \
           "tool_calls, adapter step 7, reward 0.0" in lines
    assert f"decoded:     {tokenizer.decode(first['token_ids'])!r}" in lines
    assert 'tool call:   add({"a": 2, "b": 3})' in lines
    assert "log-probs:   [-0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, ...] " \
           "(mean -0.250, min -0.250)" in lines
    assert [line for line in lines if line.startswith("content:")][1:] == ["content:     'It is 5'",
                                                                          "content:     '5'"]
    checks = [line for line in lines if line.startswith("re-render:")]
    assert checks == [f"re-render: reproduces the {len(c['prompt_ids'])} recorded prompt ids" for c in record["calls"]]


def test_a_recorded_prompt_that_re_renders_otherwise_names_the_first_token_that_differs(recorded_run, capsys,
                                                                                       tmp_path):
    folder, tokenizer = recorded_run
    record = json.loads((folder / "samples.jsonl").read_text())
    prompt = record["calls"][1]["prompt_ids"]
    record["calls"][1]["prompt_ids"] = prompt[:5] + [prompt[5] + 1] + prompt[6:]
    (tmp_path / "samples.jsonl").write_text(json.dumps(record) + "\n")
    code, out = show(capsys, tmp_path, "--step", 3, "--model", folder / "tokenizer")
    expected = (f"re-render: differs at token 5 of {len(prompt)}: recorded {prompt[5] + 1} "
                f"{tokenizer.decode([prompt[5] + 1])!r}, re-rendered {prompt[5]} {tokenizer.decode([prompt[5]])!r} "
                f"(re-rendered {len(prompt)} ids)")
    assert code == 0 and expected in out.splitlines()


def test_a_step_or_episode_not_recorded_is_named_with_what_is(recorded_run, capsys):
    folder, _ = recorded_run
    code, out = show(capsys, folder, "--step", 4, "--episode", 0, "--model", folder / "tokenizer")
    assert code == 2 and "holds no episode 0 of step 4; it holds (step, episode) [(3, 0)]" in out


def test_first_difference_counts_a_list_that_ends_early():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
