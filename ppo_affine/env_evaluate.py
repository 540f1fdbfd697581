"""evaluate.py --env-evaluate: score through the environment's own `evaluate()`, the call validators make.

The env (a real Affine image started in Docker, or a running env server such as `python -m
envs.server --env openspiel`) plays each whole game itself: it sends the validators' conversation to
the vLLM server at `--env-llm-url` (default env.vllm_url), with their prompt text, parser, timeouts,
temperature and opponent, and returns the score. This module only prepares the server (the adapter is
loaded with /v1/load_lora_adapter, as in training), asks for one game per task, and turns each result
into the same episode record as evaluate.py's own path, so the report, episodes.jsonl and
summary.json look the same.

Failures: a call the env could not complete, or a result with an `error` (API error, timeout,
unplayable task), becomes an episode with `error` set, which the report keeps out of every rate. If
the very first results are API errors before the model has answered once, the env cannot use the
server at all, and the run stops with one line naming --env-llm-url.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import httpx

from ppo_affine.envs.tasks import Task
from ppo_affine.envs.affinetes_env import AffinetesEnv, RemoteCallError
from ppo_affine.envs.tasks import game_name_of
from ppo_affine.adapter_probe import serve_evaluated_adapter
from ppo_affine.generation import VLLMError, VLLMGenerator
from ppo_affine.model_files import served_folder
from ppo_affine.run_log import rollout_progress
from ppo_affine.config import Config, ConfigError

log = logging.getLogger("evaluate")

VALIDATOR_TIMEOUT_S = 1800.0  # what validators pass as evaluate(timeout=...)
DECISION_PROMPT_START = "Current State:"  # every decision's user message starts so (docs/protocols.md, 'The evaluate() conversation'); feedback does not
API_ERROR = "[API_ERROR]"


def _is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def check_reachable(target: str, llm_url: str) -> None:
    """Refuse an LLM URL the env certainly cannot reach: this machine's loopback seen from a container."""
    if not _is_loopback(llm_url):
        return
    if not _is_url(target):
        raise ConfigError(
            f"--env-llm-url {llm_url}: a Docker container cannot reach this machine's loopback address. Pass an "
            "address the container can reach, e.g. --env-llm-url http://172.17.0.1:8000/v1 (the docker0 bridge), "
            "with vLLM listening there (--host 0.0.0.0).")
    if not _is_loopback(target):
        log.warning("the env at %s will call %s: that works only if the env runs on this machine "
                    "(otherwise pass --env-llm-url with an address it can reach)", target, llm_url)


def connect(target: str) -> AffinetesEnv:
    """The env to call: an http(s) URL is a running env server, anything else a Docker image to start."""
    if _is_url(target):
        try:
            return AffinetesEnv(mode="url", base_url=target)
        except (ConnectionError, ValueError) as exc:
            raise ConfigError(f"--env-evaluate {target}: {exc}") from None
    try:
        # a name of its own, so a training run's containers of the same image are left alone
        return AffinetesEnv(mode="docker", image=target,
                            container_prefix=target.split("/")[-1].replace(":", "-") + "-eval")
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--env-evaluate {target}: {exc}") from None


async def _served_models(client: httpx.AsyncClient, url: str) -> list[str]:
    response = await client.get(f"{url.rstrip('/')}/models", timeout=10.0)
    response.raise_for_status()
    return [str(m.get("id")) for m in response.json().get("data", [])]


async def _check_base_model(generator: VLLMGenerator) -> None:
    try:
        served = await _served_models(generator.client, generator.base_url)
    except (httpx.HTTPError, ValueError) as exc:
        raise VLLMError(f"env.vllm_url {generator.base_url}: no vLLM server answers ({type(exc).__name__}: {exc}). "
                        + generator.help_text()) from None
    if generator.base_model not in served:
        raise VLLMError(f"env.vllm_url {generator.base_url} serves {served}, not model.name_or_path="
                        f"{generator.base_model!r}: start vLLM with --served-model-name {generator.base_model}.")


async def _check_env_llm_url(generator: VLLMGenerator, llm_url: str, model: str) -> None:
    """The env's LLM URL serves `model`, when this machine can see it (the env may reach it when we cannot)."""
    try:
        served = await _served_models(generator.client, llm_url)
    except (httpx.HTTPError, ValueError) as exc:
        log.info("--env-llm-url %s does not answer from here (%s); the env may still reach it", llm_url,
                 type(exc).__name__)
        return
    if model not in served:
        raise ConfigError(f"--env-llm-url {llm_url} serves {served}, not {model!r}, which was loaded into "
                          f"env.vllm_url {generator.base_url}: point both at the same vLLM server.")


def env_record(task: Task, model: str, result: dict[str, Any] | None, failure: str | None) -> dict[str, Any]:
    """The episodes.jsonl line of one evaluate() call: evaluate.py's fields, read from the env's result."""
    result = result or {}
    extra = result.get("extra") or {}
    conversation = extra.get("conversation") or []
    error = failure or result.get("error")
    score = float(result.get("score", 0.0))
    # A reply was unusable when the env answered it with feedback instead of the next decision. The
    # env answers the third unusable reply to a decision with feedback too, and the game is lost.
    feedback = [i for i, message in enumerate(conversation)
                if message["role"] == "user" and i > 0 and conversation[i - 1]["role"] == "assistant"
                and not str(message["content"]).startswith(DECISION_PROMPT_START)]
    ends_with_feedback = bool(feedback) and feedback[-1] == len(conversation) - 1
    return {
        "model": model,
        "game": game_name_of(task.task_id),
        "task_id": task.task_id,
        "seed": task.seed,
        "opponent": task.opponent,
        "llm_player_id": extra.get("llm_player_id"),
        "score": 0.0 if error else score,
        "success": False if error else bool(result.get("success", score > 0.5)),
        "outcome": "error" if error else "win" if score > 0.5 else "draw" if score == 0.5 else "loss",
        "turns": sum(message["role"] == "assistant" for message in conversation),
        "illegal_moves": len(feedback),
        "parse_failed_game": not error and ends_with_feedback,
        "generated_tokens": None,  # the env reports only its last call's usage
        "error": error,
        "scored_by": "env_evaluate",
        "conversation": conversation,
    }


class _Play:
    """Plays one model's tasks through the env, stopping the run when the env cannot use the LLM server."""

    def __init__(self, env: AffinetesEnv, call: dict[str, Any], llm_url: str, timeout: float):
        self.env, self.call, self.llm_url, self.timeout = env, call, llm_url, timeout
        self.model_answered = False

    async def one(self, task: Task, label: str) -> dict[str, Any]:
        try:
            result = await self.env.evaluate(timeout=self.timeout, task_id=task.task_id, seed=task.seed,
                                             opponent=task.opponent, **self.call)
        except RemoteCallError as exc:
            return env_record(task, label, None, f"{exc.kind}: {exc.message}")
        conversation = (result.get("extra") or {}).get("conversation") or []
        if any(message.get("role") == "assistant" for message in conversation):
            self.model_answered = True
        error = str(result.get("error") or "")
        if error.startswith(API_ERROR) and not self.model_answered:
            raise ConfigError(f"--env-llm-url {self.llm_url}: the env got no reply from model {self.call['model']!r} "
                              f"there ({error[:300]}). Give a URL the env can reach, of the vLLM server that "
                              "env.vllm_url names.")
        return env_record(task, label, result, None)


async def evaluate_through_env(config: Config, tasks: list[Task], adapter_dir: Path | None, compare_base: bool,
                               target: str, llm_url: str | None, timeout: float, episodes_path: Path | None
                               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every task once per model through the env's evaluate(); (records in task order, settings for summary.json)."""
    cfg = config.train
    llm_url = (llm_url or config.env.vllm_url).rstrip("/")
    api_key = os.environ.get(config.env.vllm_api_key_env) if config.env.vllm_api_key_env else None
    rank = json.loads((adapter_dir / "adapter_config.json").read_text())["r"] if adapter_dir else cfg.lora.r
    # the trainer's vLLM client, for the server checks and the adapter (un)loading only
    generator = VLLMGenerator(config.env.vllm_url, cfg.model.name_or_path, None, cfg.generation, rank, set(),
                              api_key, served_from=served_folder(cfg.model))
    env: AffinetesEnv | None = None
    records: list[dict[str, Any]] = []
    served_names: dict[str, str] = {}
    sink = open(episodes_path, "w") if episodes_path else None
    try:
        check_reachable(target, llm_url)
        await _check_base_model(generator)
        env = connect(target)
        try:
            methods = await env.methods()
        except RemoteCallError as exc:
            raise ConfigError(f"--env-evaluate {target}: cannot list its methods ({exc.message})") from None
        if "evaluate" not in methods:
            raise ConfigError(f"--env-evaluate {target} offers {methods} but no evaluate(): point it at an Affine "
                              "game image or a `python -m ppo_affine.envs.server --env openspiel` server.")
        labels = ["adapter", "base"] if adapter_dir and compare_base else ["adapter"] if adapter_dir else ["base"]
        for label in labels:
            if label == "adapter":
                model = await serve_evaluated_adapter(config, generator, adapter_dir)  # probed before any episode
            else:
                model = cfg.model.name_or_path
            served_names[label] = model
            if llm_url != generator.base_url:
                await _check_env_llm_url(generator, llm_url, model)
            play = _Play(env, {"model": model, "base_url": llm_url, "temperature": cfg.generation.temperature,
                               "api_key": api_key or "EMPTY"}, llm_url, timeout)
            records += await _play_all(play, tasks, label, sink, cfg.generation.max_concurrent_episodes)
    finally:
        if sink:
            sink.close()
        await generator.close()
        if env is not None:
            await env.close()
    settings = {"path": "env_evaluate", "env": target, "llm_url": llm_url, "served_models": served_names,
                "timeout": timeout}
    return records, settings


async def _play_all(play: _Play, tasks: list[Task], label: str, sink, concurrency: int) -> list[dict[str, Any]]:
    """`concurrency` games in flight; records in task order, each appended to `sink` as it finishes."""
    records: list[dict[str, Any] | None] = [None] * len(tasks)
    queue = iter(range(len(tasks)))

    async def worker(advance: Callable[..., None]) -> None:
        for index in queue:
            record = await play.one(tasks[index], label)
            records[index] = record
            if sink:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
            advance()

    with rollout_progress(len(tasks), f"{label}: env evaluate()") as advance:
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(concurrency, len(tasks))):
                    group.create_task(worker(advance))
        except BaseExceptionGroup as failed:  # a setup error cancelled the other games
            setup = [e for e in failed.exceptions if isinstance(e, ConfigError)]
            if setup:
                raise setup[0] from None
            raise
    return [r for r in records if r is not None]
