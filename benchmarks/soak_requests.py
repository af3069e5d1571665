"""What `soak.py` sends and how it reads the answers: the checked normal
requests, the malformed and oversized ones with the status each must get,
and a parser for whole and streamed answers."""

from __future__ import annotations

import json
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
MIB = 1 << 20


def normal_requests() -> dict[str, tuple[str, dict[str, Any]]]:
    """The checked requests: name -> (route, body). Greedy or seeded, so
    each has one right answer."""
    chat = [{"role": "user", "content": "Name three colours of the sea, one per line."}]
    story = "Once upon a time, in a small village by the sea, there lived"
    return {
        "chat": (CHAT, {"messages": chat, "max_tokens": 24, "temperature": 0}),
        "chat-stream": (CHAT, {"messages": chat, "max_tokens": 24, "temperature": 0, "stream": True,
                               "stream_options": {"include_usage": True}}),
        # what most traffic is: a sampled chat stream of a few dozen tokens
        "chat-stream-sampled": (CHAT, {"messages": [{"role": "user", "content": "Tell me about the sea."}],
                                       "max_tokens": 64, "temperature": 0.8, "seed": 5, "stream": True}),
        "completion-n2-seeded": (COMPLETIONS, {"prompt": story, "max_tokens": 16, "n": 2,
                                               "temperature": 0.9, "seed": 7}),
        "completion-n2-seeded-stream": (COMPLETIONS, {"prompt": story, "max_tokens": 16, "n": 2,
                                                      "temperature": 0.9, "seed": 11, "stream": True}),
        "json-schema": (CHAT, {"messages": [{"role": "user", "content": "A person as JSON."}],
                               "max_tokens": 48, "temperature": 0,
                               "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "p", "schema": SCHEMA}}}),
        "logprobs-stream": (CHAT, {"messages": chat, "max_tokens": 16, "temperature": 0, "stream": True,
                                   "logprobs": True, "top_logprobs": 2}),
        "stop-strings": (COMPLETIONS, {"prompt": story, "max_tokens": 32, "temperature": 0,
                                       "stop": ["sea,", "\n\n"]}),
        "slow-reader": (COMPLETIONS, {"prompt": story, "max_tokens": 48, "temperature": 0,
                                      "stream": True, "ignore_eos": True}),
    }


#: checked for coming whole (every choice, its finish reason, [DONE]), not
#: for equal text: a sampled 64-token stream is the same text only while its
#: steps run in batches of the same shapes (float16 rounds differently in
#: another, and a near tie taken the other way changes every token after it;
#: a 30-minute run saw every one of 1,399 differ from the reference taken
#: alone, all in the same way)
WHOLE_NOT_EQUAL = frozenset({"chat-stream-sampled"})

#: small malformed requests: (route, body, the status it must get)
MALFORMED = [
    (CHAT, b'{"model": "soak", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}', 400),
    (CHAT, b'{"model": "soak", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400),
    (CHAT, b'{"model": "soak", "messages": [', 400),
    (CHAT, b'{"model": "soak", "messages": []}', 400),
    (COMPLETIONS, b'{"model": "soak", "prompt": [999999999]}', 400),
    (CHAT, b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404),
    (CHAT, b'{"model": "soak", "messages": [{"role": "user", "content": "hi"}], "n": 1000}', 400),
]


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": "soak", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       **fields}).encode()


def _schema(schema: Any) -> bytes:
    return _chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def oversized_and_malformed(max_body_size: int) -> list[tuple[str, bytes, int]]:
    """One pass of the malformed loop, as clients send such things: bodies up
    to the size limit and past it, million-character strings, deeply nested
    JSON, schemas the grammar compiler refuses, wrong types. (route, body,
    the status it must get)."""
    words = lambda n: "word " * (n // 5)  # noqa: E731
    big = [
        (CHAT, _chat(messages=[{"role": "user", "content": words(size)}]), 400)
        for size in (MIB, 2 * MIB, max_body_size - 4096)  # more text than the limit on characters
    ]
    return [
        *big,
        (CHAT, b"x" * (max_body_size + 1), 413),
        (CHAT, _chat(messages=[{"role": "user", "content": "a" * 999_000}]), 400),  # over the context
        (COMPLETIONS, json.dumps({"model": "soak", "prompt": "\u00e9t\u00e9 " * 240_000}).encode(), 400),
        (CHAT, _chat(messages=[{"role": "user", "content": "x"}] * 40_000), 400),
        (CHAT, b'{"model": "soak", "messages": ' + _nested(100_000) + b"}", 400),
        (CHAT, _chat()[:-1] + b', "extra": ' + _nested(50_000) + b"}", 400),
        (CHAT, b"[" * MIB, 400),
        (CHAT, _chat(logit_bias={str(i): 1 for i in range(100_000)}), 400),
        (CHAT, _chat(user="u" * 2_000_000, temperature="hot"), 400),
        (CHAT, _chat(stop="s" * 100_000, max_tokens=-1), 400),
        (CHAT, _schema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(30_000)}}), 400),
        (CHAT, _schema({"$ref": "#/$defs/missing"}), 400),
        (CHAT, _schema({"type": "string", "pattern": "(("}), 400),
        (CHAT, _schema({"anyOf": [{"$ref": "#"}]}), 400),
        (CHAT, _schema({"type": "array", "minItems": 5, "maxItems": 1}), 400),
        (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}], tool_choice="required"), 400),
        (CHAT, _chat(messages=[{"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{" * 500_000}}]}]), 400),
        (CHAT, _chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 1_000_000}}]}]), 400),
        (CHAT, _chat(metadata={f"k{i}": "v" for i in range(50_000)}, n=10**9), 400),
        (CHAT, _chat(messages="hi"), 400),
        (CHAT, _chat(top_p=5), 400),
        (CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400),
        *((route, body, status) for route, body, status in MALFORMED),
    ]


def parse(route: str, body: dict[str, Any], status: int, data: bytes) -> dict[str, Any]:
    """An answer as {choices: {index: text}, finish: {index: reason},
    logprobs: count, error: type or None}, streamed or not."""
    result: dict[str, Any] = {"status": status, "choices": {}, "finish": {}, "logprobs": 0, "error": None,
                              "done": False}
    if status != 200:
        try:
            result["error"] = json.loads(data)["error"]["type"]
        except (ValueError, KeyError, TypeError):
            result["error"] = f"not OpenAI's error shape: {data[:200]!r}"
        return result
    chat = route == CHAT
    if body.get("stream"):
        for line in data.split(b"\n"):
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):]
            if payload == b"[DONE]":
                result["done"] = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                result["error"] = chunk["error"]["type"]
                continue
            for choice in chunk["choices"]:
                text = (choice["delta"].get("content") or "") if chat else choice["text"]
                result["choices"][choice["index"]] = result["choices"].get(choice["index"], "") + text
                if choice.get("finish_reason"):
                    result["finish"][choice["index"]] = choice["finish_reason"]
                if choice.get("logprobs"):
                    entries = choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]
                    result["logprobs"] += len(entries)
        return result
    answer = json.loads(data)
    result["done"] = True
    for choice in answer["choices"]:
        result["choices"][choice["index"]] = choice["message"]["content"] if chat else choice["text"]
        result["finish"][choice["index"]] = choice["finish_reason"]
        if choice.get("logprobs"):
            entries = choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]
            result["logprobs"] += len(entries)
    result["usage"] = answer.get("usage")
    return result
