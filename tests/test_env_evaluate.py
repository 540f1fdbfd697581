"""evaluate.py --env-evaluate: scores from the env's own evaluate(), without Docker and without a real vLLM.

The env is our `python -m ppo_affine.envs.server --env openspiel` (or a scripted affinetes server); the LLM is
ppo_affine/testing/fake_vllm.py serving the tiny digit model, whose replies are one token, '1' or '2'.
tests/test_vllm_server.py repeats the equality check against a real vLLM server.
"""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

import evaluate
from ppo_affine.envs.tasks import Task
from ppo_affine.env_evaluate import env_record
from ppo_affine.testing import fake_vllm
from test_affinetes_env import FakeServer, success
from test_env_server import ServerProcess
from test_evaluate import checkpoint, digit_model_dir, read_episodes, tiny_args  # noqa: F401  (fixtures)

LEDUC = Task(env="openspiel", task_id=200_000_000, seed=1_580_322_239, opponent="random", stage="eval", replay=False)
SYSTEM = {"role": "system", "content": "You are playing leduc_poker."}


def decision(text: str = "Your card: J") -> dict[str, str]:
    return {"role": "user", "content": f"Current State:\n{text}\n\nYour choice (ID only):"}


def reply(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


FEEDBACK = {"role": "user", "content": "Your reply did not contain a valid action. This is attempt 1 of 3."}


def env_result(score: float, conversation: list[dict[str, str]], **fields) -> dict:
    return {"task_name": "openspiel:leduc_poker", "score": score, "success": score > 0.5, "time_taken": 1.0,
            "extra": {"conversation": conversation, "llm_player_id": 1}, **fields}


# ---------------------------------------------------------------------- one result -> one record
def test_record_of_a_game_won_after_one_unusable_reply():
    conversation = [SYSTEM, decision(), reply("hmm"), FEEDBACK, reply("1"), decision("Public card"), reply("2")]
    record = env_record(LEDUC, "adapter", env_result(1.0, conversation), None)
    assert {k: v for k, v in record.items() if k != "conversation"} == {
        "model": "adapter", "game": "leduc_poker", "task_id": 200_000_000, "seed": 1_580_322_239,
        "opponent": "random", "llm_player_id": 1, "score": 1.0, "success": True, "outcome": "win", "turns": 3,
        "illegal_moves": 1, "parse_failed_game": False, "generated_tokens": None, "error": None,
        "scored_by": "env_evaluate"}
    assert record["conversation"] == conversation


def test_record_of_a_game_lost_to_three_unusable_replies():
    conversation = [SYSTEM, decision(), reply("a"), FEEDBACK, reply("b"), FEEDBACK, reply("c"), FEEDBACK]
    record = env_record(LEDUC, "base", env_result(0.0, conversation), None)
    assert (record["outcome"], record["turns"], record["illegal_moves"], record["parse_failed_game"]) == (
        "loss", 3, 3, True)


def test_an_api_error_result_is_an_error_record_not_a_zero():
    result = env_result(0.0, [SYSTEM, decision()], error="[API_ERROR] API error 404: no such model")
    record = env_record(LEDUC, "base", result, None)
    assert (record["outcome"], record["error"], record["parse_failed_game"]) == (
        "error", "[API_ERROR] API error 404: no such model", False)


def test_a_failed_call_is_an_error_record():
    record = env_record(LEDUC, "base", None, "http_error: evaluate on http://e: HTTP 500")
    assert (record["outcome"], record["turns"], record["llm_player_id"], record["error"]) == (
        "error", 0, None, "http_error: evaluate on http://e: HTTP 500")


# ---------------------------------------------------------------------- servers for the end-to-end runs
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ModelsServer:
    """An OpenAI-compatible server that lists models (GET /v1/models) and answers the first
    `good_replies` chat completions with "1", every later one with HTTP 500."""

    def __init__(self, *model_ids: str, good_replies: int = 0):
        listing = json.dumps({"object": "list", "data": [{"id": m, "max_model_len": 32768} for m in model_ids]})
        chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": "1"}}]})
        answered = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._send(200, listing) if self.path == "/v1/models" else self._send(404, "{}")

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if len(answered) < good_replies:
                    answered.append(1)
                    self._send(200, f"data: {chunk}\n\ndata: [DONE]\n\n")
                else:
                    self._send(500, '{"error": {"message": "the engine died"}}')

            def _send(self, status: int, body: str) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body.encode())))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def digit_vllm(digit_model_dir):
    """fake_vllm serving the digit model; every reply capped at one token, like vLLM with
    --override-generation-config '{"max_new_tokens": 1}'."""
    port = _free_port()
    process = fake_vllm.start(digit_model_dir, port, "--max-new-tokens", "1")
    yield f"http://127.0.0.1:{port}/v1"
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def env_server(tmp_path_factory):
    """Our game env server; its evaluate() does not retry a failed LLM call (a dead URL fails at once)."""
    server = ServerProcess(tmp_path_factory.mktemp("env") / "server.log", "--env", "openspiel",
                           "--llm-retries", "0").start()
    yield server
    server.stop()


def vllm_args(model_dir: Path, url: str, *extra: str) -> list[str]:
    return tiny_args(model_dir, "--set", "generation.backend=vllm", "--set", f"env.vllm_url={url}", *extra)


# ---------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_env_evaluate_scores_equal_the_in_process_scores(digit_model_dir, checkpoint,
                                                         digit_vllm, env_server, tmp_path):
    tasks = ["--checkpoint", str(checkpoint), "--compare-base", "--games", "leduc_poker,liars_dice",
             "--episodes", "2"]
    assert evaluate.main(vllm_args(digit_model_dir, digit_vllm, *tasks, "--output-dir", str(tmp_path / "here"))) == 0
    assert evaluate.main(vllm_args(digit_model_dir, digit_vllm, *tasks, "--env-evaluate", env_server.url,
                                   "--output-dir", str(tmp_path / "env"))) == 0
    here, there = read_episodes(tmp_path / "here"), read_episodes(tmp_path / "env")
    key = lambda r: (r["model"], r["task_id"], r["seed"])
    assert sorted(map(key, here)) == sorted(map(key, there)) and len(here) == 8
    same = ("score", "success", "outcome", "llm_player_id", "turns", "illegal_moves", "parse_failed_game", "error")
    by_key = {key(r): r for r in there}
    for record in here:
        other = by_key[key(record)]
        assert {f: record[f] for f in same} == {f: other[f] for f in same}, key(record)
        # the same conversation; the env also answers a third unusable reply, which ends the game
        assert other["conversation"][:len(record["conversation"])] == record["conversation"]
        assert (record["scored_by"], other["scored_by"]) == ("in_process", "env_evaluate")
    assert any(r["illegal_moves"] < r["turns"] for r in here)  # legal moves were played, not only forfeits
    summary = json.loads((tmp_path / "env" / "summary.json").read_text())
    scores_from = summary["settings"]["scores_from"]
    assert (scores_from["path"], scores_from["env"], scores_from["llm_url"]) == (
        "env_evaluate", env_server.url, digit_vllm)
    assert scores_from["served_models"]["base"] == str(digit_model_dir)
    assert scores_from["served_models"]["adapter"].startswith("eval-")
    assert set(summary["comparison"]) == {"leduc_poker", "liars_dice", "all_games"}
    assert httpx.get(f"{digit_vllm}/models").json()["data"][1:] == []  # the adapter was unloaded at the end


def test_a_failed_env_call_and_an_api_error_are_error_episodes(tiny_model_dir, tmp_path):
    llm = ModelsServer(str(tiny_model_dir))
    answered = env_result(1.0, [SYSTEM, decision(), reply("1")])
    api_error = env_result(0.0, [SYSTEM, decision()], error="[API_ERROR] HTTP 503: the server went away")
    replies = iter([success(answered), (500, b'{"detail": "evaluate failed: RuntimeError: bug"}'), success(api_error)])
    try:
        with FakeServer(lambda method, kwargs: next(replies), methods=("evaluate",)) as env:
            code = evaluate.main(tiny_args(tiny_model_dir, "--base-only", "--task-ids", "200000000-200000002",
                                           "--set", f"env.vllm_url={llm.url}", "--env-evaluate", env.url,
                                           "--set", "generation.max_concurrent_episodes=1",
                                           "--output-dir", str(tmp_path)))
    finally:
        llm.close()
    assert code == 0
    records = read_episodes(tmp_path)
    assert [r["outcome"] for r in records] == ["win", "error", "error"]
    assert records[1]["error"].startswith("http_error: evaluate on http://127.0.0.1:")
    assert records[2]["error"] == "[API_ERROR] HTTP 503: the server went away"
    leduc = json.loads((tmp_path / "summary.json").read_text())["models"]["base"]["leduc_poker"]
    assert (leduc["episodes"], leduc["errors"], leduc["win_rate"], leduc["mean_score"]) == (3, 2, 1.0, 1.0)


def test_an_llm_server_failing_mid_run_gives_error_episodes(tiny_model_dir, env_server, tmp_path):
    """Our env server, an LLM server that answers the first game's two decisions and then only 500s."""
    llm = ModelsServer(str(tiny_model_dir), good_replies=2)
    try:
        code = evaluate.main(tiny_args(tiny_model_dir, "--base-only", "--task-ids", "200000000,200000002",
                                       "--set", f"env.vllm_url={llm.url}", "--env-evaluate", env_server.url,
                                       "--set", "generation.max_concurrent_episodes=1", "--output-dir", str(tmp_path)))
    finally:
        llm.close()
    assert code == 0
    first, second = read_episodes(tmp_path)
    assert (first["outcome"], first["score"], first["turns"]) == ("loss", 6 / 26, 2)  # Call twice from J♥: -7 chips
    assert second["outcome"] == "error" and second["error"].startswith("[API_ERROR] API call to ")
    assert second["error"].endswith("failed after 1 attempt: HTTP 500: the engine died")
    leduc = json.loads((tmp_path / "summary.json").read_text())["models"]["base"]["leduc_poker"]
    assert (leduc["episodes"], leduc["errors"], leduc["mean_score"]) == (2, 1, 6 / 26)


def test_an_image_is_started_in_docker_under_its_own_name(tiny_model_dir, tmp_path, monkeypatch):
    """affinetes' Docker start is replaced by a scripted env server standing in for the container."""
    import affinetes

    real_load_env, started = affinetes.load_env, []
    llm = ModelsServer(str(tiny_model_dir))
    answered = env_result(0.5, [SYSTEM, decision(), reply("1")])
    try:
        with FakeServer(lambda method, kwargs: success(answered), methods=("evaluate",)) as container:
            def start_container(**kwargs):
                started.append(kwargs)
                return real_load_env(mode="url", base_url=container.url)

            monkeypatch.setattr(affinetes, "load_env", start_container)
            code = evaluate.main(tiny_args(tiny_model_dir, "--base-only", "--task-ids", "200000000",
                                           "--set", f"env.vllm_url={llm.url}", "--output-dir", str(tmp_path),
                                           "--env-evaluate", "affinefoundation/game:openspiel",
                                           "--env-llm-url", "http://llm.invalid:8000/v1"))
    finally:
        llm.close()
    assert code == 0
    # not game-openspiel-r0: a training run's container of the same image keeps running
    assert [(k["image"], k["mode"], k["container_name"]) for k in started] == [
        ("affinefoundation/game:openspiel", "docker", "game-openspiel-eval-r0")]
    assert container.calls == [("evaluate", {
        "timeout": 1800.0, "task_id": 200000000, "seed": 1580322239, "opponent": "random",  # tiny_args' opponent
        "model": str(tiny_model_dir), "base_url": "http://llm.invalid:8000/v1", "temperature": 0.0,
        "api_key": "EMPTY"})]
    assert [r["outcome"] for r in read_episodes(tmp_path)] == ["draw"]


# ---------------------------------------------------------------------- bad input: one line, no traceback
def expect_one_line(capsys, code: int, status: int, *parts: str) -> None:
    err = capsys.readouterr().err
    assert code == status, err
    assert all(part in err for part in parts), err
    assert "Traceback" not in err


def test_an_env_without_evaluate_is_refused(tiny_model_dir, capsys):
    llm = ModelsServer(str(tiny_model_dir))
    try:
        with FakeServer(lambda method, kwargs: success({}), methods=("reset", "step", "state", "stop")) as env:
            code = evaluate.main(tiny_args(tiny_model_dir, "--base-only", "--games", "leduc_poker", "--set",
                                           f"env.vllm_url={llm.url}", "--env-evaluate", env.url))
            assert env.calls == []
    finally:
        llm.close()
    expect_one_line(capsys, code, 2, f"--env-evaluate {env.url} offers ['reset', 'step', 'state', 'stop'] but no "
                    "evaluate()")


def test_an_llm_url_that_does_not_serve_the_model_is_refused(tiny_model_dir, capsys):
    ours, elsewhere = ModelsServer(str(tiny_model_dir)), ModelsServer("another-model")
    try:
        with FakeServer(lambda method, kwargs: success({}), methods=("evaluate",)) as env:
            code = evaluate.main(tiny_args(tiny_model_dir, "--base-only", "--games", "leduc_poker", "--set",
                                           f"env.vllm_url={ours.url}", "--env-evaluate", env.url,
                                           "--env-llm-url", elsewhere.url))
            assert env.calls == []
    finally:
        ours.close()
        elsewhere.close()
    expect_one_line(capsys, code, 2, f"--env-llm-url {elsewhere.url} serves ['another-model'], not "
                    f"'{tiny_model_dir}'", "point both at the same vLLM server")


def test_an_llm_url_the_env_cannot_reach_stops_the_run(tiny_model_dir, env_server, capsys):
    llm = ModelsServer(str(tiny_model_dir))
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    try:
        code = evaluate.main(tiny_args(tiny_model_dir, "--base-only", "--games", "leduc_poker", "--episodes", "3",
                                       "--set", f"env.vllm_url={llm.url}", "--env-evaluate", env_server.url,
                                       "--env-llm-url", dead))
    finally:
        llm.close()
    expect_one_line(capsys, code, 2, f"--env-llm-url {dead}: the env got no reply from model", "ConnectError")


def test_a_docker_env_cannot_call_this_machines_loopback(tiny_model_dir, capsys):
    code = evaluate.main(tiny_args(tiny_model_dir, "--base-only", "--games", "leduc_poker", "--set",
                                   "env.vllm_url=http://127.0.0.1:8000/v1", "--env-evaluate",
                                   "affinefoundation/game:openspiel"))
    expect_one_line(capsys, code, 2, "--env-llm-url http://127.0.0.1:8000/v1: a Docker container cannot reach")


@pytest.mark.parametrize("args,message", [
    (["--games", "leduc_poker", "--env-llm-url", "http://h/v1"], "apply to --env-evaluate"),
    (["--games", "trace", "--env-evaluate", "http://127.0.0.1:1"], "scores game tasks only"),
    (["--games", "leduc_poker", "--env-evaluate", "http://127.0.0.1:1", "--env-timeout", "0"], "--env-timeout"),
])
def test_env_evaluate_option_errors(tiny_model_dir, args, message, capsys):
    expect_one_line(capsys, evaluate.main(tiny_args(tiny_model_dir, "--base-only", *args)), 2, message)
