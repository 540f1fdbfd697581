"""An OpenAI-compatible endpoint served from the trainer's own generator, recording what the model produced.

An env of kind `evaluate` runs its whole conversation itself (`evaluate(model, base_url, ...)`); the rollout gives
each such episode a base URL of its own, `<public url>/episodes/<id>/v1`, so that concurrent episodes never mix.
Behind it, `/chat/completions` (streamed or not, with `tools`) and `/completions` answer from the rollout's generator
(local generation or the vLLM client, with the current adapter), and every call is recorded with the exact prompt
token ids, the sampled ids, their log-probs when the generator returns them, and the adapter step that sampled them.
The rollout turns the calls into the episode's turns (`pack_calls`).

What the endpoint does as the validators' server (SGLang v0.5.14) would, so that training sees the text validation
sees:
- The messages (and the request's `tools`, as SGLang's tool model dumps them, only when tool calls are parsed) are
  rendered with the model's chat template; tool-call arguments that arrive as JSON text are given to the template
  as objects (not a JSON object: 400).
- A prompt whose render starts with an earlier call's render + that call's reply (+ its EOS) reuses that call's
  prompt ids and sampled ids and tokenises only the new text, as the native rollout does (prompts.TokenHistory): the
  model is conditioned on the tokens it sampled, and the calls pack into one training sequence.
- The reply (special tokens kept when tool calls are parsed) is cut at the request's first `stop` string
  (stop_strings.py) and split into `reasoning_content` / `content` / `tool_calls` by the model family's parsers
  with the request's settings (reply_parsers.py), whole or as streamed.
- The run's sampling settings win: temperature, top-p/top-k apply whatever the request asks (a difference is logged
  once per setting and value); the harness's `max_tokens` applies up to `generation.max_new_tokens`. Other request
  fields it does not apply are named once in the log.
- Limits: a prompt longer than `generation.max_prompt_tokens`, and an episode's calls past `generation.max_turns`,
  are answered as SGLang answers a context overflow (400), and the episode is cut off (`EpisodeCalls.cut_off`).
- A streamed request gets its reply as server-sent events once it is generated (the generator returns whole
  replies): a role chunk, the reasoning, the content, the tool calls, the finish reason, usage when asked, [DONE].
- At most `generation.max_concurrent_episodes` calls generate at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ppo_affine.config import Config, EndpointConfig, GenerationConfig
from ppo_affine.prompts import PromptBuilder
from ppo_affine.reply_parsers import (ReplyFormat, parse_reply, parses_tool_calls, reply_format_of, settings_of,
                                      stream_reply)
from ppo_affine.seeds import derive_seed
from ppo_affine.stop_strings import stop_strings_of, tokens_until_stop, trim_at_stop

log = logging.getLogger(__name__)

SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
# request fields the endpoint applies (or that change nothing at their usual values, below); any other field a
# harness sends is named once in the log, never silently dropped
APPLIED_FIELDS = {"messages", "prompt", "model", "tools", "tool_choice", "stream", "stream_options", "stop",
                  "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "chat_template_kwargs",
                  "reasoning_effort", "separate_reasoning", "skip_special_tokens", "user"}  # user: metadata only
NEUTRAL_VALUES = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
                  "logprobs": (False, None), "top_logprobs": (0, None), "parallel_tool_calls": (True, None),
                  "stream_reasoning": (True,), "echo": (False,), "min_p": (0, 0.0)}
SHUTDOWN_GRACE_S = 2  # a harness still streaming when the run ends is cut off after this


class EndpointUnused(RuntimeError):
    """No evaluate() episode of a step called the endpoint: the env talks to another model."""


@dataclass
class CallRecord:
    """One completion the endpoint served: what the model saw and sampled."""
    index: int  # the episode's n-th request
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    adapter_step: int | None
    text: str  # the reply decoded (special tokens skipped)
    finish_reason: str
    render: str | None = None  # a chat call's prompt text, for the next call's splice; None: /completions
    eos_text: str = ""  # the EOS token's text when the reply ended with one (the template writes it after the reply)
    request: dict[str, Any] | None = None  # a chat call's request body, for re-rendering it (episodes.py)
    parsed: dict[str, Any] | None = None  # the message it answered: reasoning_content, content, tool_calls


@dataclass
class EpisodeCalls:
    """One episode's door to the endpoint: its base URL and the calls made through it."""
    key: str
    order_key: int  # the episode's place in the step's batch: its KV cache and vLLM server
    seed_parts: tuple[int, ...]  # call n samples with derive_seed(*seed_parts, n)
    url: str
    calls: list[CallRecord] = field(default_factory=list)
    requested: int = 0
    limits: list[str] = field(default_factory=list)  # each call refused at a limit: "context" or "max_turns"

    @property
    def cut_off(self) -> str | None:
        """The limit that cut this episode off (the first one hit), or None."""
        return self.limits[0] if self.limits else None


def endpoint_for(config: Config, generator, prompts: PromptBuilder, model_type: str | None) -> "ChatEndpoint | None":
    """The endpoint a run with envs of kind `evaluate` serves (None without any), parsing replies as the
    validators' server does for `model_type`."""
    if not any(spec.kind == "evaluate" for spec in config.env.envs.values()):
        return None
    return ChatEndpoint(generator, prompts, config.train.generation, reply_format_of(model_type),
                        config.train.model.name_or_path, config.env.endpoint)


def pack_calls(calls: list[CallRecord]) -> tuple[list[list[int]], list[tuple[int, int]], int]:
    """(sequences, each call's (sequence, start of its reply), prefix breaks). A call whose prompt extends an
    earlier sequence (prompt + reply so far) token for token continues it; any other call after the first starts a
    sequence of its own and is a prefix break (the harness re-rendered or edited the history)."""
    sequences: list[list[int]] = []
    placements: list[tuple[int, int]] = []
    breaks = 0
    for n, call in enumerate(calls):
        prompt = call.prompt_ids
        target = next((s for s in reversed(range(len(sequences)))
                       if len(prompt) >= len(sequences[s]) and prompt[:len(sequences[s])] == sequences[s]), None)
        if target is None:
            breaks += n > 0
            sequences.append([])
            target = len(sequences) - 1
        sequences[target] = list(prompt) + list(call.token_ids)
        placements.append((target, len(prompt)))
    return sequences, placements, breaks


class ChatEndpoint:
    """`/episodes/<id>/v1/{models,chat/completions,completions}` over `generator`, on `settings.host:port`."""

    def __init__(self, generator, prompts: PromptBuilder, gen_cfg: GenerationConfig, reply_format: ReplyFormat,
                 model_name: str, settings: EndpointConfig):
        self.generator = generator
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        # a call's render and tokenisation run on a worker thread of their own, with a tokenizer of their own (the
        # event loop's keeps launching decode steps and decoding replies meanwhile; fast tokenizers are not safe to
        # share across threads), rendering and tokenising exactly as `prompts` does
        self.worker_prompts = PromptBuilder(copy.deepcopy(prompts.tokenizer), prompts.max_prompt_tokens,
                                            prompts.chat_template_kwargs)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="endpoint-render")
        self.cfg = gen_cfg
        self.reply_format = reply_format
        self.model_name = model_name
        self.settings = settings
        self.episodes: dict[str, EpisodeCalls] = {}
        self.app = self._build_app()
        self._slots = asyncio.Semaphore(gen_cfg.max_concurrent_episodes)
        self._server = None
        self._serving: asyncio.Task | None = None
        self._warned: set[tuple[str, Any]] = set()
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle and episodes
    @property
    def public_url(self) -> str:
        return (self.settings.public_url or f"http://{self.settings.host}:{self.port}").rstrip("/")

    async def start(self) -> None:
        """Listen (once per event loop); returns when the server accepts connections."""
        loop = asyncio.get_running_loop()
        if self._serving is not None and not self._serving.done() and self._serving.get_loop() is loop:
            return
        import uvicorn

        from ppo_affine.envs.server import listening_socket

        class _Server(uvicorn.Server):
            # the trainer's own SIGINT/SIGTERM handling (a flag, a checkpoint) must stay in place
            def capture_signals(self):
                return contextlib.nullcontext()

        sock = listening_socket(self.settings.host, self.settings.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        self._server = _Server(config)
        self._slots = asyncio.Semaphore(self.cfg.max_concurrent_episodes)  # of this loop
        self._serving = loop.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises what stopped it
                raise RuntimeError(f"the endpoint on {self.settings.host}:{self.port} stopped at start")
            await asyncio.sleep(0.01)
        log.info("endpoint for evaluate() envs at %s/episodes/<id>/v1", self.public_url)

    async def close(self) -> None:
        serving, self._serving = self._serving, None
        if serving is not None and not serving.done() and serving.get_loop() is asyncio.get_running_loop():
            self._server.should_exit = True
            await asyncio.gather(serving, return_exceptions=True)

    def open_episode(self, order_key: int, seed_parts: tuple[int, ...]) -> EpisodeCalls:
        key = f"{order_key}-{uuid.uuid4().hex[:10]}"
        door = EpisodeCalls(key, order_key, seed_parts, f"{self.public_url}/episodes/{key}/v1")
        self.episodes[key] = door
        return door

    def close_episode(self, door: EpisodeCalls) -> list[CallRecord]:
        """The episode's calls in request order; later requests on its URL are answered 404."""
        self.episodes.pop(door.key, None)
        return sorted(door.calls, key=lambda call: call.index)

    # ------------------------------------------------------------------ serving one call
    async def chat(self, door: EpisodeCalls, body: dict[str, Any]) -> tuple[CallRecord, dict[str, Any]] | dict:
        """A chat completion: (the record, the message fields), or an error body (see `_error`)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return _error(400, "'messages' must be a non-empty list of message objects")
        loop = asyncio.get_running_loop()
        try:
            render, template_kwargs = await loop.run_in_executor(self._worker, render_request, self.worker_prompts,
                                                                 body)
        except Exception as exc:  # the template refused these messages (e.g. roles out of order), or bad arguments
            return _error(400, f"the chat template cannot render these messages: {type(exc).__name__}: {exc}")
        prompt_ids = await loop.run_in_executor(self._worker, self._spliced, door, render)
        # as SGLang: special tokens stay in the reply's text when its tool calls are parsed
        keep_special = parses_tool_calls(body) or body.get("skip_special_tokens", True) is False
        record = await self._generate(door, body, prompt_ids, keep_special)
        if isinstance(record, dict):
            return record
        record.render, record.request = render, body
        parse = stream_reply if body.get("stream") else parse_reply
        parsed = parse(record.text, self.reply_format, settings_of(body, template_kwargs), record.finish_reason,
                       f"call_{door.key}_{record.index}")
        record.finish_reason = parsed.finish_reason
        record.parsed = {"reasoning_content": parsed.reasoning_content, "content": parsed.content,
                         "tool_calls": parsed.tool_calls}
        door.calls.append(record)
        message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls or None}
        if self.reply_format.reasoning:
            message["reasoning_content"] = parsed.reasoning_content
        return record, message

    async def complete(self, door: EpisodeCalls, body: dict[str, Any]) -> CallRecord | dict:
        """A text completion of `prompt` (text, or token ids) with no template."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokenizer = self.worker_prompts.tokenizer
            prompt_ids = await asyncio.get_running_loop().run_in_executor(
                self._worker, lambda: list(tokenizer(prompt)["input_ids"]))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        else:
            return _error(400, "'prompt' must be a string or a list of token ids (one prompt per request)")
        record = await self._generate(door, body, prompt_ids)
        if not isinstance(record, dict):
            door.calls.append(record)
        return record

    def _spliced(self, door: EpisodeCalls, render: str) -> list[int]:
        """The prompt ids: an earlier call's prompt and sampled ids + the new text's, where the render extends that
        call's render and reply (latest call first); else the render tokenised."""
        for call in reversed(door.calls):
            if call.render is None:
                continue
            before = call.render + call.text + call.eos_text
            if len(render) > len(before) and render.startswith(before):
                return call.prompt_ids + call.token_ids + self.worker_prompts.tokenize(render[len(before):])
        return self.worker_prompts.tokenize(render)

    async def _generate(self, door: EpisodeCalls, body: dict[str, Any], prompt_ids: list[int],
                        keep_special: bool = False) -> CallRecord | dict:
        if body.get("n", 1) != 1:
            return _error(400, f"n={body.get('n')}: this endpoint samples one reply per request")
        limit = self.cfg.max_prompt_tokens
        if len(prompt_ids) > limit:  # SGLang's own answer to a context overflow, with the run's prompt budget
            door.limits.append("context")
            return _error(400, f"The input ({len(prompt_ids)} tokens) is longer than the model's context length "
                          f"({limit} tokens).")
        if door.requested >= self.cfg.max_turns:  # a harness that never stops: a server limit too, as natively
            door.limits.append("max_turns")
            return _error(400, f"The input is longer than the model's context length: this episode has made "
                          f"{door.requested} model calls, the trainer's limit (generation.max_turns="
                          f"{self.cfg.max_turns}).")
        self._note_sampling(body)
        self._note_unsupported(body)
        index = door.requested
        door.requested += 1
        try:
            async with self._slots:
                generation = await self.generator.generate(prompt_ids, order_key=door.order_key,
                                                           seed=derive_seed(*door.seed_parts, index))
        except Exception as exc:  # the harness hears of it as from a server; the run goes on (or stops) by its rules
            log.warning("endpoint: generation for episode %s failed: %s: %s", door.key, type(exc).__name__, exc)
            return _error(500, f"generation failed: {type(exc).__name__}: {exc}")
        record = self._record(index, prompt_ids, generation, stop_strings_of(body), keep_special)
        return self._within(record, self._reply_cap(body), keep_special)

    def _reply_cap(self, body: dict[str, Any]) -> int:
        """The harness's `max_completion_tokens` / `max_tokens`, at most the run's generation.max_new_tokens (which
        applies when it asks for none or more; logged once per value when it binds)."""
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        cap = self.cfg.max_new_tokens
        if isinstance(asked, int) and not isinstance(asked, bool) and 0 < asked <= cap:
            return asked
        if ("max_tokens", asked) not in self._warned:
            self._warned.add(("max_tokens", asked))
            asked_for = "no max_tokens" if asked is None else f"max_tokens={asked}"
            log.warning("an evaluate() harness asked for %s; the run's cap generation.max_new_tokens=%d applies",
                        asked_for, cap)
        return cap

    def _within(self, record: CallRecord, cap: int, keep_special: bool) -> CallRecord:
        """The reply cut to the harness's own token limit (the generator sampled up to the run's): the first `cap`
        tokens are what a server told `max_tokens=cap` samples, and the reply finishes with "length"."""
        if len(record.token_ids) <= cap:
            return record
        ids = record.token_ids[:cap]
        return CallRecord(index=record.index, prompt_ids=record.prompt_ids, token_ids=ids,
                          logprobs=None if record.logprobs is None else list(record.logprobs[:cap]),
                          adapter_step=record.adapter_step,
                          text=self.tokenizer.decode(ids, skip_special_tokens=not keep_special), finish_reason="length")

    def _record(self, index: int, prompt_ids: list[int], generation, stops: list[str], keep_special: bool) -> CallRecord:
        """The call as the server returns it: the end-of-sequence token trimmed from the text, the reply cut at the
        first stop string the request names (stop_strings.py), `finish_reason` "length" at the token limit."""
        ids, logprobs = list(generation.token_ids), generation.logprobs
        ends_with_eos = bool(ids) and ids[-1] in self.generator.eos_ids
        reply_ids = ids[:-1] if ends_with_eos else ids

        def decode(part: list[int]) -> str:
            return self.tokenizer.decode(part, skip_special_tokens=not keep_special)

        cut = tokens_until_stop(reply_ids, decode, stops)
        if cut is not None:
            kept, stop = cut
            return CallRecord(index=index, prompt_ids=list(prompt_ids), token_ids=ids[:kept],
                              logprobs=None if logprobs is None else list(logprobs[:kept]),
                              adapter_step=generation.adapter_step, text=trim_at_stop(decode(ids[:kept]), stop),
                              finish_reason="stop")
        finish = "length" if not ends_with_eos and len(ids) >= self.cfg.max_new_tokens else "stop"
        return CallRecord(index=index, prompt_ids=list(prompt_ids), token_ids=ids, logprobs=logprobs,
                          adapter_step=generation.adapter_step, text=decode(reply_ids), finish_reason=finish,
                          eos_text=self.prompts.token_text(ids[-1]) if ends_with_eos else "")

    def _note_unsupported(self, body: dict[str, Any]) -> None:
        """Name once each request field the endpoint does not apply (`seed`: calls sample with the run's seeds;
        `tool_choice` "required" or a named tool: generation is not constrained to a call)."""
        for name, value in body.items():
            if name in APPLIED_FIELDS or value in NEUTRAL_VALUES.get(name, ()) or ("field", name) in self._warned:
                continue
            self._warned.add(("field", name))
            log.warning("an evaluate() harness sent %s=%s, which this endpoint does not apply", name,
                        json.dumps(value)[:80])
        choice = body.get("tool_choice")
        if (choice == "required" or isinstance(choice, dict)) and ("field", "tool_choice") not in self._warned:
            self._warned.add(("field", "tool_choice"))
            log.warning("an evaluate() harness sent tool_choice=%s: the reply is parsed as SGLang parses it, but "
                        "generation is not constrained to a tool call", json.dumps(choice)[:80])

    def _note_sampling(self, body: dict[str, Any]) -> None:
        """Log once per setting and value where the harness asks for other sampling than the run's."""
        for requested, ours in SAMPLING_FIELDS.items():
            value = body.get(requested)
            run_value = getattr(self.cfg, ours)
            if value is None or value == run_value or (requested, value) in self._warned:
                continue
            self._warned.add((requested, value))
            log.warning("an evaluate() harness asked for %s=%s; the run's generation.%s=%s applies", requested, value,
                        ours, run_value)

    # ------------------------------------------------------------------ HTTP
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="ppo-affine endpoint", openapi_url=None, docs_url=None, redoc_url=None)

        def door_of(key: str) -> EpisodeCalls | None:
            return self.episodes.get(key)

        def missing(key: str) -> JSONResponse:
            body = _error(404, f"no live episode {key!r}: use the base_url the trainer passed to evaluate() while "
                          "its episode runs")
            return JSONResponse(body, status_code=404)

        async def json_body(request: Request) -> dict[str, Any] | None:
            try:
                body = json.loads(await request.body() or b"null")
            except ValueError:
                return None
            return body if isinstance(body, dict) else None

        @app.get("/episodes/{key}/v1/models")
        async def models(key: str):
            if door_of(key) is None:
                return missing(key)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "ppo-affine"}]}

        async def episode_call(key: str, request: Request):
            """The episode's door and the request's JSON body, or the error response to send instead."""
            door, body = door_of(key), await json_body(request)
            if door is None:
                return missing(key), None, None
            if body is None:
                return JSONResponse(_error(400, "the request body must be a JSON object"), status_code=400), None, None
            return None, door, body

        @app.post("/episodes/{key}/v1/chat/completions")
        async def chat_completions(key: str, request: Request):
            refused, door, body = await episode_call(key, request)
            if refused is not None:
                return refused
            answer = await self.chat(door, body)
            if isinstance(answer, dict):
                return JSONResponse(answer, status_code=answer["code"])
            record, message = answer
            if body.get("stream"):
                return StreamingResponse(_sse(self._chat_chunks(record, message, body)), media_type="text/event-stream")
            return self._chat_response(record, message)

        @app.post("/episodes/{key}/v1/completions")
        async def completions(key: str, request: Request):
            refused, door, body = await episode_call(key, request)
            if refused is not None:
                return refused
            record = await self.complete(door, body)
            if isinstance(record, dict):
                return JSONResponse(record, status_code=record["code"])
            if body.get("stream"):
                return StreamingResponse(_sse(self._completion_chunks(record, body)), media_type="text/event-stream")
            return {**self._head("text_completion"), "usage": _usage(record),
                    "choices": [{"index": 0, "text": record.text, "finish_reason": record.finish_reason,
                                 "logprobs": None}]}

        return app

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": self.model_name}

    def _chat_response(self, record: CallRecord, message: dict[str, Any]) -> dict[str, Any]:
        return {**self._head("chat.completion"), "usage": _usage(record),
                "choices": [{"index": 0, "message": message, "finish_reason": record.finish_reason, "logprobs": None}]}

    def _chat_chunks(self, record: CallRecord, message: dict[str, Any], body: dict[str, Any]) -> list[dict[str, Any]]:
        head = self._head("chat.completion.chunk")
        deltas = [{"role": "assistant", "content": ""}]
        if message.get("reasoning_content"):
            deltas.append({"reasoning_content": message["reasoning_content"]})
        if message.get("content"):
            deltas.append({"content": message["content"]})
        if message.get("tool_calls"):
            deltas.append({"tool_calls": [{"index": n, **call} for n, call in enumerate(message["tool_calls"])]})
        chunks = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas]
        chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": record.finish_reason}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": _usage(record)})
        return chunks

    def _completion_chunks(self, record: CallRecord, body: dict[str, Any]) -> list[dict[str, Any]]:
        head = self._head("text_completion")
        chunks = [{**head, "choices": [{"index": 0, "text": record.text, "finish_reason": None, "logprobs": None}]},
                  {**head, "choices": [{"index": 0, "text": "", "finish_reason": record.finish_reason,
                                        "logprobs": None}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": _usage(record)})
        return chunks


def _sse(chunks: list[dict[str, Any]]):
    async def events():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    return events()


def _usage(record: CallRecord) -> dict[str, int]:
    prompt, completion = len(record.prompt_ids), len(record.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _error(code: int, message: str) -> dict[str, Any]:
    """An error body as SGLang sends it (its ErrorResponse: not nested under "error")."""
    kind = {400: "BadRequest", 404: "NotFoundError"}.get(code, "InternalServerError")
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


def render_request(prompts: PromptBuilder, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A chat request's prompt text and the chat-template kwargs it was rendered with (the run's win over the
    request's); raises what the template raises."""
    template_kwargs = {**request_template_kwargs(body), **prompts.chat_template_kwargs}
    messages = [_for_template(m) for m in body["messages"]]
    tools = tools_for_template(body)
    if not tools and template_kwargs == prompts.chat_template_kwargs:
        return prompts.render(messages), template_kwargs  # the native rollout's render, so both see the same text
    render = prompts.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                   **template_kwargs)
    return render, template_kwargs


def request_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-template kwargs a request asks for, as SGLang builds them: its `chat_template_kwargs`, its
    `reasoning_effort`, and `reasoning_effort: "none"` switching thinking off unless the kwargs say otherwise."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("reasoning_effort") is not None:
        kwargs = {"reasoning_effort": body["reasoning_effort"], **kwargs}
    if body.get("reasoning_effort") == "none":
        kwargs.setdefault("enable_thinking", False)
    return kwargs


def tools_for_template(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's tools as SGLang hands them to the chat template: only when its tool calls are parsed, each
    re-written through its tool model (`{"type", "function": {"description", "name", "parameters", "strict"},
    "defer_loading"}`, other keys dropped), only the named one when `tool_choice` names one."""
    if not parses_tool_calls(body):
        return None
    named = body.get("tool_choice") if isinstance(body.get("tool_choice"), dict) else None
    tools = []
    for tool in body["tools"]:
        function = tool.get("function") or {}
        if named is not None and function.get("name") != (named.get("function") or {}).get("name"):
            continue
        defer_loading = tool.get("defer_loading")
        as_model = {"description": function.get("description"), "name": function.get("name"),
                    "parameters": function.get("parameters"), "strict": function.get("strict", False)}
        function_defer = defer_loading if function.get("defer_loading") is None else function["defer_loading"]
        if function_defer is not None:
            as_model["defer_loading"] = function_defer
        tools.append({"type": tool.get("type", "function"), "function": as_model, "defer_loading": defer_loading})
    return tools


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A request's message as SGLang gives it to the chat template: text parts joined (a tool result's with spaces),
    no content as "", an assistant's tool-call arguments (JSON text) as an object; arguments that are not a JSON
    object are refused (ValueError), as SGLang refuses them."""
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        texts = [part if isinstance(part, str) else part.get("text", "") for part in content
                 if isinstance(part, str) or isinstance(part, dict)]
        message["content"] = (" " if message.get("role") == "tool" else "").join(texts)
    elif content is None:
        message["content"] = ""
    if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
        message["tool_calls"] = [_call_for_template(call) for call in message["tool_calls"]]
    return message


def _call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        raise ValueError("Assistant tool call function.arguments must be valid JSON.") from None
    if not isinstance(arguments, dict):
        raise ValueError("Assistant tool call function.arguments must be a JSON object.")
    return {**call, "function": {**function, "arguments": arguments}}
