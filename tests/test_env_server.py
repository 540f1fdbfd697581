"""`python -m ppo_affine.envs.server`: the affinetes function_based surface, restricted to reset/step/state/stop."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ppo_affine.envs.base import step_result
from ppo_affine.envs.server import METHODS, create_app, parse_args

ROOT = Path(__file__).resolve().parent.parent
START_DEADLINE_S = 60.0


class ServerProcess:
    """`python -m ppo_affine.envs.server ...` in a subprocess on 127.0.0.1; its URL read from the start line."""

    def __init__(self, log_path: Path, *args: str, port: int = 0):
        self.log_path = log_path
        self.args = args
        self.port = port
        self.process: subprocess.Popen | None = None
        self._starts = 0  # start lines in the log so far (a restart appends to the same log)

    def start(self) -> "ServerProcess":
        # the log goes to a file so that nobody has to drain a pipe while the server runs
        with open(self.log_path, "a") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ppo_affine.envs.server", "--host", "127.0.0.1", "--port", str(self.port), *self.args],
                cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            starts = re.findall(r"serving \w+ env at http://127\.0\.0\.1:(\d+)", self.log_path.read_text())
            if len(starts) > self._starts:
                self._starts = len(starts)
                self.port = int(starts[-1])
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        raise RuntimeError(f"server did not start within {START_DEADLINE_S}s:\n{self.log_path.read_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, connections are reset, episodes are lost."""
        self.process.kill()
        self.process.wait(10)

    def restart(self) -> "ServerProcess":
        """A fresh process on the same port (its episode memory is empty)."""
        self.kill()
        return self.start()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


@pytest.fixture
def openspiel_server(tmp_path):
    server = ServerProcess(tmp_path / "server.log", "--env", "openspiel", "--mcts-simulations", "5").start()
    yield server
    server.stop()


# ------------------------------------------------------------------ the app, in process
class RecordingEnv:
    """A one-move env: any action ends the episode; the action "crash" raises inside the env."""

    def __init__(self):
        self.closed = False
        self.episodes: set[str] = set()

    async def reset(self, task_id=None, seed=None, **kwargs):
        episode_id = f"ep{len(self.episodes)}"
        self.episodes.add(episode_id)
        return step_result("your move", episode_id=episode_id, info={"task_id": task_id, "seed": seed, **kwargs})

    async def step(self, action, episode_id):
        if action == "crash":
            raise RuntimeError("env bug")
        return step_result(f"played {action}", reward=1.0, done=True, episode_id=episode_id, info={"score": 1.0})

    async def state(self, episode_id):
        return step_result("your move", episode_id=episode_id)

    async def stop(self, episode_id):
        return {"status": "ok", "stopped": episode_id in self.episodes, "episode_id": episode_id}

    async def close(self):
        self.closed = True

    def _private_helper(self):
        raise AssertionError("must never be reachable over HTTP")


@pytest.fixture
def game_client():
    """Our game env's app with evaluate(), its LLM a scripted endpoint that always answers "1"."""
    import httpx

    from ppo_affine.envs.llm_play import GameEvaluator
    from ppo_affine.envs.openspiel_env import OpenSpielEnv

    def always_call(request):
        chunk = {"choices": [{"index": 0, "delta": {"content": "1"}}]}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    evaluator = GameEvaluator(OpenSpielEnv("evaluate"), transport=httpx.MockTransport(always_call))
    with TestClient(create_app(OpenSpielEnv("evaluate"), "openspiel", evaluator=evaluator)) as client:
        yield client


@pytest.fixture
def client_and_env():
    env = RecordingEnv()
    with TestClient(create_app(env, "fake")) as client:
        yield client, env


def test_methods_lists_exactly_reset_step_state_stop(client_and_env):
    client, _ = client_and_env
    listing = client.get("/methods").json()["methods"]
    assert [m["name"] for m in listing] == ["reset", "step", "state", "stop"]
    assert {m["endpoint"] for m in listing} == {"POST /reset", "POST /step", "POST /state", "POST /stop"}
    assert client.get("/health").json() == {"status": "ok", "env": "fake"}


@pytest.mark.parametrize("name", ["close", "_private_helper", "__init__", "episodes", "__class__"])
def test_call_refuses_anything_outside_the_allow_list(client_and_env, name):
    client, env = client_and_env
    reply = client.post("/call", json={"method": name, "args": [], "kwargs": {}})
    assert reply.status_code == 404
    assert reply.json() == {"detail": f"Method not found: {name}"}
    assert client.post(f"/{name}", json={}).status_code in (404, 405)
    assert not env.closed


def test_the_game_env_also_offers_the_validators_evaluate(game_client):
    listing = game_client.get("/methods").json()["methods"]
    assert [m["name"] for m in listing] == ["reset", "step", "state", "stop", "evaluate"]
    evaluate = next(m for m in listing if m["name"] == "evaluate")
    assert evaluate["signature"].startswith("(task_id: 'int | None' = None, seed: 'int | None' = None, model")


def test_evaluate_over_the_wire_plays_a_whole_game(game_client):
    kwargs = {"task_id": 200_000_000, "seed": 1_580_322_239, "model": "m", "base_url": "http://llm/v1",
              "temperature": 0.0, "opponent": "random", "timeout": 60}
    reply = game_client.post("/call", json={"method": "evaluate", "args": [], "kwargs": kwargs})
    assert reply.status_code == 200 and reply.json()["status"] == "success"
    result = reply.json()["result"]
    # always Call from J♥ against the random opponent's raises: -7 chips, (-7 + 13) / 26
    assert (result["task_name"], result["score"], result["success"]) == ("openspiel:leduc_poker", 6 / 26, False)
    assert [m["role"] for m in result["extra"]["conversation"]] == ["system", "user", "assistant", "user", "assistant"]
    unknown = game_client.post("/call", json={"method": "evaluate", "kwargs": {"max_tokens": 5}})
    assert unknown.status_code == 422  # the real env's arguments only


def test_no_openapi_or_docs_routes(client_and_env):
    client, _ = client_and_env
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert client.get(path).status_code == 404


def test_call_runs_the_env_method_and_wraps_the_result(client_and_env):
    client, _ = client_and_env
    reply = client.post("/call", json={"method": "reset", "args": [], "kwargs": {"task_id": 7, "seed": 3}})
    assert reply.status_code == 200
    body = reply.json()
    assert body["status"] == "success" and body["error"] is None
    assert body["result"] == {"observation": "your move", "reward": 0.0, "done": False, "truncated": False,
                              "episode_id": "ep0", "info": {"task_id": 7, "seed": 3}}


def test_method_routes_take_flat_kwargs_or_args_and_kwargs(client_and_env):
    client, _ = client_and_env
    flat = client.post("/step", json={"action": "4", "episode_id": "ep0"}).json()["result"]
    wrapped = client.post("/step", json={"args": ["5"], "kwargs": {"episode_id": "ep0"}}).json()["result"]
    assert flat["observation"] == "played 4" and wrapped["observation"] == "played 5"
    assert client.post("/reset").json()["result"]["episode_id"] == "ep0"  # empty body: no arguments


def test_wrong_arguments_answer_422_without_calling_the_env(client_and_env):
    client, env = client_and_env
    missing = client.post("/call", json={"method": "step", "kwargs": {"action": "1"}})
    unknown = client.post("/call", json={"method": "state", "kwargs": {"episode_id": "ep0", "timeout": 5}})
    not_a_call = client.post("/call", json=["reset"])
    assert missing.status_code == unknown.status_code == not_a_call.status_code == 422
    assert "episode_id" in missing.json()["detail"]
    assert env.episodes == set()


def test_an_env_exception_answers_500_and_the_server_keeps_serving(client_and_env):
    client, _ = client_and_env
    reply = client.post("/call", json={"method": "step", "kwargs": {"action": "crash", "episode_id": "ep0"}})
    assert reply.status_code == 500
    assert reply.json() == {"detail": "step failed: RuntimeError: env bug"}
    assert client.post("/call", json={"method": "stop", "kwargs": {"episode_id": "ep0"}}).status_code == 200


def test_shutdown_closes_the_env():
    env = RecordingEnv()
    with TestClient(create_app(env, "fake")):
        assert not env.closed
    assert env.closed


# ------------------------------------------------------------------ the command line
def test_options_of_the_other_env_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--env", "openspiel", "--skip-degenerate"])
    assert exit_info.value.code == 2
    assert "--skip-degenerate do not apply to --env openspiel" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--env", "trace", "--format", "openenv"])


def test_defaults_fill_in_per_env():
    game = parse_args(["--env", "openspiel"])
    trace = parse_args(["--env", "trace", "--skip-degenerate"])
    assert (game.format, game.mcts_simulations, game.host, game.port) == ("evaluate", None, "127.0.0.1", 8765)
    assert game.llm_retries == 10  # the real env's evaluate() retries a failed LLM call 10 times
    assert (trace.source, trace.skip_degenerate, trace.execution_timeout) == ("embedded", True, 10.0)


def test_the_game_server_records_opponent_moves_in_the_file_named(tmp_path, capsys):
    from ppo_affine.envs.server import build_env

    path = tmp_path / "moves.sqlite"
    env, evaluator = build_env(parse_args(["--env", "openspiel", "--opponent-moves", str(path)]))
    try:
        # the reset/step env and the env behind evaluate(), the call validators make
        assert env.opponent_moves == evaluator.env.opponent_moves == str(path)
        assert not path.exists()  # until an MCTS opponent searches
    finally:
        asyncio.run(env.close())
        asyncio.run(evaluator.env.close())
    with pytest.raises(SystemExit):
        parse_args(["--env", "trace", "--opponent-moves", str(path)])
    assert "--opponent-moves do not apply to --env trace" in capsys.readouterr().err


def test_llm_retries_apply_to_the_game_env_only(capsys):
    assert parse_args(["--env", "openspiel", "--llm-retries", "0"]).llm_retries == 0
    with pytest.raises(SystemExit):
        parse_args(["--env", "trace", "--llm-retries", "1"])
    assert "--llm-retries do not apply to --env trace" in capsys.readouterr().err


def test_affinetes_url_mode_detects_function_based_and_plays_an_openenv_session(openspiel_server):
    import affinetes
    from affinetes.core import get_registry

    async def play() -> tuple[dict, dict, dict]:
        env = affinetes.load_env(mode="url", base_url=openspiel_server.url)
        try:
            methods = await env.list_methods(print_info=False)
            session = await env.openenv().reset(task_id=200_000_000, seed=4, opponent="random")  # leduc poker
            state = await session.state()
            last = session.last
            while not last["done"]:
                last = await session.step(str(last["info"]["legal_actions"][0]))
            await session.stop()
            return {"methods": [m["name"] for m in methods]}, state, last
        finally:
            await env.cleanup()
            get_registry().unregister(env.name)  # cleaned here; affinetes' exit hook need not

    listing, state, last = asyncio.run(play())
    # the /methods listing (not a parsed OpenAPI schema) is what affinetes returns for function_based
    assert listing["methods"] == [*METHODS, "evaluate"]
    assert state["info"]["game_name"] == "leduc_poker" and not state["done"]
    assert last["done"] and 0.0 <= last["info"]["score"] <= 1.0


def test_sigterm_shuts_the_server_down_gracefully(tmp_path):
    server = ServerProcess(tmp_path / "server.log", "--env", "openspiel").start()
    assert server.stop() == -signal.SIGTERM
    log_text = server.log_path.read_text()
    assert "methods: reset, step, state, stop, evaluate; one worker" in log_text
    assert "openspiel env closed; server stopped" in log_text
    assert "Traceback" not in log_text
