"""Ollama's `POST /api/chat` and `POST /api/generate` bodies, typed: each is
read into its own request type (`OllamaChatRequest`, `OllamaGenerateRequest`)
holding Ollama's fields alone, which becomes (`to_chat`) the `ChatRequest`
the hooks see (`request.endpoint` "ollama.chat" or "ollama.generate", the
Ollama request its `origin`). A generate request's prompt is the user turn
of a chat, the model's template applied as Ollama applies it.

`options` is read field by field and fails closed like the body: a sampling
option acts (`num_predict`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`,
`stop`, `repeat_penalty`, `presence_penalty`, `frequency_penalty`), a
load-time one is the server's and is accepted (`num_ctx` up to the model's
context, `num_thread`, `num_gpu`, ...), one that would change sampling in a
way this server does not is refused unless it asks for nothing (`mirostat:
0`, `typical_p: 1`), and an unknown one is a 400. Defaults are lockgate's,
as on its other APIs (temperature 1, no top-k), not Ollama's.

Ollama's tool calls carry no ids: an assistant turn's calls get them here
(`call_<turn>_<n>`), and each `tool` turn answers the earliest call not yet
answered, of its `tool_name` where it gives one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from lockgate.errors import InvalidRequestError, UnsupportedParameter
from lockgate.plugin_api.body import param, read_fields
from lockgate.plugin_api.embeddings import EmbeddingRequest, embedding_inputs
from lockgate.plugin_api.fields import OLLAMA_CHAT, OLLAMA_EMBED, OLLAMA_GENERATE, STRICT, FieldPolicy, check_fields
from lockgate.plugin_api.readers import (
    Message,
    OutputFormat,
    boolean,
    integer,
    json_object,
    json_type,
    read_arguments,
    read_reasoning_effort,
    read_response_format,
    string,
)
from lockgate.plugin_api.request import ChatRequest, thinking_switch
from lockgate.plugin_api.tool_calls import Tool, ToolCall
from lockgate.plugin_api.tool_readers import read_tools

#: the chat fields Ollama's sampling options set, with the chat readers
_CHAT_READERS = {f.name: f.metadata.get("reader") for f in dataclasses.fields(ChatRequest)}
SAMPLING_OPTIONS = {
    "num_predict": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
}
#: options that size or place the model at load: the server's settings say
#: those (`num_ctx` is checked against the context)
LOAD_OPTIONS = frozenset({
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "numa", "num_thread", "use_mmap", "use_mlock",
    "vocab_only", "embedding_only", "logits_all", "num_keep", "f16_kv",
})
#: options this server does not sample by, with the value that asks for nothing
NEUTRAL_OPTIONS = {
    "typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "repeat_last_n": -1,
    "penalize_newline": True,
}


def read_options(value: Any, where: str) -> dict[str, Any]:
    """`options`, as the chat fields they set (by chat name; `num_ctx`
    kept under its own name for the context check)."""
    options = json_object(value, where)
    out: dict[str, Any] = {}
    for name, given in options.items():
        at = f"{where}.{name}"
        if given is None:
            continue
        if name == "num_predict":
            if given in (-1, -2):  # no limit, or the context's: the context bounds it here
                continue
            out["max_tokens"] = integer(1)(given, at)
        elif name in SAMPLING_OPTIONS:
            out[SAMPLING_OPTIONS[name]] = _CHAT_READERS[SAMPLING_OPTIONS[name]](given, at)
        elif name == "num_ctx":
            out["num_ctx"] = integer(1)(given, at)
        elif name in LOAD_OPTIONS:
            continue
        elif name in NEUTRAL_OPTIONS:
            if given != NEUTRAL_OPTIONS[name]:
                raise UnsupportedParameter(
                    f"{at} is not supported by this server (only {json.dumps(NEUTRAL_OPTIONS[name])}, which "
                    "asks for nothing)", param=at)
        else:
            raise InvalidRequestError(f"{at} is not an option this server knows", param=at)
    return out


#: a Go duration's units, as Ollama's `keep_alive` takes them, in seconds
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def read_keep_alive(value: Any, where: str) -> float | None:
    """`keep_alive`: how long the model stays loaded once idle, in seconds:
    a number of seconds or a duration ("5m", "1h30m", "-1"); 0 unloads it
    as soon as it is idle, a negative value keeps it for good."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        try:
            return sign * float(text)  # "300": seconds
        except ValueError:
            pass
        parts = _DURATION.findall(text)
        if text and "".join(number + unit for number, unit in parts) == text:
            return sign * sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    raise InvalidRequestError(f'{where} must be a duration ("5m", "1h", "-1") or a number of seconds, got '
                              f"{json.dumps(value)}", param=where)


def read_format(value: Any, where: str) -> OutputFormat | None:
    """`format`: "json" (any JSON object), a JSON schema, or "" (none)."""
    if value == "":
        return None
    if value == "json":
        return read_response_format({"type": "json_object"}, where)
    if not isinstance(value, dict):
        raise InvalidRequestError(f'{where} must be "json" or a JSON schema, not {json_type(value)}', param=where)
    try:
        return read_response_format({"type": "json_schema", "json_schema": {"name": "format", "schema": value}},
                                    where)
    except InvalidRequestError as exc:
        exc.message = exc.message.replace(f"{where}.json_schema.schema", where)
        exc.param = where
        raise


def read_think(value: Any, where: str) -> bool:
    """`think`: true or false, or an effort ("low", "medium", "high"),
    which switches the thinking on."""
    if isinstance(value, bool):
        return value
    return read_reasoning_effort(value, where) != "none"


def read_ollama_messages(value: Any, where: str) -> tuple[Message, ...]:
    """`messages`: system, user, assistant and tool turns; an assistant's
    `tool_calls` (`{"function": {"name", "arguments": {...}}}`) get ids and
    each tool turn the id of the call it answers."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{where} must be a non-empty array of messages", param=where)
    messages: list[Message] = []
    unanswered: list[ToolCall] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        item = json_object(item, at)
        role = item.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"{at}.role must be system, user, assistant or tool, got {role!r}",
                                      param=f"{at}.role")
        if item.get("images"):
            raise UnsupportedParameter(f"{at}.images: this server reads text only", param=f"{at}.images")
        content = item.get("content")
        content = "" if content is None else string(content, f"{at}.content")
        if role == "assistant":
            calls = tuple(_tool_call(call, f"{at}.tool_calls[{j}]", f"call_{i}_{j}")
                          for j, call in enumerate(_list(item.get("tool_calls"), f"{at}.tool_calls")))
            unanswered.extend(calls)
            thinking = item.get("thinking")
            messages.append(Message("assistant", content, tool_calls=calls,
                                    reasoning=None if thinking is None else string(thinking, f"{at}.thinking")))
        elif role == "tool":
            name = item.get("tool_name")
            name = None if name is None else string(name, f"{at}.tool_name")
            answered = next((call for call in unanswered if name is None or call.name == name), None)
            if answered is None:
                raise InvalidRequestError(f"{at} answers no earlier tool call" + (f" of {name!r}" if name else ""),
                                          param=at)
            unanswered.remove(answered)
            messages.append(Message("tool", content, tool_call_id=answered.id))
        else:
            messages.append(Message(role, content))
    return tuple(messages)


def _list(value: Any, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array, not {json_type(value)}", param=where)
    return value


def _tool_call(value: Any, where: str, call_id: str) -> ToolCall:
    function = json_object(json_object(value, where).get("function"), f"{where}.function")
    name = string(function.get("name"), f"{where}.function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, read_arguments(arguments, f"{where}.function.arguments"), id=call_id)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OllamaBase:
    """What Ollama's chat and generate bodies share."""

    id: str
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    model: str = param("", string)
    #: Ollama streams unless told not to
    stream: bool = param(True, boolean)
    format: OutputFormat | None = param(None, read_format)
    options: Mapping[str, Any] = param({}, read_options)
    think: bool | None = param(None, read_think)
    keep_alive: float | None = param(None, read_keep_alive)

    def _chat(self, messages: tuple[Message, ...], *, thinks: bool, context_length: int, **more) -> ChatRequest:
        values = dict(self.options)
        num_ctx = values.pop("num_ctx", None)
        if num_ctx is not None and num_ctx > context_length:
            raise UnsupportedParameter(
                f"options.num_ctx ({num_ctx}) is more than this model's context of {context_length} tokens",
                param="options.num_ctx")
        thinking_switch(values, self.think, thinks=thinks, where="think")
        return ChatRequest.checked(id=self.id, body=self.body, origin=self, model=self.model, stream=self.stream,
                                   messages=messages, response_format=self.format, **values, **more)

    def param_for(self, subject: str) -> str | None:
        return {"max_tokens": "options.num_predict", "schema": "format"}.get(subject)

    def tool_result_param(self, index: int) -> str:
        return f"messages[{index}]"

    def tool_parameters_param(self, index: int) -> str:
        return f"tools[{index}].function.parameters"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OllamaChatRequest(OllamaBase):
    """A `POST /api/chat` body."""

    endpoint: ClassVar[str] = OLLAMA_CHAT

    messages: tuple[Message, ...] = param((), read_ollama_messages, required=True)
    tools: tuple[Tool, ...] = param((), read_tools)

    def to_chat(self, *, thinks: bool, context_length: int) -> ChatRequest:
        """The chat request this one is, for a model that thinks (`thinks`)
        or not, whose context holds `context_length` tokens."""
        return self._chat(self.messages, thinks=thinks, context_length=context_length, tools=self.tools)

    def param_for(self, subject: str) -> str | None:
        return "messages" if subject == "prompt" else super().param_for(subject)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OllamaGenerateRequest(OllamaBase):
    """A `POST /api/generate` body: a prompt (and a system prompt)."""

    endpoint: ClassVar[str] = OLLAMA_GENERATE

    prompt: str = param("", string)
    system: str | None = param(None, string)

    def to_chat(self, *, thinks: bool, context_length: int) -> ChatRequest:
        """The chat request of one user turn (after the system prompt)."""
        system = (Message("system", self.system),) if self.system else ()
        return self._chat((*system, Message("user", self.prompt)), thinks=thinks, context_length=context_length)

    def param_for(self, subject: str) -> str | None:
        return "prompt" if subject == "prompt" else super().param_for(subject)


def parse_ollama_request(
    endpoint: str, body: Mapping[str, Any], *, request_id: str, fields: FieldPolicy = STRICT,
) -> OllamaChatRequest | OllamaGenerateRequest:
    """Read an Ollama body (`OLLAMA_CHAT` or `OLLAMA_GENERATE`) into its type;
    `to_chat` then gives the chat request, once the model is known.

    :raises InvalidRequestError: (400) naming the field at fault (one the
        field table refuses or does not know included).
    """
    check_fields(endpoint, body, fields)
    cls = OllamaChatRequest if endpoint == OLLAMA_CHAT else OllamaGenerateRequest
    return cls(id=request_id, body=body, **read_fields(cls, body))


def _embed_inputs(value: Any, where: str) -> tuple[str, ...]:
    """`/api/embed`'s `input`: a string or an array of strings."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        return embedding_inputs(value, where)
    raise InvalidRequestError(f"{where} must be a string or a non-empty array of strings", param=where)


def parse_ollama_embed(body: Mapping[str, Any], *, request_id: str, fields: FieldPolicy = STRICT) -> EmbeddingRequest:
    """An `/api/embed` body as the embeddings request it is: its inputs cut
    to the context (or `options.num_ctx`) unless `truncate` is false, as
    Ollama cuts them; sampling options are read and have nothing to act on."""
    check_fields(OLLAMA_EMBED, body, fields)
    if body.get("input") is None:
        raise InvalidRequestError("input is required", param="input")
    options = read_options(body.get("options") or {}, "options")
    return EmbeddingRequest(
        id=request_id, body=body, model=string(body.get("model") or "", "model"),
        inputs=_embed_inputs(body["input"], "input"),
        truncate=boolean(body.get("truncate", True), "truncate"),
        dimensions=None if body.get("dimensions") is None else integer(1)(body["dimensions"], "dimensions"),
        num_ctx=options.get("num_ctx"),
    )
