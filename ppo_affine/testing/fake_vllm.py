"""A small OpenAI-compatible server with vLLM's LoRA endpoints, serving a local model for tests.

Implements what the trainer uses, the way vLLM documents it: `GET /v1/models`,
`POST /v1/completions` (prompt as token ids, `logprobs`, `echo`, `return_tokens_as_token_ids`, `seed`),
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (404 unless runtime LoRA updating
is on, like vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING); what an env's evaluate() uses:
`POST /v1/chat/completions` (the model's chat template, streamed or not); and `GET /test/stats`
(not vLLM's), which counts the completions served and lists every adapter name ever loaded, in order.
`--max-new-tokens N` caps every reply, like vLLM's `--override-generation-config '{"max_new_tokens": N}'`.
`--exit-after-completions N` makes the process die on receiving its Nth completion request, unanswered
(a crashed or preempted server). `--logprobs-mode` is vLLM's: `raw_logprobs` (its default) returns the model's
log-probs whatever the temperature, `processed_logprobs` those of the tempered distribution it samples; `logprobs: N`
returns the top N of them at each position beside the sampled token's (`top_logprobs`). `stop` strings end a reply
at the token that completes one, named in `stop_reason`, as vLLM's do (the text keeps it, as with
`include_stop_str_in_output`).

`--latency-seconds S` makes every completion take S seconds more of wall time and no CPU (the server sleeps), a
stand-in for a GPU server's generation time in benchmarks (bench/async_speed.py); with `--scripted` a completion
runs no model either: its reply is a legal action id read off the prompt, then EOS, each token's log-prob -1.

`--exit-once-marker FILE` makes that crash happen once (a server that is then started again serves). It also
accepts vLLM's own server flags (--host, --enable-lora, --max-loras, ...), so it can stand in for an owned server.

Run: python -m ppo_affine.testing.fake_vllm --model DIR --port P [--no-runtime-lora] [--ignore-adapters]
        [--served-model-name NAME] [--max-model-len N] [--max-new-tokens N] [--exit-after-completions N]
        [--logprobs-mode raw_logprobs|processed_logprobs] [--latency-seconds S] [--scripted]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer


def build_app(model_dir: str, runtime_lora: bool = True, ignore_adapters: bool = False, served_name: str | None = None,
              max_model_len: int = 32768, max_new_tokens: int | None = None,
              exit_after_completions: int | None = None, logprobs_mode: str = "raw_logprobs",
              latency_seconds: float = 0.0, scripted: bool = False) -> FastAPI:
    from peft import PeftModel

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = {"model": base, "adapters": {}}
    stats = {"completions": 0, "loaded": []}
    lock = threading.Lock()
    received = itertools.count(1)
    app = FastAPI()

    served_name = served_name or model_dir

    def model_for(name: str):
        if name == served_name:
            return state["model"], None
        if name not in state["adapters"]:
            raise HTTPException(404, f"The model `{name}` does not exist.")
        return state["model"], name

    @app.get("/v1/models")
    def models():
        base = {"id": served_name, "object": "model", "root": model_dir, "max_model_len": max_model_len}
        adapters = [{"id": name, "object": "model", "root": path, "parent": served_name}
                    for name, path in state["adapters"].items()]
        return {"object": "list", "data": [base] + adapters}

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request):
        if not runtime_lora:
            raise HTTPException(404, "Not Found")
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        if name in state["adapters"]:
            raise HTTPException(400, f"The lora adapter '{name}' has already been loaded.")

        def load() -> None:
            with lock:
                if not ignore_adapters:
                    if isinstance(state["model"], PeftModel):
                        state["model"].load_adapter(path, adapter_name=name)
                    else:
                        state["model"] = PeftModel.from_pretrained(state["model"], path, adapter_name=name).eval()
                state["adapters"][name] = path
                stats["loaded"].append(name)

        await asyncio.to_thread(load)
        return f"Success: LoRA adapter '{name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request):
        if not runtime_lora:
            raise HTTPException(404, "Not Found")
        name = (await request.json())["lora_name"]
        if name not in state["adapters"]:
            raise HTTPException(404, f"The lora adapter '{name}' cannot be found.")

        def unload() -> None:
            with lock:
                if not ignore_adapters and len(state["adapters"]) == 1:
                    # the last adapter: back to the bare model (a PeftModel left with no adapter cannot disable one)
                    state["model"] = state["model"].unload()
                elif not ignore_adapters:
                    state["model"].delete_adapter(name)
                del state["adapters"][name]

        await asyncio.to_thread(unload)
        return f"Success: LoRA adapter '{name}' removed successfully."

    @app.post("/v1/completions")
    async def completions(request: Request):
        if next(received) == exit_after_completions:
            os._exit(1)
        body = await request.json()
        if latency_seconds:
            await asyncio.sleep(latency_seconds)  # other requests are served meanwhile, as by a batching server
        model_for(body["model"])  # a 404 before anything else
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise HTTPException(400, "this test server takes one prompt as a list of token ids")
        if len(prompt) + int(body.get("max_tokens", 16)) > max_model_len:  # as vLLM refuses it
            raise HTTPException(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                                f"requested {len(prompt) + int(body.get('max_tokens', 16))} tokens.")
        temperature = float(body.get("temperature", 1.0))
        generator = torch.Generator().manual_seed(int(body.get("seed") or 0))

        def complete():
            with lock:  # the model is looked up again under the lock: an adapter load may have wrapped it
                model, adapter = model_for(body["model"])
                stop_ids = {tokenizer.eos_token_id, *body.get("stop_token_ids", [])}
                if scripted:
                    sampled = _scripted(tokenizer, prompt, int(body.get("max_tokens", 16)), int(body.get("seed") or 0))
                else:
                    sampled = _sample(model, adapter, prompt, int(body.get("max_tokens", 16)), temperature, stop_ids,
                                      generator, ignore_adapters, logprobs_mode)
                stats["completions"] += 1
                echoed = _prompt_logprobs(model, adapter, prompt, ignore_adapters) if body.get("echo") else None
                return (*sampled, echoed)

        # in a thread, so that /v1/models and the other endpoints answer meanwhile, as vLLM's do
        tokens, logprobs, finish, echoed = await asyncio.to_thread(complete)
        tokens, logprobs, finish, stop_reason = _cut_at_stop_string(tokenizer, tokens, logprobs, finish,
                                                                   body.get("stop") or [])
        as_ids = bool(body.get("return_tokens_as_token_ids"))

        def shown(token: int) -> str:
            return f"token_id:{token}" if as_ids else tokenizer.decode([token])

        def top(token: int, logp: torch.Tensor, n: int) -> dict[str, float]:
            """The n highest log-probs of a position and the sampled token's, as vLLM lists them."""
            return {shown(t): float(logp[t]) for t in {*logp.topk(n).indices.tolist(), token}}

        top_n = body.get("logprobs")
        if echoed is not None:  # `echo`: the prompt's tokens come first, the first one with no log-prob (null)
            logprobs_of = {"tokens": [shown(t) for t in prompt + tokens],
                           "token_logprobs": echoed + [float(logp[t]) for t, logp in zip(tokens, logprobs)],
                           "top_logprobs": [None if lp is None else {shown(t): lp} for t, lp in zip(prompt, echoed)]
                           + [top(t, logp, top_n or 0) for t, logp in zip(tokens, logprobs)], "text_offset": None}
            return {"id": "cmpl-test", "object": "text_completion", "model": body["model"], "usage": {
                "prompt_tokens": len(prompt), "completion_tokens": len(tokens)}, "choices": [{
                    "index": 0, "text": tokenizer.decode(prompt + tokens, skip_special_tokens=True),
                    "finish_reason": finish, "stop_reason": stop_reason, "logprobs": logprobs_of}]}
        choice = {
            "index": 0,
            "text": tokenizer.decode(tokens, skip_special_tokens=True),
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "logprobs": {"tokens": [shown(t) for t in tokens],
                         "token_logprobs": [float(logp[t]) for t, logp in zip(tokens, logprobs)],
                         "top_logprobs": [top(t, logp, top_n) for t, logp in zip(tokens, logprobs)],
                         "text_offset": None} if top_n is not None else None,
        }
        return {"id": "cmpl-test", "object": "text_completion", "model": body["model"], "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens)}}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await request.json()
        model_for(body["model"])  # a 404 before anything else
        text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        # like vLLM: the request's max_tokens, else what the context leaves, and never past the server's cap
        limits = [max_model_len - len(prompt), body.get("max_tokens"), max_new_tokens]
        temperature = float(body.get("temperature", 1.0))
        generator = torch.Generator().manual_seed(int(body.get("seed") or 0))

        def complete():
            with lock:
                model, adapter = model_for(body["model"])
                return _sample(model, adapter, prompt, min(v for v in limits if v is not None), temperature,
                               {tokenizer.eos_token_id}, generator, ignore_adapters, logprobs_mode)

        tokens, _, finish = await asyncio.to_thread(complete)
        content = tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id], skip_special_tokens=True)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                 "total_tokens": len(prompt) + len(tokens)}
        if not body.get("stream"):
            return {"id": "chatcmpl-test", "object": "chat.completion", "model": body["model"], "usage": usage,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                 "finish_reason": finish}]}
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": content}}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({"choices": [], "usage": usage})
        events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        return StreamingResponse(iter([events]), media_type="text/event-stream")

    @app.get("/test/stats")
    def served():
        return stats

    return app


@torch.no_grad()
def _sample(model, adapter, prompt, max_tokens, temperature, stop_ids, generator, ignore_adapters, logprobs_mode):
    """The sampled tokens, each position's log-probs over the vocabulary ([V] each; raw or of the tempered
    distribution, as `logprobs_mode` says) and the finish reason."""
    from peft import PeftModel

    is_peft = isinstance(model, PeftModel)
    if is_peft and adapter and not ignore_adapters:
        model.set_adapter(adapter)
    context = model.disable_adapter() if is_peft and (adapter is None or ignore_adapters) else _nullcontext()
    ids = torch.tensor([prompt])
    tokens, logprobs, finish = [], [], "length"
    with context:
        for _ in range(max_tokens):
            logits = model(input_ids=ids).logits[0, -1].float()
            scaled = logits / temperature if temperature > 0 else logits
            logp = torch.log_softmax(scaled, dim=-1)
            if temperature > 0:
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            else:
                token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(logp if logprobs_mode == "processed_logprobs" else torch.log_softmax(logits, dim=-1))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token in stop_ids:  # like vLLM, the stop token is part of the returned tokens
                finish = "stop"
                break
    return tokens, logprobs, finish


@torch.no_grad()
def _prompt_logprobs(model, adapter, prompt, ignore_adapters) -> list[float | None]:
    """`echo`'s prompt log-probs: log p(token i | tokens before it), None for the first token (nothing predicts it)."""
    from peft import PeftModel

    is_peft = isinstance(model, PeftModel)
    if is_peft and adapter and not ignore_adapters:
        model.set_adapter(adapter)
    context = model.disable_adapter() if is_peft and (adapter is None or ignore_adapters) else _nullcontext()
    ids = torch.tensor([prompt])
    with context:
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    return [None] + logp.gather(1, ids[0, 1:, None])[:, 0].tolist()


def _cut_at_stop_string(tokenizer, tokens, logprobs, finish, stop_strings):
    """The reply as vLLM's `stop` strings end it: at the token whose text completes the first stop string (the
    tokens after it were sampled here but never by vLLM; sampling is sequential, so those before are the same);
    `stop_reason` names that string (None otherwise)."""
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    for end in range(1, len(tokens) + 1) if stop_strings else ():
        text = tokenizer.decode(tokens[:end], skip_special_tokens=True)
        hit = next((stop for stop in stop_strings if stop in text), None)
        if hit is not None:
            return tokens[:end], logprobs[:end], "stop", hit
    return tokens, logprobs, finish, None


def _scripted(tokenizer, prompt, max_tokens, seed):
    """A legal action id off the prompt and EOS, as `_sample` returns them: no model runs; every position's
    log-probs are -1 for the sampled token, -inf elsewhere (only the sampled ones are read)."""
    from ppo_affine.testing.scripted import scripted_reply

    tokens = scripted_reply(tokenizer, prompt, seed, tokenizer.eos_token_id)[:max_tokens]
    logprobs = []
    for token in tokens:
        logp = torch.full((len(tokenizer),), float("-inf"))
        logp[token] = -1.0
        logprobs.append(logp)
    return tokens, logprobs, "stop" if tokens[-1] == tokenizer.eos_token_id else "length"


def wait_until_serving(process: subprocess.Popen, port: int, timeout: float, poll_seconds: float = 0.1) -> bool:
    """Whether an OpenAI-compatible server (this one, or vLLM) answered `/v1/models` on `port` within `timeout`
    seconds; False as soon as `process` exits."""
    import httpx

    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll_seconds)
    return False


def start(model_dir, port: int, *flags: str, timeout: float = 300.0) -> subprocess.Popen:
    """This server as a separate process on `port`, returned once `/v1/models` answers; raises RuntimeError
    with the end of its stderr if it exits or does not answer within `timeout` seconds."""
    log = tempfile.TemporaryFile()  # a file, not a pipe: a long-lived server must never block on a full pipe
    process = subprocess.Popen([sys.executable, "-m", "ppo_affine.testing.fake_vllm", "--model", str(model_dir),
                                "--port", str(port), *flags],
                               stdout=subprocess.DEVNULL, stderr=log)
    if wait_until_serving(process, port, timeout):
        return process
    process.kill()
    process.wait()
    log.seek(0)
    raise RuntimeError(f"fake vLLM server did not start on port {port}: " + log.read().decode(errors="replace")[-2000:])


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--no-runtime-lora", action="store_true")
    parser.add_argument("--ignore-adapters", action="store_true", help="accept adapters but keep serving the base")
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-new-tokens", type=int, help="cap on every reply (vLLM: --override-generation-config)")
    parser.add_argument("--exit-after-completions", type=int, help="die on receiving the Nth completion request")
    parser.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"], default="raw_logprobs",
                        help="vLLM's: the model's log-probs, or those of the tempered distribution it samples")
    parser.add_argument("--latency-seconds", type=float, default=0.0,
                        help="every completion takes this much more wall time, and no CPU")
    parser.add_argument("--scripted", action="store_true",
                        help="replies are a legal action id read off the prompt: no model runs")
    parser.add_argument("--exit-once-marker", help="with --exit-after-completions: die only if this file does not "
                        "exist yet, and create it (a server that crashes once, then serves when started again)")
    # vLLM's own flags, as an owned server (ppo_affine/vllm_server.py) passes them: accepted, and only --host used
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-loras", type=int)
    parser.add_argument("--max-lora-rank", type=int)
    parser.add_argument("--dtype")
    parser.add_argument("--gpu-memory-utilization", type=float)
    args = parser.parse_args()
    exit_after = args.exit_after_completions
    if args.exit_once_marker:
        if os.path.exists(args.exit_once_marker):
            exit_after = None
        else:
            open(args.exit_once_marker, "w").close()
    uvicorn.run(build_app(args.model, not args.no_runtime_lora, args.ignore_adapters, args.served_model_name,
                          args.max_model_len, args.max_new_tokens, exit_after, args.logprobs_mode,
                          args.latency_seconds, args.scripted),
                host=args.host, port=args.port, log_level="warning")
