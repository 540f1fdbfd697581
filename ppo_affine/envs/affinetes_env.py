"""Env backend over affinetes: the real Affine images in Docker (`docker` mode) or env servers by URL (`url`).

- Episodes are pinned to the instance that served their reset. affinetes routes each call of a
  multi-replica env to a random replica and the remote keeps an episode in one process's memory
  (docs/protocols.md, 'Loading an env and its modes' and 'What an Actor must provide'), so we hold
  one affinetes env per replica or URL instead.
  A reset goes to the instance with the fewest live episodes, skipping for 30 s one whose call
  just failed transiently (a dead server would otherwise cost every reset a retry).
- Nothing raises into the training loop. A call that cannot complete ends its episode with a
  StepResult (done, truncated, score 0, `info.error = {type, message, retryable}`), logs one line
  and bumps a cumulative counter in `error_counts()`.
- Every call is bounded by `call_timeout` (affinetes sets no read timeout). Transient failures
  (connect errors, timeouts, dropped connections, HTTP 429/5xx) are retried with exponential
  backoff and jitter: `reset` and `state` always (a repeated reset only starts a fresh episode;
  at worst an unused one is left on a server), `step` only when the request provably never reached
  the server (the connection could not be opened). A step whose reply was lost may already have
  been applied, and sending it again would play a second move, so it fails the episode instead.
- A failure that means the server lost the episode (it could not be reached, the connection
  dropped, or it answers `episode_not_found` after a restart) is marked `info.error.episode_lost`:
  the rollout replays such an episode from its start with the same task and seed.
- A server that went away (connections refused or dropped once the retries are spent) is waited
  for, like a vLLM server: its /health (docker mode: its method listing) is polled with backoff, a
  line is logged once a minute, and every call that failed on it shares the one wait. Back within
  `server_wait_seconds` after having been down, its episodes are lost in an outage
  (`info.error.outage`): replayed, not counted as failed. Not back, they fail, and so does every
  later call to that server, at once.
- Remote episodes are stopped here once they are done or failed (the training loop does not stop
  finished episodes), so servers do not accumulate them.
- The real Affine images answer with their own `info` (no prompts, no score until done); it is
  mapped to the keys the trainer reads (ppo_affine/envs/base.py). Our own `python -m ppo_affine.envs.server` already
  sends those keys (`turn_prompt` marks them) and is passed through unchanged.
- Outside the Env interface, `evaluate()` makes the validators' call: the remote env plays a whole
  game against an LLM endpoint and returns its score (evaluate.py --env-evaluate). Unlike the
  episode calls it raises RemoteCallError, and it is sent again only if it never reached a server.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from ppo_affine.envs.base import StepResult, step_result

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
SUSPECT_S = 30.0  # after a transient failure, an instance gets new episodes only if no other can
STOP_TIMEOUT_S = 10.0  # stop is best-effort clean-up: never wait on it as long as on a move
EVALUATE_GRACE_S = 60.0  # evaluate(timeout=T) ends itself by T (the template server by T + 10 s)
GAME_SUCCESS_ABOVE = 0.5  # Affine game scores: loss 0, draw 0.5, win 1
TRACE_SUCCESS_ABOVE = 0.0
SERVER_HINT = ("start one with `python -m ppo_affine.envs.server --env openspiel --host 0.0.0.0 --port 8765` "
               "(see docs/affinetes.md) or fix the env's `url`")

# failure kind -> error_counts() key; a kind is also the `info.error.type` of the failed episode
_COUNTER_OF_KIND = {
    "timeout": "timeouts",
    "connection_error": "connection_errors",
    "transport_error": "transport_errors",
    "http_error": "http_errors",
    "malformed_response": "malformed_responses",
    "remote_error": "remote_errors",
}
_COUNTERS = (*_COUNTER_OF_KIND.values(), "retries", "failed_episodes", "stop_errors", "outages")
# Failures that mean the server went away or restarted: the episode is gone, not broken.
_LOST_KINDS = ("connection_error", "transport_error", "episode_not_found")
# Failures after which the server is waited for: it may be down (or restarting).
_AWAY_KINDS = ("connection_error", "transport_error")
POLL_BACKOFF_S = (1.0, 30.0)  # the first and the longest pause between polls of a server that went away


class RemoteCallError(Exception):
    """One failed call. `delivered`: the request may have reached the server (a step may be applied)."""

    def __init__(self, kind: str, message: str, retryable: bool, delivered: bool = True):
        super().__init__(message)
        self.kind, self.message, self.retryable, self.delivered = kind, message, retryable, delivered


@dataclass
class _Instance:
    name: str  # URL or container name, for messages
    client: Any  # affinetes EnvironmentWrapper
    url: str | None = None  # url mode: the server's base URL
    live_episodes: int = 0
    suspect_until: float = 0.0  # monotonic time; new episodes go elsewhere until then
    recovery: asyncio.Task | None = None  # the wait for it to answer again, shared by every call that failed on it
    gone: str | None = None  # why it was given up (not back within server_wait_seconds): later calls fail at once


@dataclass
class _Episode:
    instance: _Instance
    turn_prompt: str | None  # the pending decision's prompt, kept across invalid actions


class AffinetesEnv:
    """The Env interface (ppo_affine/envs/base.py) over `affinetes.load_env`, in docker or url mode.

    mode: "docker" starts `replicas` containers of `image` (one affinetes env each, with `env_vars`);
    "url" connects to `base_url`, one URL or a list of them (one per server).
    call_timeout: seconds per remote call. max_retries: retries of a transient failure.
    backoff_base: seconds before the first retry, doubled per retry (jittered, at most 30 s).
    connect_timeout: seconds for the start-up health check of each URL.
    server_wait_seconds: how long a server that went away is waited for (0: given up at once).
    container_prefix: docker mode: containers are named <prefix>-r0, -r1, ... (default: from the image
    name, e.g. game-openspiel), so two programs using one image on one host need different prefixes.
    hosts: docker mode: the Docker host of each replica, in affinetes' form ("localhost", "ssh://user@host"); None:
    all on this machine.
    """

    def __init__(self, mode: str, base_url: str | list[str] | None = None, image: str | None = None,
                 env_vars: dict[str, str] | None = None, replicas: int = 1, call_timeout: float = 120.0,
                 max_retries: int = 3, backoff_base: float = 0.5, connect_timeout: float = 10.0,
                 container_prefix: str | None = None, server_wait_seconds: float = 900.0,
                 hosts: list[str] | None = None):
        if mode not in ("docker", "url"):
            raise ValueError(f"AffinetesEnv mode must be 'docker' or 'url', got {mode!r}")
        if (replicas < 1 or call_timeout <= 0 or max_retries < 0 or backoff_base < 0 or connect_timeout <= 0
                or server_wait_seconds < 0):
            raise ValueError("AffinetesEnv needs replicas >= 1, call_timeout > 0, max_retries >= 0, "
                             "backoff_base >= 0, connect_timeout > 0 and server_wait_seconds >= 0; got "
                             f"replicas={replicas}, call_timeout={call_timeout}, max_retries={max_retries}, "
                             f"backoff_base={backoff_base}, connect_timeout={connect_timeout}, "
                             f"server_wait_seconds={server_wait_seconds}")
        self.call_timeout = call_timeout
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.server_wait_seconds = server_wait_seconds
        # Jitter only spreads retries in time and never changes a result, so it is not seeded
        # (equal seeds would make data-parallel ranks retry in lock-step).
        self._jitter = random.Random()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._episodes: dict[str, _Episode] = {}
        self._next_instance = 0
        self._closed = False
        if mode == "url":
            self._instances = _connect_urls(base_url, replicas, connect_timeout)
        else:
            self._instances = _start_containers(image, env_vars, replicas, container_prefix, hosts)

    # ------------------------------------------------------------------ the Env interface
    async def reset(self, task_id: int | None = None, seed: int | None = None, **kwargs: Any) -> StepResult:
        """Start an episode on the least busy instance; transient failures retry, on another one if any."""
        if self._closed:
            return self._failed(None, "reset", RemoteCallError("closed", "the env is closed", retryable=False))
        tried: set[int] = set()
        picked: list[_Instance] = []

        def pick() -> _Instance:
            picked.append(self._pick_instance(tried))
            return picked[-1]

        outages = self._counts["outages"]
        try:
            instance, result = await self._call_retrying(
                "reset", pick, _transient, task_id=task_id, seed=seed, **kwargs)
        except RemoteCallError as error:
            return await self._failed_call(None, "reset", picked[-1], error, outages)
        episode_id = result["episode_id"]
        if episode_id is None and not result["done"]:
            self._counts["malformed_responses"] += 1
            return self._failed(None, "reset", RemoteCallError(
                "malformed_response", "reset returned no episode_id for a live episode", retryable=False))
        episode = _Episode(instance, turn_prompt=None)
        if episode_id is not None:
            self._episodes[episode_id] = episode
            instance.live_episodes += 1
        return await self._finish_call("reset", episode_id, episode, result)

    async def step(self, action: str, episode_id: str) -> StepResult:
        """Send one action; retried only if it cannot have reached the server (see the module docstring)."""
        episode = self._episodes.get(episode_id)
        if episode is None:
            return self._failed(episode_id, "step", RemoteCallError(
                "unknown_episode", f"episode {episode_id!r} is not live in this env (never reset, done or failed)",
                retryable=False))
        outages = self._counts["outages"]
        try:
            _, result = await self._call_retrying("step", lambda: episode.instance, _undelivered,
                                                  action=action, episode_id=episode_id)
        except RemoteCallError as error:
            failed = await self._failed_call(episode_id, "step", episode.instance, error, outages)
            await self._release(episode_id, stop_remote=error.delivered and episode.instance.gone is None)
            return failed
        return await self._finish_call("step", episode_id, episode, result)

    async def state(self, episode_id: str) -> StepResult:
        """The episode's current observation (no transition); retried like reset since it changes nothing."""
        episode = self._episodes.get(episode_id)
        if episode is None:
            return self._failed(episode_id, "state", RemoteCallError(
                "unknown_episode", f"episode {episode_id!r} is not live in this env", retryable=False))
        outages = self._counts["outages"]
        try:
            _, result = await self._call_retrying("state", lambda: episode.instance, _transient, episode_id=episode_id)
        except RemoteCallError as error:
            failed = await self._failed_call(episode_id, "state", episode.instance, error, outages)
            await self._release(episode_id, stop_remote=error.delivered and episode.instance.gone is None)
            return failed
        return self._translate(result, episode, remember=False)

    async def stop(self, episode_id: str) -> dict[str, Any]:
        """Release the episode here and on its server (best-effort, one short call, never raises)."""
        if episode_id not in self._episodes:
            return {"status": "ok", "stopped": False, "episode_id": episode_id,
                    "message": "not live in this env (never reset, done or failed)"}
        return await self._release(episode_id, stop_remote=True)

    async def close(self) -> None:
        """Stop live episodes, then close every affinetes env (stops containers). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for instance in self._instances:
            if instance.recovery is not None:
                instance.recovery.cancel()
        try:
            await asyncio.gather(*(self._release(eid, stop_remote=True) for eid in list(self._episodes)))
        finally:
            # cleanup() of affinetes logs and swallows its own errors; it runs even after a Ctrl-C
            # cancelled the stops above.
            from affinetes.core import get_registry

            registry = get_registry()
            for instance in self._instances:
                await instance.client.cleanup()
                # affinetes' exit hook would clean it a second time (a removed container, a closed stream)
                if registry.get(instance.client.name) is instance.client:
                    registry.unregister(instance.client.name)

    def error_counts(self) -> dict[str, int]:
        """Cumulative counters since start: failures by kind, retries, failed episodes, failed stops."""
        return dict(self._counts)

    # ------------------------------------------------------------------ the env's own evaluate()
    async def methods(self) -> list[str]:
        """The method names the remote env offers (its GET /methods listing; the first instance's)."""
        instance = self._instances[0]
        try:
            listing = await asyncio.wait_for(instance.client.list_methods(print_info=False), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RemoteCallError("timeout", f"list_methods on {instance.name}: no reply within {STOP_TIMEOUT_S:g}s",
                                  retryable=True) from None
        except Exception as exc:
            raise _classify(exc, f"list_methods on {instance.name}") from exc
        return [m.get("name") if isinstance(m, dict) else str(m) for m in listing]

    async def evaluate(self, timeout: float, **kwargs: Any) -> dict[str, Any]:
        """One whole game through the remote env's `evaluate(timeout=..., **kwargs)`, the validators'
        call, on the least busy instance; returns its result dict or raises RemoteCallError.

        The env enforces `timeout` itself; the reply is awaited EVALUATE_GRACE_S longer. Only a call
        that never reached a server is sent again: a repeated evaluate would replay a whole game."""
        tried: set[int] = set()
        busy: _Instance | None = None  # counted as a live episode while its game runs

        def pick() -> _Instance:
            nonlocal busy
            if busy is not None:
                busy.live_episodes -= 1
            busy = self._pick_instance(tried)
            busy.live_episodes += 1
            return busy

        try:
            _, result = await self._call_retrying(
                "evaluate", pick, _undelivered, reply_check=_evaluate_result, call_timeout=timeout + EVALUATE_GRACE_S,
                timeout=timeout, **kwargs)
        finally:
            if busy is not None:
                busy.live_episodes -= 1
        return result

    # ------------------------------------------------------------------ calls and failures
    async def _call(self, instance: _Instance, method: str, reply_check: Callable[[Any, str], Any] | None = None,
                    call_timeout: float | None = None, **kwargs: Any) -> Any:
        """One remote call, bounded by call_timeout (the env's unless given); its reply checked by
        `reply_check` (default: an OpenEnv StepResult)."""
        call_timeout = call_timeout or self.call_timeout
        if instance.gone is not None:
            raise RemoteCallError("server_gone", instance.gone, retryable=False, delivered=False)
        try:
            reply = await asyncio.wait_for(getattr(instance.client, method)(**kwargs), call_timeout)
        except asyncio.TimeoutError:
            error = RemoteCallError("timeout", f"{method} on {instance.name}: no reply within {call_timeout:g}s",
                                    retryable=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = _classify(exc, f"{method} on {instance.name}")
        else:
            try:
                result = (reply_check or _validated)(reply, method)
            except RemoteCallError as malformed:
                error = malformed
            else:
                instance.suspect_until = 0.0
                return result
        if error.retryable:
            instance.suspect_until = time.monotonic() + SUSPECT_S
        self._counts[_COUNTER_OF_KIND[error.kind]] += 1
        raise error

    async def _call_retrying(self, method: str, pick: Callable[[], _Instance],
                             may_retry: Callable[[RemoteCallError], bool],
                             **kwargs: Any) -> tuple[_Instance, StepResult]:
        """`_call` on the instance `pick` gives, again after a backoff while `may_retry` allows it."""
        attempt = 0
        while True:
            instance = pick()
            try:
                return instance, await self._call(instance, method, **kwargs)
            except RemoteCallError as error:
                if attempt == self.max_retries or not may_retry(error):
                    raise
            await self._backoff(attempt)
            attempt += 1

    async def _backoff(self, attempt: int) -> None:
        self._counts["retries"] += 1
        delay = min(MAX_BACKOFF_S, self.backoff_base * 2 ** attempt)
        await asyncio.sleep(delay * (0.5 + self._jitter.random()))

    def _pick_instance(self, tried: set[int]) -> _Instance:
        """An instance not yet tried for this reset (added to `tried`): not given up, then not suspect (nor
        waited for), then fewest live episodes; ties rotate."""
        fresh = [i for i in self._instances if id(i) not in tried] or self._instances
        start = self._next_instance % len(fresh)
        self._next_instance += 1
        now = time.monotonic()

        def preference(instance: _Instance) -> tuple[bool, bool, int]:
            waited_for = instance.recovery is not None and not instance.recovery.done()
            return instance.gone is not None, instance.suspect_until > now or waited_for, instance.live_episodes

        chosen = min(fresh[start:] + fresh[:start], key=preference)
        tried.add(id(chosen))
        return chosen

    async def _finish_call(self, method: str, episode_id: str | None, episode: _Episode, result: StepResult
                           ) -> StepResult:
        """Translate a valid reply; count a remote-reported failure; release the episode once it is over."""
        translated = self._translate(result, episode, remember=True)
        error = translated["info"].get("error")
        if translated["done"] and translated["truncated"] and error:
            if isinstance(error, dict) and error.get("type") in _LOST_KINDS:  # a restarted server forgot it
                translated["info"]["error"] = {**error, "episode_lost": True}
            self._counts["remote_errors"] += 1
            self._counts["failed_episodes"] += 1
            self._log_failure(episode_id, f"{method} on {episode.instance.name}", error)
        if translated["done"] and episode_id is not None:
            await self._release(episode_id, stop_remote=True)
        return translated

    async def _release(self, episode_id: str, stop_remote: bool) -> dict[str, Any]:
        episode = self._episodes.pop(episode_id, None)
        if episode is None:
            return {"status": "ok", "stopped": False, "episode_id": episode_id}
        episode.instance.live_episodes -= 1
        if not stop_remote:
            return {"status": "ok", "stopped": False, "episode_id": episode_id,
                    "message": "server unreachable; not stopped there"}
        timeout = min(self.call_timeout, STOP_TIMEOUT_S)
        try:
            reply = await asyncio.wait_for(episode.instance.client.stop(episode_id=episode_id), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._counts["stop_errors"] += 1
            message = "no reply" if isinstance(exc, asyncio.TimeoutError) else _short(exc)
            log.debug("stop(%s) on %s failed: %s", episode_id, episode.instance.name, message)
            return {"status": "error", "stopped": False, "episode_id": episode_id, "message": message}
        return reply if isinstance(reply, dict) else {"status": "ok", "stopped": True, "episode_id": episode_id}

    async def _failed_call(self, episode_id: str | None, method: str, instance: _Instance, error: RemoteCallError,
                           outages_before: int) -> StepResult:
        """The result that ends an episode whose call on `instance` failed. A server that went away is waited for
        first: its episode was lost in an outage when the server had been down (by this wait or another one since
        the call began), lost when it answers at once (a dropped connection), failed when it is given up."""
        if error.kind not in _AWAY_KINDS:
            return self._failed(episode_id, method, error)
        try:
            was_down = await self._wait_for(instance, error.message)
        except RemoteCallError as gone:
            return self._failed(episode_id, method, gone)
        return self._failed(episode_id, method, error, outage=was_down or self._counts["outages"] != outages_before)

    async def _wait_for(self, instance: _Instance, failure: str) -> bool:
        """Wait until `instance` answers again, in one wait shared by every call that failed on it; True when it had
        been down. RemoteCallError when it is given up (not back within server_wait_seconds), now and later."""
        if instance.gone is None:
            if instance.recovery is None or instance.recovery.done():
                instance.recovery = asyncio.ensure_future(self._wait_until_answering(instance, failure))
            was_down = await asyncio.shield(instance.recovery)
        if instance.gone is not None:
            raise RemoteCallError("server_gone", instance.gone, retryable=False, delivered=False)
        return was_down

    async def _wait_until_answering(self, instance: _Instance, failure: str) -> bool:
        """Poll the server with backoff until it answers (True if it did not at first), logging once a minute;
        past server_wait_seconds mark it gone."""
        started = time.monotonic()
        deadline = started + self.server_wait_seconds
        next_log, delay, was_down = started, POLL_BACKOFF_S[0], False
        while not await self._answers(instance):
            was_down = True
            now = time.monotonic()
            if now >= deadline:
                instance.gone = (f"the env server {instance.name} stopped answering ({failure}) and was not back "
                                 f"within server_wait_seconds={self.server_wait_seconds:g} (env_config.json: "
                                 "envs.NAME.server_wait_seconds): restart it, then continue with --resume latest")
                log.warning("%s", instance.gone)
                return True
            if now >= next_log:
                log.warning("env server %s is not answering (%s); waited %.0f s of server_wait_seconds=%g",
                            instance.name, failure, now - started, self.server_wait_seconds)
                next_log = now + 60.0
            await asyncio.sleep(min(delay, deadline - now))
            delay = min(delay * 2, POLL_BACKOFF_S[1])
        if was_down:
            self._counts["outages"] += 1
            log.warning("env server %s answers again after %.0f s", instance.name, time.monotonic() - started)
        return was_down

    async def _answers(self, instance: _Instance) -> bool:
        """Whether the server answers within a short timeout: its GET /health in url mode; in docker mode its method
        listing, which affinetes returns empty when the container does not answer (a live env has methods)."""
        timeout = min(self.call_timeout, STOP_TIMEOUT_S)
        try:
            if instance.url is not None:
                async with httpx.AsyncClient(timeout=timeout) as client:
                    return (await client.get(f"{instance.url}/health")).status_code == 200
            return bool(await asyncio.wait_for(instance.client.list_methods(print_info=False), timeout))
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    def _failed(self, episode_id: str | None, method: str, error: RemoteCallError, outage: bool = False
                ) -> StepResult:
        """The result that ends an episode the env could not continue; one lost in an outage of its server
        (replayed by the rollout) is not counted as failed."""
        if not outage:
            self._counts["failed_episodes"] += 1
        info_error = {"type": error.kind, "message": error.message, "retryable": error.retryable,
                      "episode_lost": outage or error.kind in _LOST_KINDS, "outage": outage}
        self._log_failure(episode_id, method, info_error)
        return step_result("", done=True, truncated=True, episode_id=episode_id, info={
            "error": info_error, "score": 0.0, "success": False, "parse_error": False,
            "system_prompt": None, "turn_prompt": None,
        })

    def _log_failure(self, episode_id: str | None, where: str, error: dict[str, Any]) -> None:
        log.warning("affinetes episode %s failed (%s): %s: %s", episode_id, where, error.get("type"),
                    error.get("message"))

    def _translate(self, result: StepResult, episode: _Episode, remember: bool) -> StepResult:
        """Map the real Affine envs' info to the trainer's keys; pass our own server's info through."""
        info = result["info"]
        if "turn_prompt" in info:
            return result
        error = info.get("error") if isinstance(info.get("error"), dict) else None
        parse_error = bool(error and error.get("type") == "invalid_action")
        # An invalid action leaves the decision pending; the new observation adds feedback to it.
        turn_prompt = episode.turn_prompt if parse_error and episode.turn_prompt else result["observation"]
        if remember:
            episode.turn_prompt = turn_prompt
        info = {**info, "system_prompt": None, "turn_prompt": turn_prompt, "parse_error": parse_error}
        if result["done"]:
            failed = bool(result["truncated"] and error)
            score = 0.0 if failed else result["reward"]
            threshold = GAME_SUCCESS_ABOVE if "game_name" in info else TRACE_SUCCESS_ABOVE
            info.update(score=score, success=score > threshold)
        return {**result, "info": info}


# ---------------------------------------------------------------------- module helpers
def _transient(error: RemoteCallError) -> bool:
    return error.retryable


def _undelivered(error: RemoteCallError) -> bool:
    """Safe to send again even when not idempotent: the request never reached the server."""
    return not error.delivered


def _validated(reply: Any, method: str) -> StepResult:
    """The reply as a StepResult, or a malformed_response error naming what is wrong."""
    problem = None
    if not isinstance(reply, dict):
        problem = f"expected a JSON object, got {type(reply).__name__}"
    else:
        expected = {"observation": (str,), "reward": (int, float), "done": (bool,), "truncated": (bool,),
                    "episode_id": (str, type(None)), "info": (dict,)}
        for field, types in expected.items():
            if field not in reply:
                problem = f"missing field {field!r}"
            # bool is an int: a boolean reward is a wrong type, not a number
            elif not isinstance(reply[field], types) or (field == "reward" and isinstance(reply[field], bool)):
                problem = f"field {field!r} is {type(reply[field]).__name__}"
            if problem:
                break
    if problem:
        raise RemoteCallError("malformed_response", f"{method} reply is not an OpenEnv response: {problem}",
                              retryable=False)
    return step_result(reply["observation"], reply["reward"], reply["done"], reply["truncated"],
                       reply["episode_id"], reply["info"])


def _evaluate_result(reply: Any, method: str) -> dict[str, Any]:
    """An evaluate() reply: a JSON object with a numeric score, else malformed_response
    (docs/protocols.md, 'The evaluate() call and its result')."""
    score = reply.get("score") if isinstance(reply, dict) else None
    if not isinstance(score, (int, float)) or isinstance(score, bool):
        shown = f"score {score!r}" if isinstance(reply, dict) else type(reply).__name__
        raise RemoteCallError("malformed_response", f"{method} reply is not an evaluate() result ({shown})",
                              retryable=False)
    return reply


def _classify(exc: BaseException, what: str) -> RemoteCallError:
    """What a failed affinetes call means, read from the httpx/JSON error it wraps."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, httpx.HTTPStatusError):
            code = cause.response.status_code
            return RemoteCallError("http_error", f"{what}: HTTP {code}: {cause.response.text[:300]}",
                                   retryable=code == 429 or code >= 500)
        if isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
            return RemoteCallError("connection_error", f"{what}: {_short(cause)}", retryable=True, delivered=False)
        if isinstance(cause, httpx.TransportError):
            return RemoteCallError("transport_error", f"{what}: {_short(cause)}", retryable=True)
        if isinstance(cause, json.JSONDecodeError):
            return RemoteCallError("malformed_response", f"{what}: reply is not JSON ({cause})", retryable=False)
        cause = cause.__cause__ or cause.__context__
    # e.g. a reply with status != "success", or an env that is no longer ready
    return RemoteCallError("remote_error", f"{what}: {_short(exc)}", retryable=False)


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:400]}"


def _connect_urls(base_url: str | list[str] | None, replicas: int, connect_timeout: float) -> list[_Instance]:
    urls = [base_url] if isinstance(base_url, str) else list(base_url or [])
    if not urls:
        raise ValueError(f"affinetes url mode needs base_url (e.g. 'http://127.0.0.1:8765'); {SERVER_HINT}")
    if replicas != 1:
        raise ValueError(f"affinetes url mode: replicas={replicas} is for docker mode; list one URL per server "
                         "in `url` instead")
    for url in urls:
        try:
            httpx.get(f"{url.rstrip('/')}/health", timeout=connect_timeout).raise_for_status()
        except httpx.HTTPError as exc:
            raise ConnectionError(f"no healthy env server at {url} ({_short(exc)}); {SERVER_HINT}") from exc
    # affinetes patches asyncio process-wide (nest_asyncio) when its backends are imported, so it is
    # imported only when an affinetes env is actually built.
    import affinetes

    return [_Instance(url, affinetes.load_env(mode="url", base_url=url), url=url.rstrip("/")) for url in urls]


def _start_containers(image: str | None, env_vars: dict[str, str] | None, replicas: int,
                      container_prefix: str | None = None, hosts: list[str] | None = None) -> list[_Instance]:
    if not image:
        raise ValueError("affinetes docker mode needs an image, e.g. 'affinefoundation/game:openspiel'")
    if hosts is not None and len(hosts) < replicas:
        raise ValueError(f"affinetes docker mode: {len(hosts)} hosts for {replicas} replicas; name one per replica")
    env_vars = dict(env_vars or {})
    # Episodes live in one server process's memory; more uvicorn workers would lose them.
    if env_vars.setdefault("UVICORN_WORKERS", "1") != "1":
        raise ValueError(f"env_vars UVICORN_WORKERS={env_vars['UVICORN_WORKERS']!r} would split episodes across "
                         "worker processes; use replicas=N for parallelism (each container keeps its episodes)")
    import affinetes

    # Stable names: a later run replaces (force_recreate) what a killed run left behind.
    base_name = container_prefix or image.split("/")[-1].replace(":", "-")
    instances: list[_Instance] = []
    try:
        for index in range(replicas):
            name = f"{base_name}-r{index}"
            # affinetes' own hosts setting, one host per replica: each replica stays its own env (episodes pinned)
            where = {"hosts": [hosts[index]]} if hosts else {}
            client = affinetes.load_env(image=image, mode="docker", replicas=1, container_name=name,
                                        env_vars=env_vars, pull=True, force_recreate=True, **where)
            instances.append(_Instance(name, client))
    except Exception as exc:
        loop = asyncio.get_event_loop()  # nest_asyncio (imported with affinetes) makes this safe in a running loop
        for instance in instances:
            loop.run_until_complete(instance.client.cleanup())
        raise RuntimeError(f"affinetes docker mode could not start {image!r} ({_short(exc)}). Is Docker running "
                           "(`docker info`), and can this machine pull the image?") from exc
    return instances
