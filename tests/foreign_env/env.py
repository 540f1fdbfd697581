"""A foreign env for the tests: a sum quiz whose evaluate() runs its own multi-turn conversation against an
OpenAI-compatible endpoint, as SWE-INFINITE-like harnesses do. Served by affinetes' own template server
(serve.py beside it).

Task `t` asks for a + b with a = t % 10, b = (t // 10) % 10. Every request streams and offers the tool `add`. Call 1
asks; call 2 sends the tool's results (or a nudge when the model called none): it extends call 1. Call 3 re-renders
the history (the question asked again with the last answer quoted), so its prompt does not extend call 2's: a
prefix break. Score 1 when the last reply's content holds the sum, else up to 0.5 by its length (40 characters or
more: 0.5), so that even an untrained model's episodes score apart and an update has a signal. `fault` makes the
call fail the ways the trainer must survive: "raise", "no_score", "error", "no_call" (a score without calling).
"""
import json as _json

import httpx as _httpx

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
SYSTEM = "You answer sums. You may call the add tool."


class Actor:
    async def evaluate(self, task_id=0, seed=None, model="m", base_url="http://127.0.0.1/v1", api_key=None,
                       temperature=None, timeout=60, fault=None):
        a, b = int(task_id) % 10, (int(task_id) // 10) % 10
        if fault == "raise":
            raise RuntimeError("the quiz broke")
        if fault == "no_call":
            return {"task_name": "quiz", "score": 1.0, "success": True}
        question = f"What is {a} + {b}?"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        async with _httpx.AsyncClient(base_url=base_url, timeout=timeout,
                                      headers={"Authorization": f"Bearer {api_key or 'EMPTY'}"}) as client:
            reply = await _chat(client, model, messages, seed, temperature)
            messages.append(reply)
            if reply.get("tool_calls"):
                for call in reply["tool_calls"]:
                    arguments = _json.loads(call["function"]["arguments"])
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": str(int(arguments.get("a", 0)) + int(arguments.get("b", 0)))})
            else:
                messages.append({"role": "user", "content": "Use the add tool, or give the sum."})
            reply = await _chat(client, model, messages, seed, temperature)
            messages.append(reply)
            # the history re-rendered: the question again, the last answer quoted
            messages = [messages[0], {"role": "user", "content": f"{question} You said: {reply.get('content') or ''}. "
                                                                 "Give the sum alone."}]
            reply = await _chat(client, model, messages, seed, temperature)
            messages.append(reply)
        if fault == "no_score":
            return {"task_name": "quiz", "extra": {"conversation": messages}}
        if fault == "error":
            return {"task_name": "quiz", "score": 0.0, "error": "[API_ERROR] the quiz lost its model",
                    "extra": {"conversation": messages}}
        content = reply.get("content") or ""
        score = 1.0 if str(a + b) in content else 0.5 * min(1.0, len(content) / 40)
        return {"task_name": "quiz", "score": score, "success": score == 1.0, "extra": {"conversation": messages}}


async def _chat(client, model, messages, seed, temperature):
    """One streamed chat completion with the tool offered; the assistant message it gave."""
    payload = {"model": model, "messages": messages, "tools": TOOLS, "stream": True,
               "stream_options": {"include_usage": True}, "seed": seed, "max_tokens": 64}
    if temperature is not None:
        payload["temperature"] = temperature
    content, calls = [], {}
    async with client.stream("POST", "/chat/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = _json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                for part in delta.get("tool_calls") or []:
                    call = calls.setdefault(part["index"], {"id": part.get("id"), "type": "function",
                                                            "function": {"name": "", "arguments": ""}})
                    call["function"]["name"] += part.get("function", {}).get("name") or ""
                    call["function"]["arguments"] += part.get("function", {}).get("arguments") or ""
    message = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    return message
