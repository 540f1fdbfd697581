"""Rollouts: play many episodes concurrently, keeping the exact token ids the policy generated.

Each turn builds the chat messages under a context strategy, turns them into prompt token ids
(`prompts.TokenHistory`: a later turn extends the episode's token sequence by the sampled reply
ids and the template's glue whenever the template allows it), asks a generator
(`generation.py`) for the reply and sends the reply text to the env.

An env of kind `evaluate` plays its own conversation: an episode is one call of its evaluate() against the
trainer's endpoint (endpoint.py), whose recorded calls become the episode's turns and sequences, and whose score
is the episode's.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ppo_affine.envs.tasks import Task
from ppo_affine.endpoint import ChatEndpoint, EndpointUnused, pack_calls
from ppo_affine.envs.base import Env, EpisodeLost, StepResult
from ppo_affine.envs.openspiel_text import strip_think
from ppo_affine.prompts import PromptBuilder, TokenHistory
from ppo_affine.config import GenerationConfig
from ppo_affine.seeds import derive_seed

log = logging.getLogger(__name__)

THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
THINKING_MARKER = "<think>[earlier reasoning omitted]</think>"
# Replays of one episode lost by a server that kept answering (it forgot the episode, or dropped the
# connection); past them the episode fails: a server that keeps losing episodes is broken.
MAX_REPLAYS = 3
# Replays after outages that were waited out (the server was down and came back) do not use up
# MAX_REPLAYS, but are bounded too: a task that brought its server down each time would loop forever.
MAX_OUTAGE_REPLAYS = 10
# more than this share of a step's evaluate() episodes cut off at a limit is warned of
CUT_OFF_WARNING = 0.1


@dataclass
class Turn:
    response_ids: list[int]
    response_text: str
    sampler_logprobs: list[float] | None
    sequence: int = 0  # which of the episode's token sequences holds this turn
    start: int = 0  # position of the reply's first token in that sequence (= prompt length)
    reward: float = 0.0  # non-final env reward earned by this turn (the final score is the episode's)
    parse_error: bool = False
    adapter_step: int | None = None  # the training step whose adapter (vLLM) wrote it; None: the trainer itself


@dataclass
class Episode:
    task: Task
    env_kind: str
    turns: list[Turn] = field(default_factory=list)
    sequences: list[list[int]] = field(default_factory=list)  # token ids; each ends with its last reply
    messages: list[dict[str, str]] = field(default_factory=list)
    score: float = 0.0
    success: bool = False
    done: bool = False
    cut_off: bool = False  # hit generation.max_turns
    error: str | None = None
    replays: int = 0  # times a server lost it and it was played again from the start
    game_name: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    calls: list[Any] = field(default_factory=list)  # an evaluate episode's endpoint calls (endpoint.CallRecord)

    @property
    def generated_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.turns)

    @property
    def illegal_moves(self) -> int:
        return sum(t.parse_error for t in self.turns)

    def prompt_ids(self, turn: Turn) -> list[int]:
        """The exact prompt the model saw for `turn`."""
        return self.sequences[turn.sequence][: turn.start]


def _raise_if_lost(result: StepResult) -> None:
    """An env whose server went away or restarted marks the episode lost (affinetes url/docker mode), and says
    whether that was an outage it waited out."""
    error = result["info"].get("error")
    if isinstance(error, dict) and error.get("episode_lost"):
        raise EpisodeLost(f"the env server lost the episode: {error.get('type')}: {error.get('message')}",
                          outage=bool(error.get("outage")))


# ---------------------------------------------------------------------- context strategies
def build_messages(
    messages: list[dict[str, str]], decision_start: int, strategy: str, turn_prompt: str | None
) -> list[dict[str, str]]:
    """The messages the model sees now. `decision_start` indexes the user message of the pending decision.

    `full` is the conversation validators' LLM client keeps: every earlier reply as it returned it,
    think blocks and surrounding whitespace stripped. Training on the raw replies would teach the
    model a history it never sees when validators play it (from turn 2 on, its reasons are gone)."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    if strategy == "last":
        current = list(messages[decision_start:])
        if turn_prompt:
            current[0] = {"role": "user", "content": turn_prompt}
        return system + current
    if strategy == "truncated":
        return [
            {"role": "assistant", "content": THINK_BLOCK.sub(THINKING_MARKER, m["content"])}
            if m["role"] == "assistant" and i < decision_start
            else m
            for i, m in enumerate(messages)
        ]
    return [{"role": "assistant", "content": _stripped(m["content"])} if m["role"] == "assistant" else m
            for m in messages]


@functools.lru_cache(maxsize=4096)
def _stripped(reply: str) -> str:
    # every turn shows the whole history again: each reply is stripped once, not once per later turn
    return strip_think(reply)


# ---------------------------------------------------------------------- episodes
class RolloutRunner:
    """Plays a batch of tasks concurrently (at most `max_concurrent_episodes` at once).

    `validator_conversation=True` (evaluation) plays the conversation validators' LLM client keeps:
    each reply is sent and stored whitespace- and think-stripped, as their client returns it, and
    every prompt is the chat template rendered afresh over the messages, as an OpenAI chat server
    renders it. Training sends the env what the model wrote and continues each episode's sequence with
    the exact sampled ids while the prompt allows it; under `full` a reply the client would store
    stripped (reasoning, surrounding whitespace) starts a new sequence, rendered as validators show it, that keeps
    the sampled ids of the history before that reply (prompts.TokenHistory)."""

    def __init__(self, envs: dict[str, tuple[str, Env]], generator, prompt_builder: PromptBuilder,
                 gen_cfg: GenerationConfig, validator_conversation: bool = False, endpoint: ChatEndpoint | None = None,
                 evaluate_kwargs: dict[str, dict[str, Any]] | None = None):
        """`endpoint` serves the envs of kind `evaluate` (built on `generator`), `evaluate_kwargs` their further
        evaluate() arguments by env name."""
        self.envs = envs  # name -> (kind, env)
        self.generator = generator
        self.prompts = prompt_builder
        self.cfg = gen_cfg
        self.validator_conversation = validator_conversation
        self.endpoint = endpoint
        self.evaluate_kwargs = evaluate_kwargs or {}
        self._checked_evaluate = False
        self._warned_cut_off: set[str] = set()

    async def run(self, tasks: list[Task], step: int, on_episode_done: Callable[[Episode], None] | None = None,
                  first_index: int = 0) -> list[Episode]:
        """Play every task; at most `max_concurrent_episodes` live at once, results in task order.
        `first_index` is the first task's place in the whole step's batch (this rank's share starts
        there): episodes draw their seeds and pick their vLLM server by their place in the batch."""
        if self.endpoint is not None:
            await self.endpoint.start()
            await self._check_evaluate_envs()
        rollout = getattr(self.generator, "rollout", None)
        async with (rollout(step) if rollout else contextlib.nullcontext()):
            episodes = await self._run(tasks, step, on_episode_done, first_index)
        self._check_harnessed(episodes)
        return episodes

    def _check_harnessed(self, episodes: list[Episode]) -> None:
        """A step in which no `evaluate` episode called the endpoint stops the run (the env is misconfigured); more
        than CUT_OFF_WARNING of them cut off at a limit is warned of, once per limit."""
        harnessed = [e for e in episodes if e.env_kind == "evaluate"]
        if not harnessed:
            return
        if all(e.info.get("fault") == "unused" for e in harnessed):
            raise EndpointUnused(f"no evaluate() episode of this step called the trainer's endpoint ({len(harnessed)} "
                                 f"returned a score without a call); first: {harnessed[0].error}")
        for limit in ("context", "max_turns"):
            share = sum(e.info.get("cut_off") == limit for e in harnessed) / len(harnessed)
            if share > CUT_OFF_WARNING and limit not in self._warned_cut_off:
                self._warned_cut_off.add(limit)
                setting = ("generation.max_prompt_tokens" if limit == "context" else "generation.max_turns")
                log.warning("%.0f%% of this step's evaluate() episodes were cut off at the %s limit (%s) and are not "
                            "trained on; raise %s if the validators' server allows more", 100 * share, limit,
                            f"{setting}={getattr(self.cfg, setting.split('.')[1])}", setting)

    async def _run(self, tasks: list[Task], step: int, on_episode_done: Callable[[Episode], None] | None,
                   first_index: int) -> list[Episode]:
        episodes: list[Episode | None] = [None] * len(tasks)
        queue = iter(range(len(tasks)))
        started = getattr(self.generator, "episode_started", lambda: None)
        finished = getattr(self.generator, "episode_finished", lambda key: None)

        async def worker() -> None:
            index = next(queue, None)
            if index is not None:
                started()
            while index is not None:
                episode = await self.play_to_the_end(first_index + index, tasks[index], step)
                episodes[index] = episode
                # admit the next episode before retiring this one, with no await in between, so the
                # set of live episodes at every generation wave depends only on what was generated
                done_index, index = index, next(queue, None)
                if index is not None:
                    started()
                finished(first_index + done_index)
                if on_episode_done:
                    on_episode_done(episode)

        workers = min(self.cfg.max_concurrent_episodes, len(tasks))
        await asyncio.gather(*(worker() for _ in range(workers)))
        return [e for e in episodes if e is not None]

    async def play_to_the_end(self, index: int, task: Task, step: int) -> Episode:
        """`play`, replayed from its start (same task and seed) when a server lost the episode: at most
        MAX_REPLAYS times by a server that kept answering, MAX_OUTAGE_REPLAYS times in outages."""
        lost = lost_in_outages = 0

        def replays_left() -> bool:
            return lost <= MAX_REPLAYS and lost_in_outages <= MAX_OUTAGE_REPLAYS

        while replays_left():
            try:
                episode = await self.play(index, task, step)
            except EpisodeLost as exc:
                lost_in_outages += exc.outage
                lost += not exc.outage
                log.warning("episode %s (task %s) lost (%s); %s", index, task.task_id, exc,
                            "replaying it" if replays_left() else "giving up")
                continue
            episode.replays = lost + lost_in_outages
            return episode
        error = (f"EpisodeLost: lost {lost} times by a server that keeps losing episodes" if lost > MAX_REPLAYS else
                 f"EpisodeLost: lost in {lost_in_outages} outages of its server (does this task bring it down?)")
        return Episode(task=task, env_kind=self.envs[task.env][0], replays=lost + lost_in_outages - 1, error=error)

    async def play(self, index: int, task: Task, step: int) -> Episode:
        """One episode; raises EpisodeLost when a server lost it (the caller replays it)."""
        kind, env = self.envs[task.env]
        if kind == "evaluate":
            return await self.play_through_evaluate(index, task, step)
        episode = Episode(task=task, env_kind=kind)
        history = TokenHistory(self.prompts, self.generator.eos_ids, continue_sequences=not self.validator_conversation)
        episode.sequences = history.sequences
        episode_id = None
        try:
            kwargs = {"opponent": task.opponent} if kind == "openspiel" and task.opponent else {}
            result = await env.reset(task_id=task.task_id, seed=task.seed, **kwargs)
            _raise_if_lost(result)
            episode_id = result["episode_id"]
            self._absorb(episode, result)
            if result["done"]:
                self._finish(episode, result)
                return episode
            system = result["info"].get("system_prompt")
            if system:
                episode.messages.append({"role": "system", "content": system})
            episode.messages.append({"role": "user", "content": result["observation"]})
            decision_start = len(episode.messages) - 1
            while not result["done"]:
                if len(episode.turns) >= self.cfg.max_turns:
                    episode.cut_off = True
                    break
                shown = build_messages(episode.messages, decision_start, self.cfg.context_strategy,
                                       result["info"].get("turn_prompt"))
                # full/truncated may drop turns before the pending decision; `last` has nothing to drop
                keep_from = decision_start if self.cfg.context_strategy != "last" else int(bool(system))
                prompt = history.prompt(shown, keep_from)
                if prompt is None:
                    episode.error = (f"prompt longer than generation.max_prompt_tokens="
                                     f"{self.prompts.max_prompt_tokens} even after dropping earlier turns")
                    break
                prompt_ids, sequence, start = prompt
                seed = derive_seed(task.seed, task.task_id, step, index, len(episode.turns))
                generation = await self.generator.generate(prompt_ids, order_key=index, seed=seed)
                text = self.prompts.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
                history.add_reply(generation.token_ids, text)
                if self.validator_conversation:
                    text = strip_think(text)
                result = await env.step(text, episode_id)
                _raise_if_lost(result)
                parse_error = bool(result["info"].get("parse_error"))
                episode.turns.append(Turn(
                    response_ids=generation.token_ids, response_text=text, sampler_logprobs=generation.logprobs,
                    sequence=sequence, start=start, parse_error=parse_error,
                    reward=0.0 if result["done"] else float(result["reward"]), adapter_step=generation.adapter_step,
                ))
                episode.messages.append({"role": "assistant", "content": text})
                self._absorb(episode, result)
                if not result["done"]:
                    episode.messages.append({"role": "user", "content": result["observation"]})
                    if not parse_error:
                        decision_start = len(episode.messages) - 1
            if result["done"]:
                self._finish(episode, result)
        except (asyncio.CancelledError, EpisodeLost):
            raise
        except Exception as exc:  # an env or generator failure fails this episode, not the run
            episode.error = f"{type(exc).__name__}: {exc}"
            log.warning("episode %s (task %s) failed: %s", index, task.task_id, episode.error)
        finally:
            if episode_id is not None and not episode.done:
                try:
                    await env.stop(episode_id)
                except Exception as exc:
                    log.warning("stop(%s) failed: %s", episode_id, exc)
        return episode

    async def _check_evaluate_envs(self) -> None:
        """Every env of kind `evaluate` offers evaluate() (asked once)."""
        if self._checked_evaluate:
            return
        from ppo_affine.config import ConfigError
        from ppo_affine.envs.affinetes_env import RemoteCallError

        for name, (kind, env) in self.envs.items():
            if kind != "evaluate":
                continue
            try:
                methods = await env.methods()
            except RemoteCallError as exc:
                raise ConfigError(f"env {name!r} (kind evaluate): cannot list its methods ({exc.message})") from None
            if "evaluate" not in methods:
                raise ConfigError(f"env {name!r} is of kind 'evaluate' but offers {sorted(methods)}, no evaluate()")
        self._checked_evaluate = True

    async def play_through_evaluate(self, index: int, task: Task, step: int) -> Episode:
        """One episode of an env of kind `evaluate`: one evaluate() call whose endpoint calls are the turns. A call
        that fails (timeout, exception, no score, an `error` in its result) fails the episode with the reason in
        `error` and `info["fault"]`, as does a scored result without a single endpoint call ("unused"); a call the
        endpoint refused at a limit (context, generation.max_turns) cuts the episode off (`info["cut_off"]`)."""
        from ppo_affine.envs.affinetes_env import RemoteCallError

        kind, env = self.envs[task.env]
        episode = Episode(task=task, env_kind=kind, game_name=task.env)
        door = self.endpoint.open_episode(index, (task.seed, task.task_id, step, index))
        result, fault = None, None
        try:
            result = await env.evaluate(timeout=env.call_timeout, task_id=task.task_id, seed=task.seed,
                                        model=self.endpoint.model_name, base_url=door.url, api_key="EMPTY",
                                        temperature=self.cfg.temperature, **self.evaluate_kwargs.get(task.env, {}))
            if result.get("error"):
                fault = ("error", str(result["error"])[:500])
        except RemoteCallError as exc:
            fault = (exc.kind, exc.message)
        finally:
            calls = self.endpoint.close_episode(door)
        episode.sequences, placements, breaks = pack_calls(calls)
        episode.calls = calls
        episode.turns = [Turn(response_ids=call.token_ids, response_text=call.text, sampler_logprobs=call.logprobs,
                              sequence=sequence, start=start, adapter_step=call.adapter_step)
                         for call, (sequence, start) in zip(calls, placements)]
        episode.info = {"evaluate_result": result, "prefix_breaks": breaks, "calls": len(calls)}
        if door.cut_off is not None:  # the endpoint refused a call at a limit: whatever the harness made of it
            episode.cut_off = True  # (a score, an error), the episode is cut off, neither a failure nor a score
            episode.info["cut_off"] = door.cut_off
            if fault is not None:
                episode.info["harness_said"] = f"{fault[0]}: {fault[1]}"
            return episode
        if fault is not None:
            episode.info["fault"] = fault[0]
            episode.error = f"evaluate() of env {task.env!r} failed: {fault[0]}: {fault[1]}"
            log.warning("episode %s (task %s) dropped: %s", index, task.task_id, episode.error)
            return episode
        if not calls:  # it talks to another model: this episode is dropped; a step of only such stops the run
            episode.info["fault"] = "unused"
            episode.error = (f"env {task.env!r}: evaluate() returned a score without calling the trainer's "
                             f"endpoint at {door.url}: it must send its requests to the base_url (and model) it "
                             "is given, or the run learns nothing from it")
            log.warning("episode %s (task %s) dropped: %s", index, task.task_id, episode.error)
            return episode
        conversation = (result.get("extra") or {}).get("conversation")
        episode.messages = conversation if isinstance(conversation, list) else []
        episode.done = True
        episode.score = float(result["score"])
        episode.success = bool(result.get("success", episode.score > 0.5))
        return episode

    @staticmethod
    def _absorb(episode: Episode, result: StepResult) -> None:
        info = result["info"]
        episode.info = info
        episode.game_name = info.get("game_name") or episode.game_name or episode.env_kind
        if info.get("error") and result["done"] and result.get("truncated"):
            error = info["error"]
            episode.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)

    @staticmethod
    def _finish(episode: Episode, result: StepResult) -> None:
        info = result["info"]
        episode.done = True
        episode.score = float(info.get("score", result["reward"]))
        episode.success = bool(info.get("success", episode.score > 0.5))
