"""Serve an embedded env over HTTP in the affinetes function_based format, so env work can move to other machines.

    python -m ppo_affine.envs.server --env openspiel --host 0.0.0.0 --port 8765
    python -m ppo_affine.envs.server --env trace --port 8766

Clients connect with `affinetes.load_env(mode="url", base_url="http://HOST:PORT")` (GET /methods
answers, so affinetes picks function_based) or with `mode: "url"` in the trainer's env config.
This is our own small app rather than affinetes' template server, because the template exposes
every public callable of the served module and answers `/call` for underscore names as well
(docs/protocols.md, 'The template server'); this one answers exactly reset/step/state/stop, plus for the
game env the validators' `evaluate` (a whole game against an LLM endpoint, ppo_affine/envs/llm_play.py). It
runs one process with one worker: episodes live in this process's memory. The trace env offers its `evaluate`
too (ppo_affine/envs/trace_play.py).
"""
from __future__ import annotations

import argparse
import inspect
import json
import logging
import socket
import sys
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ppo_affine.envs.base import Env
from ppo_affine.envs.llm_play import VALIDATOR_LLM_RETRIES, GameEvaluator

log = logging.getLogger("ppo_affine.envs.server")

METHODS = ("reset", "step", "state", "stop")
EVALUATE = "evaluate"  # the validators' call, served next to METHODS when an evaluator is given
GRACEFUL_SHUTDOWN_S = 5  # in-flight calls may finish; a stuck one does not hold the exit


def create_app(env: Env, env_name: str, url: str = "(in process)", evaluator: Any = None) -> FastAPI:
    """The HTTP app for one env: GET /health, GET /methods, POST /call and POST /<method> for METHODS only
    (and `evaluate` when an evaluator is given)."""
    methods = {name: getattr(env, name) for name in METHODS}
    if evaluator is not None:
        methods[EVALUATE] = evaluator.evaluate

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Said once uvicorn handles signals: a client that reacts to this line may stop us at once.
        log.info("serving %s env at %s (methods: %s; one worker; Ctrl-C stops)", env_name, url, ", ".join(methods))
        yield
        await env.close()
        if evaluator is not None:
            await evaluator.close()
        log.info("%s env closed; server stopped", env_name)

    # No OpenAPI or docs routes: the methods below are the whole surface.
    app = FastAPI(title=f"{env_name} env", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    async def invoke(name: str, args: Any, kwargs: Any) -> JSONResponse:
        method = methods.get(name) if isinstance(name, str) else None
        if method is None:
            return JSONResponse({"detail": f"Method not found: {name}"}, status_code=404)
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            return JSONResponse({"detail": "'args' must be a list and 'kwargs' an object"}, status_code=422)
        try:
            inspect.signature(method).bind(*args, **kwargs)
        except TypeError as exc:
            return JSONResponse({"detail": f"bad arguments for {name}: {exc}"}, status_code=422)
        try:
            result = await method(*args, **kwargs)
        except Exception as exc:  # the env's bug answers this call with a 500 and keeps the server up
            log.exception("%s(%s) failed", name, kwargs)
            return JSONResponse({"detail": f"{name} failed: {type(exc).__name__}: {exc}"}, status_code=500)
        return JSONResponse({"status": "success", "result": result, "error": None})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "env": env_name}

    @app.get("/methods")
    async def list_methods() -> dict[str, Any]:
        return {"methods": [
            {"name": name, "signature": str(inspect.signature(method)), "source": "Actor",
             "endpoint": f"POST /{name}"} for name, method in methods.items()
        ]}

    @app.post("/call")
    async def call(request: Request) -> JSONResponse:
        body = await _json_body(request)
        if not isinstance(body, dict) or "method" not in body:
            return JSONResponse({"detail": 'expected {"method": str, "args": list, "kwargs": object}'},
                                status_code=422)
        return await invoke(body["method"], body.get("args", []), body.get("kwargs", {}))

    def method_route(name: str):
        async def route(request: Request) -> JSONResponse:
            body = await _json_body(request)
            # affinetes' convention: {"args", "kwargs"} when either key is present, else flat kwargs
            if isinstance(body, dict) and ("args" in body or "kwargs" in body):
                return await invoke(name, body.get("args", []), body.get("kwargs", {}))
            return await invoke(name, [], body if isinstance(body, dict) else {})
        return route

    for name in methods:
        app.add_api_route(f"/{name}", method_route(name), methods=["POST"])
    return app


async def _json_body(request: Request) -> Any:
    """The request's JSON, or None for an empty or invalid body."""
    raw = await request.body()
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def build_env(args: argparse.Namespace) -> tuple[Env, Any]:
    """The env to serve, and the evaluator of its `evaluate` call (GameEvaluator, TraceEvaluator)."""
    if args.env == "openspiel":
        from ppo_affine.envs.openspiel_env import OpenSpielEnv

        settings = {"seed": args.seed, "mcts_simulations": args.mcts_simulations,
                    "opponent_search": args.opponent_search, "workers": args.workers,
                    "opponent_moves": args.opponent_moves}
        env = OpenSpielEnv(observation_format=args.format, **settings)
        # evaluate() always plays the validators' conversation, whatever --format the reset/step calls use
        games = OpenSpielEnv(observation_format="evaluate", **settings)
        return env, GameEvaluator(games, llm_retries=args.llm_retries)
    from ppo_affine.envs.trace_env import TraceEnv
    from ppo_affine.envs.trace_play import TraceEvaluator

    settings = {"source": args.source, "skip_degenerate": args.skip_degenerate, "timeout": args.execution_timeout,
                "seed": args.seed, "unsafe_rlimit_only_sandbox": args.unsafe_rlimit_only_sandbox}
    # evaluate() plays its tasks in an env of its own, as the game env's does
    return TraceEnv(**settings), TraceEvaluator(TraceEnv(**settings))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ppo_affine.envs.server", description=__doc__.split("\n")[0])
    parser.add_argument("--env", required=True, choices=("openspiel", "trace"), help="which embedded env to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    parser.add_argument("--port", type=int, default=8765, help="TCP port; 0 picks a free one (logged at start)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the env's own random choices")
    parser.add_argument("--format", choices=("evaluate", "openenv"),
                        help="openspiel: the validators' conversation (default) or the reset/step text")
    parser.add_argument("--mcts-simulations", type=int, help="openspiel: override the MCTS opponent's simulations")
    parser.add_argument("--opponent-search", choices=("fast", "exact"),
                        help="openspiel: the MCTS opponent's implementation (default fast: open_spiel's C++ search "
                        "where it is proven the same; exact: the Affine env's Python search, move for move)")
    parser.add_argument("--opponent-moves", metavar="FILE",
                        help="openspiel: record the MCTS opponent's moves in this SQLite file and replay them where "
                        "an episode repeats a recorded seed and history (the same moves: several models evaluated on "
                        "the same seeds search only where their games differ)")
    parser.add_argument("--workers", type=int,
                        help="openspiel: worker processes holding episodes, so concurrent searches use several "
                        "cores (default 0)")
    parser.add_argument("--llm-retries", type=int,
                        help=f"openspiel: evaluate() retries of a failed LLM call (default {VALIDATOR_LLM_RETRIES}, "
                        "as the real env)")
    parser.add_argument("--source", choices=("embedded", "hf"), help="trace: task source (default embedded)")
    parser.add_argument("--skip-degenerate", action="store_true",
                        help="trace: skip tasks whose expected output is empty")
    parser.add_argument("--execution-timeout", type=float, help="trace: seconds per program run (default 10)")
    parser.add_argument("--unsafe-rlimit-only-sandbox", action="store_true",
                        help="trace: run programs without bubblewrap (rlimits only: no file-system or "
                        "network isolation)")
    args = parser.parse_args(argv)
    foreign = (["--source", "--skip-degenerate", "--execution-timeout", "--unsafe-rlimit-only-sandbox"]
               if args.env == "openspiel"
               else ["--format", "--mcts-simulations", "--opponent-search", "--opponent-moves", "--workers",
                     "--llm-retries"])
    given = [flag for flag in foreign if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]
    if given:
        parser.error(f"{', '.join(given)} do not apply to --env {args.env}")
    if args.mcts_simulations is not None and args.mcts_simulations < 1:
        parser.error(f"--mcts-simulations must be >= 1, got {args.mcts_simulations}")
    if args.workers is not None and args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    if args.llm_retries is not None and args.llm_retries < 0:
        parser.error(f"--llm-retries must be >= 0, got {args.llm_retries}")
    if args.execution_timeout is not None and args.execution_timeout <= 0:
        parser.error(f"--execution-timeout must be > 0, got {args.execution_timeout}")
    args.format = args.format or "evaluate"
    args.opponent_search = args.opponent_search or "fast"
    args.workers = args.workers or 0
    args.llm_retries = VALIDATOR_LLM_RETRIES if args.llm_retries is None else args.llm_retries
    args.source = args.source or "embedded"
    args.execution_timeout = args.execution_timeout or 10.0
    return args


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio turns on TCP_NODELAY only for such sockets, and without it each
    # reply waited ~40 ms for a delayed ACK (measured 44 ms vs 1 ms per call on localhost).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may reuse the port at once
    sock.bind((host, port))
    sock.listen(socket.SOMAXCONN)
    return sock


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from ppo_affine.envs.sandbox import SandboxUnavailable

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        env, evaluator = build_env(args)
    except SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Binding here (not in uvicorn) lets --port 0 work and the start line name the real port.
    sock = listening_socket(args.host, args.port)
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if sock.family == socket.AF_INET6 else args.host
    app = create_app(env, args.env, url=f"http://{host}:{port}", evaluator=evaluator)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown (the lifespan closes the env), then
    # raises the signal again so the exit status tells how the server ended.
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
