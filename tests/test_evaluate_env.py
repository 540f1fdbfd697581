"""Envs of kind `evaluate`: an episode is one call of the env's own evaluate() against the trainer's endpoint; the
foreign env of tests/foreign_env served by affinetes' own template server in url mode; faults; the real loop."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import train_ppo
from ppo_affine.config import ConfigError, EndpointConfig, GenerationConfig, load_config
from ppo_affine.endpoint import ChatEndpoint, EndpointUnused
from ppo_affine.envs.affinetes_env import AffinetesEnv, RemoteCallError
from ppo_affine.envs.tasks import Task
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rollout import RolloutRunner
from test_endpoint import HERMES, TOOLS_TEMPLATE, ScriptedGenerator
from test_train import metrics, tiny_args

FOREIGN_ENV = Path(__file__).parent / "foreign_env"
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def quiz_url(tmp_path_factory):
    """The foreign env behind affinetes' template server (the server its images run), on 127.0.0.1."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("quiz") / "server.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "uvicorn", "serve:app", "--app-dir", str(FOREIGN_ENV),
                                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                                   stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the quiz server did not start:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def tokenizer():
    from ppo_affine.testing.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def task(task_id: int = 32, seed: int = 5) -> Task:
    return Task(env="quiz", task_id=task_id, seed=seed, opponent=None, stage="s", replay=False)


def runner_for(env, tokenizer, replies: list[str], max_turns: int = 200, max_prompt_tokens: int = 2048,
               **evaluate_kwargs) -> RolloutRunner:
    cfg = GenerationConfig(max_new_tokens=64, max_prompt_tokens=max_prompt_tokens, max_concurrent_episodes=2,
                           max_turns=max_turns)
    generator = ScriptedGenerator(tokenizer, replies)
    prompts = PromptBuilder(tokenizer, cfg.max_prompt_tokens)
    endpoint = ChatEndpoint(generator, prompts, cfg, HERMES, "tiny", EndpointConfig())
    return RolloutRunner({"quiz": ("evaluate", env)}, generator, prompts, cfg, endpoint=endpoint,
                         evaluate_kwargs={"quiz": evaluate_kwargs})


def play(runner: RolloutRunner, tasks: list[Task]):
    async def run():
        try:
            return await runner.run(tasks, step=0)
        finally:
            await runner.endpoint.close()
            for _, env in runner.envs.values():
                await env.close()
    return asyncio.run(run())


# ---------------------------------------------------------------------- through affinetes url mode
def test_an_episode_is_one_evaluate_call_whose_calls_are_its_turns(quiz_url, tokenizer):
    env = AffinetesEnv(mode="url", base_url=quiz_url, call_timeout=30)
    [episode] = play(runner_for(env, tokenizer, [TOOL_CALL, "It is 5", "5"]), [task()])
    assert episode.error is None and episode.done
    assert episode.score == 1.0 and episode.success
    assert len(episode.turns) == 3
    assert [turn.sequence for turn in episode.turns] == [0, 0, 1]
    assert episode.info["prefix_breaks"] == 1 and episode.info["calls"] == 3
    assert episode.info["evaluate_result"]["task_name"] == "quiz"
    for turn in episode.turns:  # each reply sits in its sequence right after the prompt it was sampled for
        assert episode.sequences[turn.sequence][turn.start:turn.start + len(turn.response_ids)] == turn.response_ids
        assert turn.sampler_logprobs == [-0.25] * len(turn.response_ids) and turn.adapter_step == 7


def test_training_sequences_hold_each_call_once_with_its_reply_trained(quiz_url, tokenizer):
    from ppo_affine.batching import build_sequences

    env = AffinetesEnv(mode="url", base_url=quiz_url, call_timeout=30)
    [episode] = play(runner_for(env, tokenizer, [TOOL_CALL, "It is 5", "5"]), [task()])
    first, second = build_sequences([episode])
    assert first.turns == [0, 1] and second.turns == [2]
    assert first.response_len + second.response_len == sum(len(t.response_ids) for t in episode.turns)


@pytest.mark.parametrize("fault,kind", [("raise", "http_error"), ("no_score", "malformed_response"),
                                        ("error", "error")])
def test_an_evaluate_that_fails_drops_the_episode_with_its_reason(quiz_url, tokenizer, fault, kind):
    env = AffinetesEnv(mode="url", base_url=quiz_url, call_timeout=30, max_retries=0)
    [episode] = play(runner_for(env, tokenizer, [TOOL_CALL, "5", "5"], fault=fault), [task()])
    assert episode.info["fault"] == kind
    assert episode.error.startswith(f"evaluate() of env 'quiz' failed: {kind}: ")


def test_calls_past_max_turns_are_refused_and_cut_the_episode_off(quiz_url, tokenizer):
    """The quiz makes 3 calls; with generation.max_turns 2 its third is answered 400 (as a server limit), its client
    raises, and the episode is cut off (dropped from training, as a native episode at the limit, and not counted a
    failure) with the 2 calls it made."""
    env = AffinetesEnv(mode="url", base_url=quiz_url, call_timeout=30, max_retries=0)
    [episode] = play(runner_for(env, tokenizer, [TOOL_CALL, "It is 5", "5"], max_turns=2), [task()])
    assert episode.cut_off and episode.info["calls"] == 2 and len(episode.turns) == 2
    assert episode.error is None and episode.info["cut_off"] == "max_turns"
    assert "max_turns=2" in episode.info["harness_said"]


def test_a_context_overflow_cuts_the_episode_off_counts_it_and_warns_above_a_tenth(quiz_url, tokenizer, caplog):
    from ppo_affine.run_log import episode_summary

    env = AffinetesEnv(mode="url", base_url=quiz_url, call_timeout=30, max_retries=0)
    with caplog.at_level(logging.WARNING, logger="ppo_affine.rollout"):
        [episode] = play(runner_for(env, tokenizer, [], max_prompt_tokens=16), [task()])
    assert episode.cut_off and episode.error is None and episode.info["cut_off"] == "context"
    assert "longer than the model's context length (16 tokens)" in episode.info["harness_said"]
    summary = episode_summary([episode], 1.0, {id(episode): 0.0})
    assert summary["evaluate/cut_off_rate"] == 1.0 and summary["env/episodes_failed"] == 0
    assert [r.getMessage() for r in caplog.records if "cut off" in r.getMessage()] == [
        "100% of this step's evaluate() episodes were cut off at the context limit (generation.max_prompt_tokens=16) "
        "and are not trained on; raise generation.max_prompt_tokens if the validators' server allows more"]


def test_a_harness_that_never_calls_the_endpoint_stops_the_run_naming_the_env(quiz_url, tokenizer):
    env = AffinetesEnv(mode="url", base_url=quiz_url, call_timeout=30)
    with pytest.raises(EndpointUnused, match="env 'quiz': evaluate\\(\\) returned a score without calling"):
        play(runner_for(env, tokenizer, [], fault="no_call"), [task()])


class SometimesElsewhere:
    """An evaluate env that plays the quiz against the endpoint for even task ids and, for odd ones, returns a score
    without calling it (it talks to another model)."""
    call_timeout = 30

    async def methods(self):
        return ["evaluate"]

    async def close(self):
        pass

    async def evaluate(self, timeout, task_id, base_url, **kwargs):
        if task_id % 2:
            return {"task_name": "quiz", "score": 1.0, "success": True}
        from test_endpoint import Actor

        return await Actor().evaluate(task_id=task_id, base_url=base_url, timeout=timeout)


def test_an_episode_that_never_called_the_endpoint_is_dropped_with_its_reason_and_the_others_go_on(tokenizer):
    called, elsewhere = play(runner_for(SometimesElsewhere(), tokenizer, [TOOL_CALL, "It is 5", "5"]),
                             [task(32), task(33)])
    assert called.error is None and called.score == 1.0 and called.info["calls"] == 3
    assert elsewhere.info["fault"] == "unused" and "returned a score without calling" in elsewhere.error


class TimingOut:
    """An evaluate env whose call runs out of time (affinetes' timeout, as AffinetesEnv reports it)."""
    call_timeout = 1.0

    async def methods(self):
        return ["evaluate"]

    async def close(self):
        pass

    async def evaluate(self, timeout, **kwargs):
        raise RemoteCallError("timeout", "evaluate on quiz: no reply within 61s", retryable=True)


def test_an_evaluate_that_times_out_is_dropped_and_the_other_episodes_go_on(tokenizer):
    [episode] = play(runner_for(TimingOut(), tokenizer, []), [task()])
    assert episode.info["fault"] == "timeout" and "no reply within 61s" in episode.error


class WithoutEvaluate(TimingOut):
    async def methods(self):
        return ["reset", "step"]


def test_an_env_of_kind_evaluate_without_evaluate_is_a_config_error_naming_it(tokenizer):
    with pytest.raises(ConfigError, match="env 'quiz' is of kind 'evaluate' but offers"):
        play(runner_for(WithoutEvaluate(), tokenizer, []), [task()])


def test_step_metrics_count_calls_prefix_breaks_and_dropped_episodes(quiz_url, tokenizer):
    from ppo_affine.run_log import episode_summary

    env = AffinetesEnv(mode="url", base_url=quiz_url, call_timeout=30)
    episodes = play(runner_for(env, tokenizer, [TOOL_CALL, "5", "5", TOOL_CALL, "5", "5"]), [task(32), task(41)])
    env = AffinetesEnv(mode="url", base_url=quiz_url, call_timeout=30)
    broken = play(runner_for(env, tokenizer, [], fault="raise"), [task()])
    summary = episode_summary(episodes + broken, 1.0, {id(e): 0.0 for e in episodes + broken})
    assert summary["evaluate/calls"] == 6 and summary["evaluate/prefix_breaks"] == 2
    assert summary["evaluate/dropped/http_error"] == 1 and summary["env/episodes_failed"] == 1
    assert summary["evaluate/cut_off_rate"] == 0.0


# ---------------------------------------------------------------------- configuration
def quiz_config(env: dict, stages: list | None = None, endpoint: dict | None = None):
    stages = stages or [{"name": "s", "tasks": [{"env": "quiz", "task_id_ranges": [[0, 100]]}]}]
    overrides = [f"env.envs={json.dumps({'quiz': env})}", f"curriculum.stages={json.dumps(stages)}"]
    if endpoint:
        overrides.append(f"env.endpoint={json.dumps(endpoint)}")
    return load_config(overrides=overrides)


def test_kind_evaluate_needs_an_affinetes_mode():
    with pytest.raises(ConfigError, match="kind 'evaluate' runs the env's own evaluate\\(\\) through affinetes"):
        quiz_config({"kind": "evaluate"})


def test_evaluate_kwargs_cannot_set_what_the_trainer_sets():
    with pytest.raises(ConfigError, match="evaluate_kwargs \\['base_url', 'seed'\\] are set by the trainer"):
        quiz_config({"kind": "evaluate", "mode": "url", "url": "http://h:1", "evaluate_kwargs": {"seed": 1,
                                                                                                 "base_url": "x"}})


def test_an_evaluate_env_draws_its_tasks_from_task_id_ranges():
    with pytest.raises(ConfigError, match="give its task ids as 'task_id_ranges'"):
        quiz_config({"kind": "evaluate", "mode": "url", "url": "http://h:1"},
                    stages=[{"name": "s", "tasks": [{"env": "quiz", "games": ["goofspiel"]}]}])


def test_envs_in_containers_need_an_endpoint_address_they_can_reach():
    spec = {"kind": "evaluate", "mode": "docker", "image": "affinefoundation/swe:latest"}
    with pytest.raises(ConfigError, match="cannot reach this machine's loopback address 127.0.0.1"):
        quiz_config(spec)
    config = quiz_config(spec, endpoint={"host": "0.0.0.0", "port": 8700, "public_url": "http://172.17.0.1:8700"})
    assert config.env.endpoint.public_url == "http://172.17.0.1:8700"


def test_hosts_name_one_docker_host_per_replica():
    spec = {"kind": "evaluate", "mode": "docker", "image": "affinefoundation/swe:latest", "replicas": 2}
    endpoint = {"host": "0.0.0.0", "port": 8700, "public_url": "http://10.0.0.5:8700"}
    with pytest.raises(ConfigError, match="1 hosts for 2 replicas"):
        quiz_config({**spec, "hosts": ["localhost"]}, endpoint=endpoint)
    config = quiz_config({**spec, "hosts": ["localhost", "ssh://ops@gpu2"]}, endpoint=endpoint)
    assert config.env.envs["quiz"].hosts == ["localhost", "ssh://ops@gpu2"]


# ---------------------------------------------------------------------- the real loop
@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory):
    """The tiny model with a chat template that renders tools."""
    from transformers import AutoTokenizer

    from ppo_affine.testing.tiny import make_tiny_model_dir

    folder = make_tiny_model_dir(tmp_path_factory.mktemp("tools-model"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["gae", "group"])
def test_two_ppo_steps_train_on_the_foreign_env_through_the_real_loop(tools_model_dir, tmp_path, quiz_url, advantage):
    env = {"quiz": {"kind": "evaluate", "mode": "url", "url": quiz_url, "timeout": 120}}
    stages = [{"name": "s", "min_episodes": 1000, "tasks": [{"env": "quiz", "task_id_ranges": [[0, 100]]}]}]
    args = tiny_args(tools_model_dir, tmp_path, "--max-steps", "2", "--set", f"env.envs={json.dumps(env)}",
                     "--set", f"curriculum.stages={json.dumps(stages)}", "--set", "generation.max_new_tokens=6",
                     "--set", f"ppo.advantage={advantage}", "--set", "ppo.group_size=2")
    assert train_ppo.main(args) == 0
    records = metrics(tmp_path / "t")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["env/episodes"] == 4 and record["env/episodes_failed"] == 0
        assert record["evaluate/calls"] == 12 and record["evaluate/prefix_breaks"] == 4
        assert "policy/loss" in record and record["update/grad_norm"] > 0


# ---------------------------------------------------------------------- the game env, natively and through evaluate()
class LegalMoves:
    """Replies that play whole games: a legal action id read off the prompt, chosen by the request's seed (the same
    seeds on both paths), then EOS."""

    def __init__(self, tokenizer):
        self.tokenizer, self.eos_ids = tokenizer, {tokenizer.eos_token_id}

    async def generate(self, prompt_ids, order_key, seed):
        from ppo_affine.generation import Generation
        from ppo_affine.testing.scripted import scripted_reply

        return Generation(scripted_reply(self.tokenizer, prompt_ids, seed, self.tokenizer.eos_token_id))


@pytest.mark.slow
@pytest.mark.parametrize("replies", ["greedy", "legal"])
def test_the_game_env_through_its_evaluate_gives_the_native_paths_ids_and_rewards_call_by_call(tiny_model_dir,
                                                                                               tmp_path, replies):
    """Greedy replies of the tiny model (each game lost to three unusable replies) and legal moves (whole games that
    score apart) under `full`: the embedded game env played by the rollout, and the same env's evaluate()
    (python -m ppo_affine.envs.server) calling the endpoint, give the same prompts, replies and scores; the native
    path starts a new sequence exactly where the endpoint counts a prefix break."""
    from ppo_affine.envs.openspiel_env import OpenSpielEnv
    from ppo_affine.envs.tasks import game_task_id
    from ppo_affine.local_generation import LocalGenerator
    from ppo_affine.reply_parsers import PLAIN
    from ppo_affine.testing.tiny import load_tiny_policy
    from test_env_server import ServerProcess

    policy = load_tiny_policy(tiny_model_dir)
    cfg = GenerationConfig(backend="local", max_new_tokens=4, temperature=0.0, max_concurrent_episodes=1,
                           context_strategy="full")
    tasks = [Task("game", game_task_id("leduc_poker"), seed, "random", "s", False) for seed in range(1, 9)]

    def runner(envs, **endpoint_settings) -> RolloutRunner:
        generator = LocalGenerator(policy, cfg, seed=0) if replies == "greedy" else LegalMoves(policy.tokenizer)
        prompts = PromptBuilder(policy.tokenizer, 4096)
        endpoint = ChatEndpoint(generator, prompts, cfg, PLAIN, "tiny", EndpointConfig()) if endpoint_settings else None
        return RolloutRunner(envs, generator, prompts, cfg, endpoint=endpoint, **endpoint_settings)

    async def both():
        native = runner({"game": ("openspiel", OpenSpielEnv("evaluate"))})
        server = ServerProcess(tmp_path / "server.log", "--env", "openspiel").start()
        env = AffinetesEnv(mode="url", base_url=server.url, call_timeout=120)
        through = runner({"game": ("evaluate", env)}, evaluate_kwargs={"game": {"opponent": "random"}})
        try:
            return await native.run(tasks, step=0), await through.run(tasks, step=0)
        finally:
            await through.endpoint.close()
            await env.close()
            server.stop()

    native, through = asyncio.run(both())
    assert sum(len(e.turns) for e in native) > len(tasks)  # more than one call per game on the whole
    if replies == "legal":
        assert len({e.score for e in native}) > 2  # games played to their end, scored apart
    for mine, theirs in zip(native, through):
        assert theirs.error is None, theirs.error
        assert [t.response_ids for t in theirs.turns] == [t.response_ids for t in mine.turns]
        assert [theirs.prompt_ids(t) for t in theirs.turns] == [mine.prompt_ids(t) for t in mine.turns]
        assert theirs.score == mine.score
        assert theirs.info["prefix_breaks"] == len(mine.sequences) - 1


@pytest.mark.slow
def test_the_trace_env_through_its_evaluate_gives_the_native_paths_ids_and_rewards(tiny_model_dir, tmp_path):
    """The trace env's one call, greedy: natively and through its own evaluate() over the endpoint, the same prompt,
    reply and score (degenerate tasks skipped on both: there the real evaluate() leaves an empty reply unscored,
    where step() scores it)."""
    from ppo_affine.envs.tasks import trace_level_range
    from ppo_affine.envs.trace_env import TraceEnv
    from ppo_affine.local_generation import LocalGenerator
    from ppo_affine.reply_parsers import PLAIN
    from ppo_affine.testing.tiny import load_tiny_policy
    from test_env_server import ServerProcess

    policy = load_tiny_policy(tiny_model_dir)
    cfg = GenerationConfig(backend="local", max_new_tokens=8, temperature=0.0, max_concurrent_episodes=1,
                           context_strategy="full")
    low = trace_level_range(0)[0] + 20_000
    tasks = [Task("trace", low + i, seed, None, "s", False) for i, seed in enumerate((3, 4, 5, 6))]
    sandbox = ["--skip-degenerate", "--unsafe-rlimit-only-sandbox"]  # our own generated programs: rlimits suffice

    async def both():
        generator, prompts = LocalGenerator(policy, cfg, seed=0), PromptBuilder(policy.tokenizer, 4096)
        native = RolloutRunner({"trace": ("trace", TraceEnv(skip_degenerate=True, unsafe_rlimit_only_sandbox=True))},
                               generator, prompts, cfg)
        server = ServerProcess(tmp_path / "server.log", "--env", "trace", *sandbox).start()
        env = AffinetesEnv(mode="url", base_url=server.url, call_timeout=120)
        generator = LocalGenerator(policy, cfg, seed=0)
        endpoint = ChatEndpoint(generator, prompts, cfg, PLAIN, "tiny", EndpointConfig())
        through = RolloutRunner({"trace": ("evaluate", env)}, generator, prompts, cfg, endpoint=endpoint)
        try:
            return await native.run(tasks, step=0), await through.run(tasks, step=0)
        finally:
            await endpoint.close()
            await env.close()
            server.stop()

    native, through = asyncio.run(both())
    for mine, theirs in zip(native, through):
        assert theirs.error is None, theirs.error
        assert [t.response_ids for t in theirs.turns] == [t.response_ids for t in mine.turns]
        assert [theirs.prompt_ids(t) for t in theirs.turns] == [mine.prompt_ids(t) for t in mine.turns]
        assert (theirs.score, theirs.info["prefix_breaks"]) == (mine.score, 0)
