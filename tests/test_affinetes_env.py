"""AffinetesEnv: episodes over affinetes' url/docker modes, and the faults that must not stop a run."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import pytest

from ppo_affine.envs.affinetes_env import AffinetesEnv, RemoteCallError
from ppo_affine.envs.tasks import game_task_id
from test_env_server import ServerProcess

FAST = {"call_timeout": 5.0, "max_retries": 2, "backoff_base": 0.01}
Reply = tuple[int, bytes]


def success(result: Any) -> Reply:
    return 200, json.dumps({"status": "success", "result": result, "error": None}).encode()


def openenv(observation: str, reward: float = 0.0, done: bool = False, truncated: bool = False,
            episode_id: str | None = None, **info: Any) -> dict[str, Any]:
    return {"observation": observation, "reward": reward, "done": done, "truncated": truncated,
            "episode_id": episode_id, "info": info}


class FakeServer:
    """A stdlib HTTP server speaking affinetes' function_based wire format on 127.0.0.1.

    `respond(method, kwargs)` returns (status, body), or None to drop the connection unanswered, and may
    sleep to play a slow server. It runs in a thread so that it answers while the test's event loop
    awaits the client under test.
    """

    def __init__(self, respond: Callable[[str, dict[str, Any]], Reply], methods: tuple[str, ...] = ()):
        self.calls: list[tuple[str, dict[str, Any]]] = []
        server = self
        listing = json.dumps({"methods": [{"name": name} for name in methods]}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/health":
                    self._send(200, b'{"status": "ok"}')
                elif self.path == "/methods":
                    self._send(200, listing)
                else:
                    self._send(404, b'{"detail": "not found"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.calls.append((body["method"], body["kwargs"]))
                reply = server.respond(body["method"], body["kwargs"])
                if reply is not None:  # else the handler returns unanswered and the connection closes
                    self._send(*reply)

            def _send(self, status: int, payload: bytes):
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (timeout tests)

            def log_message(self, *args):
                pass

        self.respond = respond
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def methods_called(self) -> list[str]:
        return [method for method, _ in self.calls]


class AffineGame:
    """Answers like the real Affine game image: its own info keys, no prompts, score only as the final reward.

    The only legal action is "1"; anything else is an invalid action (reward -0.01, state unchanged).
    `trace=True` answers like the trace image instead (no game_name; one step ends the task).
    """

    def __init__(self, final_reward: float = 1.0, trace: bool = False):
        self.final_reward = final_reward
        self.trace = trace
        self.live: set[str] = set()
        self.created: list[str] = []

    def __call__(self, method: str, kwargs: dict[str, Any]) -> Reply:
        info = {"task_id": 5, "seed": 1} if self.trace else {"task_id": 5, "seed": 1, "game_name": "leduc_poker",
                                                              "llm_player_id": 0, "step_count": 0}
        if method == "reset":
            episode_id = uuid.uuid4().hex
            self.live.add(episode_id)
            self.created.append(episode_id)
            return success(openenv("Game: leduc\nLegal Actions:\n  1 -> Call", episode_id=episode_id, **info))
        episode_id = kwargs["episode_id"]
        if method == "stop":
            self.live.discard(episode_id)
            return success({"status": "ok", "stopped": True, "episode_id": episode_id})
        if episode_id not in self.live:
            error = {"type": "episode_not_found", "message": "gone", "retryable": False}
            return success(openenv("Episode not found", done=True, truncated=True, episode_id=episode_id,
                                   error=error, **info))
        if kwargs["action"] != "1" and not self.trace:
            error = {"type": "invalid_action", "message": "not legal", "retryable": False}
            return success(openenv("Invalid action. Game: leduc\nLegal Actions:\n  1 -> Call", reward=-0.01,
                                   episode_id=episode_id, error=error, **info))
        return success(openenv("Final score", reward=self.final_reward, done=True, episode_id=episode_id, **info))


def run(coroutine):
    return asyncio.run(coroutine)


def url_env(url: str | list[str], **options: Any) -> AffinetesEnv:
    return AffinetesEnv(mode="url", base_url=url, **{**FAST, **options})


async def reset_and_step(env: AffinetesEnv) -> dict:
    """Task 5, seed 1, and one reply: the step the server's trouble lands on."""
    first = await env.reset(task_id=5, seed=1)
    return await env.step("1", first["episode_id"])


# ------------------------------------------------------------------ info translation
def test_real_affine_game_info_is_mapped_to_the_trainer_keys():
    with FakeServer(AffineGame(final_reward=1.0)) as server:
        env = url_env(server.url)

        async def play():
            first = await env.reset(task_id=5, seed=1, opponent="mcts")
            invalid = await env.step("9", first["episode_id"])
            final = await env.step("1", first["episode_id"])
            await env.close()
            return first, invalid, final

        first, invalid, final = run(play())
    assert server.calls[0] == ("reset", {"task_id": 5, "seed": 1, "opponent": "mcts"})
    assert first["info"]["system_prompt"] is None
    assert first["info"]["turn_prompt"] == first["observation"]
    assert first["info"]["parse_error"] is False
    assert invalid["info"]["parse_error"] is True and invalid["reward"] == -0.01
    # the pending decision is still the first one; the new observation only adds feedback
    assert invalid["info"]["turn_prompt"] == first["observation"]
    assert final["done"] and final["info"]["score"] == 1.0 and final["info"]["success"] is True
    assert "score" not in first["info"]


@pytest.mark.parametrize("reward, success_expected", [(0.5, False), (0.54, True)])
def test_game_success_means_a_score_above_one_half(reward, success_expected):
    with FakeServer(AffineGame(final_reward=reward)) as server:
        env = url_env(server.url)
        final = run(reset_and_step(env))
        run(env.close())
    assert final["info"]["score"] == reward and final["info"]["success"] is success_expected


@pytest.mark.parametrize("reward, success_expected", [(0.0, False), (1.0, True)])
def test_trace_success_means_a_positive_score(reward, success_expected):
    with FakeServer(AffineGame(final_reward=reward, trace=True)) as server:
        env = url_env(server.url)

        async def play():
            first = await env.reset(task_id=5, seed=1)
            return await env.step("whatever the program prints", first["episode_id"])

        final = run(play())
        run(env.close())
    assert final["info"]["score"] == reward and final["info"]["success"] is success_expected


def test_our_servers_info_passes_through_unchanged():
    ours = openenv("prompt", episode_id="e1", system_prompt="rules", turn_prompt="state", parse_error=False,
                   legal_actions=[0, 1], game_name="hex")
    with FakeServer(lambda method, kwargs: success(ours)) as server:
        env = url_env(server.url)
        result = run(env.reset(task_id=1, seed=2))
        run(env.close())
    assert result == ours


# ------------------------------------------------------------------ episode bookkeeping
def test_a_finished_episode_is_stopped_on_its_server():
    game = AffineGame()
    with FakeServer(game) as server:
        env = url_env(server.url)

        async def play():
            first = await env.reset(task_id=5, seed=1)
            await env.step("1", first["episode_id"])
            return first["episode_id"], await env.stop(first["episode_id"])

        episode_id, late_stop = run(play())
        run(env.close())
    assert server.methods_called() == ["reset", "step", "stop"]
    assert game.live == set()
    assert late_stop["stopped"] is False  # the trainer's own stop after the end is a no-op


def test_episodes_stay_on_the_server_that_reset_them():
    game_a, game_b = AffineGame(), AffineGame()
    with FakeServer(game_a) as server_a, FakeServer(game_b) as server_b:
        env = url_env([server_a.url, server_b.url])

        async def play():
            firsts = [await env.reset(task_id=5, seed=s) for s in range(4)]
            for first in reversed(firsts):
                await env.step("1", first["episode_id"])
            return [first["episode_id"] for first in firsts]

        episode_ids = run(play())
        run(env.close())
    for server, game in ((server_a, game_a), (server_b, game_b)):
        assert len(game.created) == 2  # the least busy server takes each reset
        assert {kwargs["episode_id"] for method, kwargs in server.calls if method != "reset"} == set(game.created)
    assert sorted(game_a.created + game_b.created) == sorted(episode_ids)
    assert env.error_counts()["failed_episodes"] == 0


def test_step_of_an_unknown_episode_fails_without_a_call():
    with FakeServer(AffineGame()) as server:
        env = url_env(server.url)
        result = run(env.step("1", "no-such-episode"))
        run(env.close())
    assert server.calls == []
    assert result["done"] and result["truncated"]
    assert result["info"]["error"]["type"] == "unknown_episode"


def test_close_stops_live_episodes_is_idempotent_and_later_calls_fail_cleanly():
    game = AffineGame()
    with FakeServer(game) as server:
        env = url_env(server.url)

        async def play():
            await env.reset(task_id=5, seed=1)
            await env.close()
            await env.close()
            return await env.reset(task_id=5, seed=2)

        after_close = run(play())
    assert server.methods_called() == ["reset", "stop"]
    assert game.live == set()
    assert after_close["info"]["error"]["type"] == "closed"


def test_ctrl_c_during_a_step_then_close_stops_the_episode_on_its_server():
    game = AffineGame()
    with FakeServer(slow(1.0, game, methods=("step",))) as server:
        env = url_env(server.url)

        async def interrupted_run():
            first = await env.reset(task_id=5, seed=1)
            pending = asyncio.ensure_future(env.step("1", first["episode_id"]))
            await asyncio.sleep(0.2)
            pending.cancel()  # what asyncio.run does to the main task on Ctrl-C
            with pytest.raises(asyncio.CancelledError):
                await pending
            await env.close()  # the trainer's finally block
            return first["episode_id"]

        episode_id = run(interrupted_run())
    assert server.calls[-1] == ("stop", {"episode_id": episode_id})
    assert env.error_counts()["failed_episodes"] == 0


# ------------------------------------------------------------------ faults
def slow(seconds: float, respond: Callable[[str, dict[str, Any]], Reply], methods: tuple[str, ...]):
    def answer(method: str, kwargs: dict[str, Any]) -> Reply:
        if method in methods:
            time.sleep(seconds)
        return respond(method, kwargs)
    return answer


def test_a_step_slower_than_the_timeout_fails_the_episode_once(caplog):
    with FakeServer(slow(2.0, AffineGame(), methods=("step",))) as server:
        env = url_env(server.url, call_timeout=0.3)
        with caplog.at_level(logging.WARNING, logger="ppo_affine.envs.affinetes_env"):
            result = run(reset_and_step(env))
        counts = env.error_counts()
        run(env.close())
    assert result["done"] and result["truncated"] and result["info"]["score"] == 0.0
    assert result["info"]["error"]["type"] == "timeout" and result["info"]["error"]["retryable"] is True
    # a step that may have been applied is never sent twice; the episode is stopped on the server
    assert server.methods_called() == ["reset", "step", "stop"]
    assert counts["timeouts"] == 1 and counts["retries"] == 0 and counts["failed_episodes"] == 1
    assert "failed (step)" in caplog.text and "timeout" in caplog.text


def test_a_reset_slower_than_the_timeout_is_retried_then_fails():
    with FakeServer(slow(2.0, AffineGame(), methods=("reset",))) as server:
        env = url_env(server.url, call_timeout=0.3, max_retries=2)
        result = run(env.reset(task_id=5, seed=1))
        counts = env.error_counts()
        run(env.close())
    assert server.methods_called() == ["reset", "reset", "reset"]
    assert result["episode_id"] is None and result["done"] and result["truncated"]
    assert counts["timeouts"] == 3 and counts["retries"] == 2 and counts["failed_episodes"] == 1


def test_a_reset_answered_with_503_is_retried():
    replies = iter([(503, b'{"detail": "busy"}')])
    game = AffineGame()
    with FakeServer(lambda method, kwargs: next(replies, None) or game(method, kwargs)) as server:
        env = url_env(server.url)
        result = run(env.reset(task_id=5, seed=1))
        counts = env.error_counts()
        run(env.close())
    assert not result["done"] and result["episode_id"]
    assert counts["http_errors"] == 1 and counts["retries"] == 1 and counts["failed_episodes"] == 0


def test_a_reset_refused_by_one_server_is_retried_on_another():
    game = AffineGame()
    with FakeServer(lambda method, kwargs: (503, b'{"detail": "overloaded"}')) as busy, FakeServer(game) as healthy:
        env = url_env([busy.url, healthy.url])

        async def play():
            return [await env.reset(task_id=5, seed=s) for s in range(3)]

        firsts = run(play())
        counts = env.error_counts()
        run(env.close())
    assert all(not first["done"] for first in firsts) and len(game.created) == 3
    # tried first (no live episodes) once; after its failure new episodes go to the healthy server
    assert len(busy.calls) == counts["http_errors"] == counts["retries"] == 1
    assert counts["failed_episodes"] == 0


def test_a_reset_without_an_episode_id_for_a_live_episode_is_malformed():
    with FakeServer(lambda method, kwargs: success(openenv("prompt"))) as server:
        env = url_env(server.url)
        result = run(env.reset(task_id=5, seed=1))
        counts = env.error_counts()
        run(env.close())
    assert result["done"] and result["info"]["error"]["type"] == "malformed_response"
    assert counts["malformed_responses"] == 1 and counts["retries"] == 0


def test_a_step_answered_with_500_is_not_retried():
    game = AffineGame()

    def respond(method, kwargs):
        return (500, b'{"detail": "step failed: boom"}') if method == "step" else game(method, kwargs)

    with FakeServer(respond) as server:
        env = url_env(server.url)
        result = run(reset_and_step(env))
        run(env.close())
    assert server.methods_called() == ["reset", "step", "stop"]
    assert result["info"]["error"]["type"] == "http_error" and "HTTP 500" in result["info"]["error"]["message"]


MALFORMED_STEP_REPLIES = {
    "not JSON": (200, b"<html>proxy error</html>"),
    "a list": success(["observation", 0.0]),
    "a missing field": success({"observation": "x", "reward": 0.0, "truncated": False, "episode_id": "e", "info": {}}),
    "a string reward": success(openenv("x", reward="1.0", episode_id="e")),
    "a boolean reward": success(openenv("x", reward=True, episode_id="e")),
    "info not an object": success({**openenv("x", episode_id="e"), "info": "none"}),
}


@pytest.mark.parametrize("reply", MALFORMED_STEP_REPLIES.values(), ids=MALFORMED_STEP_REPLIES.keys())
def test_a_malformed_step_reply_fails_the_episode_without_retry(reply):
    game = AffineGame()
    with FakeServer(lambda method, kwargs: reply if method == "step" else game(method, kwargs)) as server:
        env = url_env(server.url)
        result = run(reset_and_step(env))
        counts = env.error_counts()
        run(env.close())
    assert server.methods_called() == ["reset", "step", "stop"]
    assert result["done"] and result["truncated"] and result["info"]["score"] == 0.0
    assert result["info"]["error"]["type"] == "malformed_response"
    assert result["info"]["error"]["retryable"] is False
    assert counts["malformed_responses"] == 1 and counts["failed_episodes"] == 1


def test_a_failed_status_from_the_server_fails_the_episode():
    failed = (200, b'{"status": "failed", "result": {"error": "Task execution exceeded timeout"}}')
    with FakeServer(lambda method, kwargs: failed) as server:
        env = url_env(server.url)
        result = run(env.reset(task_id=5, seed=1))
        run(env.close())
    assert server.methods_called() == ["reset"]
    assert result["info"]["error"]["type"] == "remote_error"
    assert "exceeded timeout" in result["info"]["error"]["message"]


def test_no_server_at_start_is_an_error_that_says_how_to_start_one():
    with FakeServer(AffineGame()) as server:
        url = server.url  # a port that was just freed
    with pytest.raises(ConnectionError, match=r"python -m ppo_affine.envs.server --env openspiel"):
        url_env(url)


def test_constructor_refuses_replicas_in_url_mode():
    with pytest.raises(ValueError, match="one URL per server"):
        AffinetesEnv(mode="url", base_url="http://127.0.0.1:1", replicas=2)


# ------------------------------------------------------------------ the env's own evaluate()
def test_evaluate_sends_the_validators_call_and_returns_the_result():
    result = {"task_name": "openspiel:leduc_poker", "score": 0.5, "success": False, "extra": {}}
    with FakeServer(lambda method, kwargs: success(result), methods=("reset", "evaluate")) as server:
        env = url_env(server.url)
        methods = run(env.methods())
        got = run(env.evaluate(timeout=600, task_id=200000000, seed=7, model="m", base_url="http://llm/v1"))
        run(env.close())
    assert methods == ["reset", "evaluate"]
    assert got == result
    # `timeout` goes to the env, which enforces it (the template server adds 10 s)
    assert server.calls == [("evaluate", {"timeout": 600, "task_id": 200000000, "seed": 7, "model": "m",
                                          "base_url": "http://llm/v1"})]


def test_an_evaluate_answered_with_500_is_not_replayed():
    with FakeServer(lambda method, kwargs: (500, b'{"detail": "evaluate failed"}'), methods=("evaluate",)) as server:
        env = url_env(server.url)
        with pytest.raises(RemoteCallError) as failure:
            run(env.evaluate(timeout=60, task_id=1))
        run(env.close())
    assert server.methods_called() == ["evaluate"]  # a second call would replay a whole game
    assert failure.value.kind == "http_error" and "HTTP 500" in failure.value.message


def test_an_evaluate_reply_without_a_score_is_malformed():
    with FakeServer(lambda method, kwargs: success({"observation": "?"}), methods=("evaluate",)) as server:
        env = url_env(server.url)
        with pytest.raises(RemoteCallError, match="not an evaluate\\(\\) result \\(score None\\)") as failure:
            run(env.evaluate(timeout=60, task_id=1))
        run(env.close())
    assert failure.value.kind == "malformed_response"


# ------------------------------------------------------------------ real server processes
@pytest.fixture
def game_server(tmp_path):
    server = ServerProcess(tmp_path / "game.log", "--env", "openspiel", "--mcts-simulations", "5").start()
    yield server
    server.stop()


def first_legal(result) -> str:
    return str(result["info"]["legal_actions"][0])


async def play_out(env: AffinetesEnv, task_id: int, seed: int, opponent: str = "random") -> dict:
    result = await env.reset(task_id=task_id, seed=seed, opponent=opponent)
    for _ in range(200):
        if result["done"]:
            return result
        result = await env.step(first_legal(result), result["episode_id"])
    raise AssertionError(f"task {task_id} did not end within 200 moves")


def test_full_games_over_http(game_server):
    env = url_env(game_server.url, call_timeout=30.0)

    async def play():
        return [await play_out(env, game_task_id("leduc_poker"), seed=3, opponent="mcts"),
                await play_out(env, game_task_id("goofspiel"), seed=4)]

    leduc, goofspiel = run(play())
    run(env.close())
    for final, game in ((leduc, "leduc_poker"), (goofspiel, "goofspiel")):
        assert final["done"] and not final["truncated"]
        assert final["info"]["game_name"] == game
        assert 0.0 <= final["info"]["score"] <= 1.0 and final["reward"] == final["info"]["score"]
        assert "error" not in final["info"]
    assert env.error_counts() == dict.fromkeys(env.error_counts(), 0)


def test_a_trace_task_over_http(tmp_path):
    server = ServerProcess(tmp_path / "trace.log", "--env", "trace").start()
    try:
        env = url_env(server.url, call_timeout=30.0)

        async def play():
            first = await env.reset(task_id=5, seed=1)
            return first, await env.step("1\n2\n", first["episode_id"])

        first, final = run(play())
        run(env.close())
    finally:
        server.stop()
    assert "Python program" in first["observation"] and first["info"]["turn_prompt"]
    assert final["done"] and not final["truncated"] and "error" not in final["info"]
    assert final["info"]["score"] in (0.0, 1.0) and final["reward"] == final["info"]["score"]
    assert env.error_counts()["failed_episodes"] == 0


def restart_later(server: ServerProcess, seconds: float) -> threading.Thread:
    """Start the (killed) server again on its port `seconds` from now, from another thread."""
    def start():
        time.sleep(seconds)
        server.start()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


def test_a_server_killed_mid_episode_is_waited_for_and_the_episode_lost_in_the_outage(game_server, caplog):
    env = url_env(game_server.url)

    async def play():
        first = await env.reset(task_id=game_task_id("leduc_poker"), seed=3, opponent="random")
        game_server.kill()
        restart_later(game_server, 1.0)
        lost = await env.step(first_legal(first), first["episode_id"])
        after_restart = await play_out(env, game_task_id("leduc_poker"), seed=5)
        return lost, after_restart

    with caplog.at_level(logging.WARNING, logger="ppo_affine.envs.affinetes_env"):
        lost, after_restart = run(play())
    counts = env.error_counts()
    run(env.close())
    assert lost["done"] and lost["truncated"] and lost["info"]["error"]["type"] == "connection_error"
    # the rollout plays it again from its start, and neither counts it as failed nor against its replay budget
    assert lost["info"]["error"]["episode_lost"] and lost["info"]["error"]["outage"]
    # a refused connection never reached the server, so even the step was retried, then the server waited for
    assert counts["retries"] == FAST["max_retries"] and counts["connection_errors"] == FAST["max_retries"] + 1
    assert counts["outages"] == 1 and counts["failed_episodes"] == 0
    assert caplog.text.count("is not answering") == 1 and "answers again after" in caplog.text
    assert after_restart["done"] and not after_restart["truncated"]


def test_a_server_that_stays_away_past_the_wait_is_given_up_and_later_calls_fail_at_once():
    with FakeServer(AffineGame()) as server:
        env = url_env(server.url, server_wait_seconds=1.5)
    # the server is gone: every connection is refused

    async def play():
        return await env.reset(task_id=5, seed=1), await env.reset(task_id=5, seed=2)

    first, later = run(play())
    counts = env.error_counts()
    run(env.close())
    for result in (first, later):
        error = result["info"]["error"]
        assert result["done"] and error["type"] == "server_gone" and not error["episode_lost"]
        assert "not back within server_wait_seconds=1.5" in error["message"] and "--resume latest" in error["message"]
    assert counts["connection_errors"] == FAST["max_retries"] + 1  # the later reset did not try the server
    assert counts["failed_episodes"] == 2 and counts["outages"] == 0


def test_a_connection_dropped_by_a_server_that_still_answers_loses_the_episode_without_a_wait(caplog):
    game = AffineGame()
    with FakeServer(lambda method, kwargs: None if method == "step" else game(method, kwargs)) as server:
        env = url_env(server.url)
        with caplog.at_level(logging.WARNING, logger="ppo_affine.envs.affinetes_env"):
            result = run(reset_and_step(env))
        counts = env.error_counts()
        run(env.close())
    error = result["info"]["error"]
    assert error["type"] == "transport_error" and error["episode_lost"] and not error["outage"]
    assert server.methods_called() == ["reset", "step", "stop"]  # a step that may have been applied is not resent
    assert counts["outages"] == 0 and counts["failed_episodes"] == 1 and "is not answering" not in caplog.text


def test_server_restarted_between_reset_and_step_marks_that_episode_lost(game_server):
    env = url_env(game_server.url)

    async def play():
        first = await env.reset(task_id=game_task_id("goofspiel"), seed=3, opponent="random")
        game_server.restart()
        return await env.step(first_legal(first), first["episode_id"])

    result = run(play())
    counts = env.error_counts()
    run(env.close())
    assert result["done"] and result["truncated"]
    assert result["info"]["error"]["type"] == "episode_not_found" and result["info"]["error"]["episode_lost"]
    assert counts["remote_errors"] == 1 and counts["failed_episodes"] == 1


def test_a_step_answered_with_an_error_is_not_a_lost_episode():
    def respond(method, kwargs):
        if method == "reset":
            return success(openenv("Legal Actions:\n  1 -> Call", episode_id="e1", game_name="leduc_poker"))
        return 500, b'{"detail": "boom"}'

    with FakeServer(respond) as server:
        env = url_env(server.url)

        async def play():
            first = await env.reset(task_id=1, seed=1)
            return await env.step("1", first["episode_id"])

        result = run(play())
        run(env.close())
    assert result["info"]["error"]["type"] == "http_error" and not result["info"]["error"]["episode_lost"]


# ------------------------------------------------------------------ replays of lost episodes by the rollout
def replaying_runner(policy, env):
    from ppo_affine.generation import Generation
    from ppo_affine.prompts import PromptBuilder
    from ppo_affine.rollout import RolloutRunner
    from ppo_affine.config import GenerationConfig

    class RepliesOne:
        def __init__(self):
            self.eos_ids: set[int] = set()

        async def generate(self, prompt_ids, order_key, seed):
            return Generation(list(policy.tokenizer("1", add_special_tokens=False)["input_ids"]))

    return RolloutRunner({"game": ("affinetes", env)}, RepliesOne(), PromptBuilder(policy.tokenizer, 4096),
                         GenerationConfig(max_new_tokens=4))


def test_an_episode_its_restarted_server_forgot_is_replayed_from_its_start(tiny_policy):
    from ppo_affine.envs.tasks import Task

    game = AffineGame()
    steps = []

    def restart_at_the_first_step(method, kwargs):
        if method == "step":
            steps.append(kwargs["episode_id"])
            if len(steps) == 1:
                game.live.clear()  # the server restarted: it holds no episode
        return game(method, kwargs)

    with FakeServer(restart_at_the_first_step) as server:
        env = url_env(server.url)
        [episode] = run(replaying_runner(tiny_policy, env).run([Task("game", 7, 3, None, "s", False)], step=0))
        run(env.close())
        resets = [kwargs for method, kwargs in server.calls if method == "reset"]
    assert episode.error is None and episode.done and episode.replays == 1
    assert [(r["task_id"], r["seed"]) for r in resets] == [(7, 3), (7, 3)]  # the same task and seed again
    assert steps == game.created  # one step in each of the two episodes


def test_an_env_server_that_keeps_forgetting_episodes_fails_the_episode_after_the_replays(tiny_policy):
    from ppo_affine.envs.tasks import Task
    from ppo_affine.rollout import MAX_REPLAYS

    game = AffineGame()

    def forget_at_every_step(method, kwargs):
        if method == "step":
            game.live.clear()
        return game(method, kwargs)

    with FakeServer(forget_at_every_step) as server:
        env = url_env(server.url)
        [episode] = run(replaying_runner(tiny_policy, env).run([Task("game", 7, 3, None, "s", False)], step=0))
        run(env.close())
    assert episode.replays == MAX_REPLAYS and "lost 4 times" in episode.error
    assert len(game.created) == MAX_REPLAYS + 1


def test_an_env_server_killed_and_restarted_mid_rollout_is_waited_for_and_its_episodes_replayed(tiny_policy,
                                                                                               game_server, caplog):
    from ppo_affine.envs.tasks import Task

    env = url_env(game_server.url)
    runner = replaying_runner(tiny_policy, env)
    replies_one = runner.generator.generate

    async def kill_at_the_first_reply(prompt_ids, order_key, seed):
        if game_server.process.poll() is None and not hasattr(game_server, "restarter"):
            game_server.kill()  # every episode has been reset and waits for its first move
            game_server.restarter = restart_later(game_server, 1.0)
        return await replies_one(prompt_ids, order_key, seed)

    runner.generator.generate = kill_at_the_first_reply
    tasks = [Task("game", game_task_id("leduc_poker"), seed, None, "s", False) for seed in range(3)]
    with caplog.at_level(logging.WARNING, logger="ppo_affine.envs.affinetes_env"):
        episodes = run(runner.run(tasks, step=0))
    counts = env.error_counts()
    run(env.close())
    assert [(e.error, e.done, e.replays) for e in episodes] == [(None, True, 1)] * 3
    # one outage, waited for once by all three episodes, and none of them counted as failed
    assert counts["outages"] == 1 and counts["failed_episodes"] == 0
    assert caplog.text.count("is not answering") == 1


# ------------------------------------------------------------------ docker mode (no Docker engine needed)
def test_docker_mode_starts_one_container_per_replica_and_pins_episodes(monkeypatch):
    import affinetes

    real_load_env = affinetes.load_env
    game_a, game_b = AffineGame(), AffineGame()
    started: list[dict[str, Any]] = []
    with FakeServer(game_a) as server_a, FakeServer(game_b) as server_b:
        container_urls = iter([server_a.url, server_b.url])

        def start_container(**kwargs):
            started.append(kwargs)
            return real_load_env(mode="url", base_url=next(container_urls))  # the container's server

        monkeypatch.setattr(affinetes, "load_env", start_container)
        env = AffinetesEnv(mode="docker", image="affinefoundation/game:openspiel", env_vars={"LOG": "1"},
                           replicas=2, **FAST)

        async def play():
            firsts = [await env.reset(task_id=5, seed=s) for s in range(2)]
            return [await env.step("1", first["episode_id"]) for first in firsts]

        finals = run(play())
        run(env.close())
    assert [kwargs["container_name"] for kwargs in started] == ["game-openspiel-r0", "game-openspiel-r1"]
    for kwargs in started:
        assert kwargs["image"] == "affinefoundation/game:openspiel" and kwargs["mode"] == "docker"
        assert kwargs["replicas"] == 1
        assert kwargs["env_vars"] == {"LOG": "1", "UVICORN_WORKERS": "1"}
    assert len(game_a.created) == len(game_b.created) == 1
    assert all(final["info"]["success"] for final in finals)


def test_docker_mode_refuses_several_uvicorn_workers():
    with pytest.raises(ValueError, match="UVICORN_WORKERS='4' would split episodes"):
        AffinetesEnv(mode="docker", image="affinefoundation/game:openspiel", env_vars={"UVICORN_WORKERS": "4"})


def test_docker_mode_cleans_up_started_containers_when_a_later_one_fails(monkeypatch):
    import affinetes

    class StartedContainer:
        name = "game-openspiel-r0"
        cleaned = False

        async def cleanup(self):
            self.cleaned = True

    first = StartedContainer()
    outcomes = iter([first, RuntimeError("port conflict")])

    def start_container(**kwargs):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(affinetes, "load_env", start_container)
    with pytest.raises(RuntimeError, match=r"could not start 'affinefoundation/game:openspiel'.*port conflict"):
        AffinetesEnv(mode="docker", image="affinefoundation/game:openspiel", replicas=2)
    assert first.cleaned


def test_close_cleans_up_every_container_once(monkeypatch):
    import affinetes

    class Container:
        def __init__(self, name):
            self.name = name
            self.cleanups = 0

        async def cleanup(self):
            self.cleanups += 1

    containers: list[Container] = []

    def start_container(**kwargs):
        containers.append(Container(kwargs["container_name"]))
        return containers[-1]

    monkeypatch.setattr(affinetes, "load_env", start_container)
    env = AffinetesEnv(mode="docker", image="affinefoundation/trace:latest", replicas=3)
    run(env.close())
    run(env.close())
    assert [(c.name, c.cleanups) for c in containers] == [
        ("trace-latest-r0", 1), ("trace-latest-r1", 1), ("trace-latest-r2", 1)]


# ------------------------------------------------------------------ the trainer with env.mode url
@pytest.mark.slow
def test_two_training_steps_with_the_game_env_over_http(tiny_model_dir, tmp_path, game_server):
    import train_ppo
    from test_train import metrics, tiny_args

    code = train_ppo.main(tiny_args(tiny_model_dir, tmp_path, "--max-steps", "2",
                                    "--set", "env.envs.openspiel.mode=url",
                                    "--set", f"env.envs.openspiel.url={game_server.url}"))
    assert code == 0
    records = metrics(tmp_path / "t")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["env/episodes"] == 4 and record["env/episodes_failed"] == 0
        # only the affinetes backend reports these counters
        assert record["env_errors/openspiel/failed_episodes"] == 0
        assert record["env_errors/openspiel/timeouts"] == 0


def test_docker_mode_starts_each_replica_on_its_host(monkeypatch):
    import affinetes

    real_load_env = affinetes.load_env
    started: list[dict[str, Any]] = []
    with FakeServer(AffineGame()) as server_a, FakeServer(AffineGame()) as server_b:
        container_urls = iter([server_a.url, server_b.url])

        def start_container(**kwargs):
            started.append(kwargs)
            return real_load_env(mode="url", base_url=next(container_urls))

        monkeypatch.setattr(affinetes, "load_env", start_container)
        env = AffinetesEnv(mode="docker", image="affinefoundation/swe:latest", replicas=2,
                           hosts=["localhost", "ssh://ops@gpu2"], **FAST)
        run(env.close())
    assert [kwargs["hosts"] for kwargs in started] == [["localhost"], ["ssh://ops@gpu2"]]


def test_fewer_hosts_than_replicas_are_refused():
    with pytest.raises(ValueError, match="1 hosts for 2 replicas"):
        AffinetesEnv(mode="docker", image="affinefoundation/swe:latest", replicas=2, hosts=["localhost"])
