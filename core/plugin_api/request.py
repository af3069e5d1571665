"""The typed request: one OpenAI request body, parsed and checked once.

`parse_request` is the first step of every request, before any hook runs
and not a hook itself, so no plugin set can leave a body unchecked. Each
field below is declared once, with its JSON type, bounds and default; the
hooks then receive a `ChatRequest` or `CompletionRequest` whose values are
known to be well-typed and in range, and `GenerationRequest.sampling_params`
converts it, once, into what the engine runs. Every parse error is an
`InvalidRequestError` whose `param` is the exact field (`messages[2].content`,
`stream_options.include_usage`). Unknown fields are ignored, as OpenAI does;
they stay readable in `GenerationRequest.body` for plugins that define
extensions.

What needs the model (token ids inside the vocabulary, `n` within the
engine's limit, the prompt within the context) is checked where the model
is known, by the engine, whose errors name a `subject` that
`GenerationRequest.param_for` turns into this request's field.

Dataclasses, not pydantic or msgspec: the checks are few and flat, their
messages and `param` paths must be OpenAI's (a validation library's own
errors would need translating field by field), and the plugin API gains no
dependency that third-party plugins would have to agree with.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from lockgate.engine.params import SamplingParams
from lockgate.errors import InvalidRequestError, InvalidSchema
from lockgate.plugin_api.tool_calls import Tool, ToolCall

CHAT_ENDPOINT = "chat.completions"
COMPLETIONS_ENDPOINT = "completions"

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: roles read as another: the current API's `developer` is a system message,
#: the legacy `function` a tool result
ROLE_ALIASES = {"developer": "system", "function": "tool"}
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

#: reads one JSON value found at `where` (a param path) into its typed form,
#: or raises `InvalidRequestError` naming `where`
Reader = Callable[[Any, str], Any]


# ---------------------------------------------------------------- readers


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(low: float, high: float, *, low_open: bool = False, integer: bool = False) -> Reader:
    """A number in [low, high] ((low, high] with `low_open`); an integer when `integer`."""

    def read(value: Any, where: str) -> float | int:
        if not (_is_int(value) if integer else _is_number(value)):
            kind = "an integer" if integer else "a number"
            raise InvalidRequestError(f"{where} must be {kind}, not {json_type(value)}", param=where)
        if value != value or (value <= low if low_open else value < low) or value > high:
            bracket = "(" if low_open else "["
            raise InvalidRequestError(f"{where} must be in {bracket}{low}, {high}], got {value}", param=where)
        return value if integer else float(value)

    return read


def integer(low: int, high: int = INT64_MAX) -> Reader:
    return number(low, high, integer=True)


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{where} must be a boolean, not {json_type(value)}", param=where)
    return value


def string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where} must be a string, not {json_type(value)}", param=where)
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be an object, not {json_type(value)}", param=where)
    return value


def read_token_ids(value: Any, where: str) -> tuple[int, ...]:
    """A non-empty array of token ids (integers >= 0; the vocabulary's end
    is the engine's to check)."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{where} must be a non-empty array of token ids", param=_root(where))
    for token in value:
        if not _is_int(token) or token < 0:
            raise InvalidRequestError(
                f"{where} must hold token ids (integers >= 0), found {json.dumps(token)[:40]}",
                param=_root(where),
            )
    return tuple(value)


def _root(where: str) -> str:
    """`prompt[1]` -> `prompt`: token-id errors name the whole field, as OpenAI does."""
    return where.split("[", 1)[0]


def read_stop(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str) and value:
        return (value,)
    if isinstance(value, list) and len(value) <= MAX_STOP_SEQUENCES and all(
        isinstance(s, str) and s for s in value
    ):
        return tuple(value)
    raise InvalidRequestError(
        f"{where} must be a non-empty string or an array of at most {MAX_STOP_SEQUENCES} non-empty strings",
        param=where,
    )


def read_stop_token_ids(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise InvalidRequestError(f"{where} must be an array of token ids (integers >= 0)", param=where)
    return tuple(value)


def read_logit_bias(value: Any, where: str) -> dict[int, float]:
    bias = _object(value, where)
    read: dict[int, float] = {}
    for key, amount in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"{where} keys must be token ids, got {key!r}", param=where) from None
        if token < 0:
            raise InvalidRequestError(f"{where} keys must be token ids >= 0, got {key!r}", param=where)
        if not _is_number(amount) or not -100 <= amount <= 100:
            raise InvalidRequestError(
                f"{where} values must be numbers in [-100, 100], got {amount!r} for {key}", param=where
            )
        read[token] = float(amount)
    return read


def read_include_usage(value: Any, where: str) -> bool:
    """`stream_options`: only `include_usage` is read."""
    options = _object(value, where)
    found = options.get("include_usage")
    return False if found is None else boolean(found, f"{where}.include_usage")


@dataclasses.dataclass(frozen=True)
class OutputFormat:
    """What `response_format` constrains the output to: a JSON schema."""

    schema: Mapping[str, Any]
    #: refuse schema features the grammar compiler does not implement
    strict: bool = False


def read_response_format(value: Any, where: str) -> OutputFormat | None:
    """`response_format`: None for text, else the JSON schema to follow.

    Accepted: `{"type": "text"}`; `{"type": "json_object"}` (any object) and
    its older form with a `schema`; `{"type": "json_schema", "json_schema":
    {"name", "description", "schema", "strict"}}` where only `schema` is
    required. The schema itself is compiled, and checked, with the grammar.
    """
    fmt = _object(value, where)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema")
        return OutputFormat({"type": "object"} if schema is None else _schema(schema, f"{where}.schema"))
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None:
            raise InvalidSchema(f"{where}.json_schema is required when {where}.type is 'json_schema'", param=where)
        _schema(spec, f"{where}.json_schema")
        for name in ("name", "description"):
            if spec.get(name) is not None and not isinstance(spec[name], str):
                raise InvalidSchema(
                    f"{where}.json_schema.{name} must be a string, got {_a(json_type(spec[name]))}", param=where
                )
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidSchema(
                f"{where}.json_schema.strict must be a boolean, got {_a(json_type(strict))}", param=where
            )
        if spec.get("schema") is None:
            raise InvalidSchema(f"{where}.json_schema.schema is required", param=where)
        return OutputFormat(_schema(spec["schema"], f"{where}.json_schema.schema"), bool(strict))
    raise InvalidRequestError(
        f"{where}.type must be one of text, json_object, json_schema, got "
        + (json.dumps(kind) if isinstance(kind, str) else json_type(kind)),
        param=where,
    )


def _schema(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise InvalidSchema(f"{where} must be a JSON object, got {_a(json_type(value))}", param=_root(where.split(".")[0]))
    return value


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


@dataclasses.dataclass(frozen=True)
class Message:
    """One chat message, its content as text."""

    #: system, user, assistant or tool (`developer` and `function` read as system and tool)
    role: str
    content: str
    name: str | None = None
    #: a `tool` message: the call it answers
    tool_call_id: str | None = None
    #: an `assistant` message: the calls it made
    tool_calls: tuple[ToolCall, ...] = ()

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it (tool calls as Hugging Face
        templates expect them: arguments decoded)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _decoded(c.arguments)}}
                for c in self.tool_calls
            ]
        return message


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def read_messages(value: Any, where: str) -> tuple[Message, ...]:
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array, not {json_type(value)}", param=where)
    if not value:
        raise InvalidRequestError(f"{where} must not be empty", param=where)
    return tuple(_message(item, f"{where}[{i}]") for i, item in enumerate(value))


def _message(value: Any, where: str) -> Message:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be an object", param=where)
    role = value.get("role")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(
            f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param=f"{where}.role"
        )
    role = ROLE_ALIASES.get(role, role)
    name = value.get("name")
    if name is not None:
        string(name, f"{where}.name")
    tool_call_id = value.get("tool_call_id")
    if tool_call_id is not None:
        string(tool_call_id, f"{where}.tool_call_id")
    calls: tuple[ToolCall, ...] = ()
    if value.get("tool_calls") is not None:
        if role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls is for assistant messages", param=f"{where}.tool_calls")
        calls = _tool_calls(value["tool_calls"], f"{where}.tool_calls")
    elif value.get("function_call") is not None and role == "assistant":  # the legacy single call
        calls = (_call(value["function_call"], f"{where}.function_call", call_id=None),)
    content = value.get("content")
    if content is None and (calls or role == "assistant"):
        content = ""
    return Message(role, _content(content, f"{where}.content"), name, tool_call_id, calls)


def _tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array, not {json_type(value)}", param=where)
    calls = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        call = _object(item, at)
        if call.get("type", "function") != "function":
            raise InvalidRequestError(f"{at}.type must be 'function'", param=f"{at}.type")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{at}.id must be a non-empty string", param=f"{at}.id")
        calls.append(_call(call.get("function"), f"{at}.function", call_id=call_id))
    return tuple(calls)


def _call(value: Any, where: str, *, call_id: str | None) -> ToolCall:
    function = _object(value, where)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name must be a non-empty string", param=f"{where}.name")
    arguments = read_arguments(function.get("arguments", "{}"), f"{where}.arguments")
    return ToolCall(name, arguments) if call_id is None else ToolCall(name, arguments, id=call_id)


def read_arguments(value: Any, where: str) -> str:
    """An earlier call's `arguments`: a JSON object as text, as the model
    wrote it ("" for a call without arguments reads as `{}`). Anything else
    would reach the chat template as something no call ever carried."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where} must be a string of JSON, not {json_type(value)}", param=where)
    if not value.strip():
        return "{}"
    try:
        decoded = json.loads(value)
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict):
        raise InvalidRequestError(
            f"{where} must be a JSON object as text (the call's arguments), got {json.dumps(value)[:80]}", param=where
        )
    return value


#: functions one request may offer (OpenAI's limit)
MAX_TOOLS = 128


def read_tools(value: Any, where: str) -> tuple[Tool, ...]:
    """`tools`: `[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]`."""
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array, not {json_type(value)}", param=where)
    _at_most_max_tools(value, where)
    tools, names = [], set()
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        tool = _object(item, at)
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"{at}.type must be 'function' (this server runs no built-in tools)", param=f"{at}.type"
            )
        tools.append(_function(tool.get("function"), f"{at}.function", names))
    return tuple(tools)


def read_functions(value: Any, where: str) -> tuple[Tool, ...]:
    """The deprecated `functions`: `[{"name", "description", "parameters"}]`."""
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array, not {json_type(value)}", param=where)
    _at_most_max_tools(value, where)
    names: set[str] = set()
    return tuple(_function(item, f"{where}[{i}]", names) for i, item in enumerate(value))


def _at_most_max_tools(value: list, where: str) -> None:
    if len(value) > MAX_TOOLS:
        raise InvalidRequestError(f"{where} holds {len(value)} functions; at most {MAX_TOOLS} are supported",
                                  param=where)


def _function(value: Any, where: str, names: set[str]) -> Tool:
    function = _object(value, where)
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidRequestError(
            f"{where}.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {json.dumps(name)[:80]}", param=f"{where}.name"
        )
    if name in names:
        raise InvalidRequestError(f"{where}.name: two tools are named {name!r}", param=f"{where}.name")
    names.add(name)
    description = function.get("description")
    if description is not None:
        string(description, f"{where}.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    elif not isinstance(parameters, dict):
        raise InvalidRequestError(
            f"{where}.parameters must be a JSON schema object, not {json_type(parameters)}", param=f"{where}.parameters"
        )
    strict = function.get("strict")
    if strict is not None:
        boolean(strict, f"{where}.strict")
    return Tool(name, description, parameters, bool(strict))


def read_tool_choice(value: Any, where: str) -> str:
    """`tool_choice` (or the legacy `function_call`): "none", "auto",
    "required", or a tool's name for `{"type": "function", "function": {"name"}}`
    (legacy: `{"name"}`), kept as `function:<name>`."""
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise InvalidRequestError(
                f"{where} must be one of {', '.join(TOOL_CHOICES)} or names a function, got {json.dumps(value)[:60]}",
                param=where,
            )
        return value
    choice = _object(value, where)
    function = choice.get("function") if "function" in choice else choice
    if "function" in choice and choice.get("type") != "function":
        raise InvalidRequestError(f"{where}.type must be 'function'", param=f"{where}.type")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError(f"{where}.function.name must be a string", param=where)
    return "function:" + name


def _content(value: Any, where: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message's content as text: a string, or its text parts (of one of
    `part_types`) joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequestError(
            f"{where} must be a string or an array of text parts, not {json_type(value)}", param=where
        )
    texts = []
    for j, part in enumerate(value):
        part_where = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in part_types:
            kind = part.get("type") if isinstance(part, dict) else json_type(part)
            raise InvalidRequestError(
                f'{part_where} must be a text part ({{"type": "{part_types[0]}", "text": ...}}); '
                f"this model reads text only, got {kind!r}",
                param=part_where,
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{part_where}.text must be a string", param=part_where)
        texts.append(part["text"])
    return "".join(texts)


#: one completions prompt: text, or token ids
Prompt = str | tuple[int, ...]


def read_prompts(value: Any, where: str) -> tuple[Prompt, ...]:
    """`prompt`: a string, an array of strings, an array of token ids or an
    array of token-id arrays; each is one prompt."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return tuple(value)
        if all(isinstance(p, list) for p in value):
            return tuple(read_token_ids(ids, f"{where}[{i}]") for i, ids in enumerate(value))
        if not any(isinstance(p, (str, list)) for p in value):
            return (read_token_ids(value, where),)
    raise InvalidRequestError(
        f"{where} must be a string, an array of strings, an array of token ids "
        "or an array of token-id arrays",
        param=where,
    )


# ---------------------------------------------------------------- requests


def param(default: Any = None, reader: Reader | None = None, *, key: str | None = None, required: bool = False):
    """Declare one body field: read with `reader` from `body[key]` (the
    attribute's name by default) when present and not null, else `default`
    (a `dict` default is copied for each request)."""
    metadata = {"reader": reader, "key": key, "required": required}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """What chat completions and completions share.

    Not built directly: `parse_request` builds a `ChatRequest` or a
    `CompletionRequest` from a body.
    """

    #: the endpoint's name, `CHAT_ENDPOINT` or `COMPLETIONS_ENDPOINT`
    endpoint: ClassVar[str]

    #: the request id (`x-request-id`)
    id: str
    #: the body as sent, for plugins that read extension fields
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    model: str = param("", string)
    stream: bool = param(False, boolean)
    include_usage: bool = param(False, read_include_usage, key="stream_options")
    n: int = param(1, integer(1))
    max_tokens: int | None = param(None, integer(1))
    max_completion_tokens: int | None = param(None, integer(1))
    temperature: float = param(1.0, number(0, 2))
    top_p: float = param(1.0, number(0, 1, low_open=True))
    seed: int | None = param(None, integer(INT64_MIN))
    presence_penalty: float = param(0.0, number(-2, 2))
    frequency_penalty: float = param(0.0, number(-2, 2))
    stop: tuple[str, ...] = param((), read_stop)
    logit_bias: Mapping[int, float] = param({}, read_logit_bias)
    response_format: OutputFormat | None = param(None, read_response_format)
    user: str | None = param(None, string)
    # extensions, as vLLM and llama.cpp's server name them
    #: -1 or 0 disables
    top_k: int = param(0, integer(-1))
    min_p: float = param(0.0, number(0, 1))
    repetition_penalty: float = param(1.0, number(0, 10, low_open=True))
    ignore_eos: bool = param(False, boolean)
    skip_special_tokens: bool = param(True, boolean)
    stop_token_ids: tuple[int, ...] = param((), read_stop_token_ids)

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT_ENDPOINT

    @property
    def completion_limit(self) -> int | None:
        """Most tokens to generate per choice: `max_completion_tokens`, the
        newer name, wins over `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    #: the field that holds the prompt ("messages" or "prompt")
    prompt_field: ClassVar[str]

    def param_for(self, subject: str) -> str:
        """The field of this request an error about `subject` names: the
        engine and the grammar compiler speak of "prompt", "max_tokens" and
        "schema", the client sent `messages`, `max_completion_tokens` and
        `response_format`."""
        if subject == "prompt":
            return self.prompt_field
        if subject == "max_tokens":
            return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if subject == "schema":
            return "response_format"
        return subject

    def requested_logprobs(self) -> int | None:
        """How many alternatives to report per token; None: no logprobs."""
        raise NotImplementedError

    def sampling_params(self, grammar: object | None = None) -> SamplingParams:
        """How the engine samples for this request (`grammar`: the compiled
        `response_format`)."""
        return SamplingParams(
            max_tokens=self.completion_limit,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            n=self.n,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=self.requested_logprobs(),
            grammar=grammar,
        )

    def _check_combinations(self) -> None:
        if self.body.get("stream_options") is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatRequest(GenerationRequest):
    """A `POST /v1/chat/completions` body."""

    endpoint: ClassVar[str] = CHAT_ENDPOINT
    prompt_field: ClassVar[str] = "messages"

    messages: tuple[Message, ...] = param((), read_messages, required=True)
    logprobs: bool = param(False, boolean)
    top_logprobs: int | None = param(None, integer(0, MAX_TOP_LOGPROBS))
    tools: tuple[Tool, ...] = param((), read_tools)
    #: "none", "auto", "required" or "function:<name>"; None: not given
    tool_choice: str | None = param(None, read_tool_choice)
    parallel_tool_calls: bool = param(True, boolean)
    # the deprecated forms of `tools` and `tool_choice`
    functions: tuple[Tool, ...] = param((), read_functions)
    function_call: str | None = param(None, read_tool_choice)

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def offered_tools(self) -> tuple[Tool, ...]:
        return self.tools or self.functions

    @property
    def effective_tool_choice(self) -> str:
        """What the model may do with the tools: "none" without tools;
        "auto" when tools came without a choice."""
        if not self.offered_tools:
            return "none"
        return self.tool_choice or self.function_call or "auto"

    @property
    def uses_tools(self) -> bool:
        """Whether the model sees the tools (tools with "none" are plain chat)."""
        return self.effective_tool_choice != "none"

    @property
    def has_tool_history(self) -> bool:
        """Whether earlier turns called tools."""
        return any(m.tool_calls or m.role == "tool" for m in self.messages)

    @property
    def reads_tool_output(self) -> bool:
        """Whether the output is read as a tool-call format writes it: tools
        are offered, or earlier turns used them."""
        return self.uses_tools or self.has_tool_history

    @property
    def forced_tools(self) -> tuple[Tool, ...]:
        """The tools a call must be of: the named one, or all."""
        choice = self.effective_tool_choice
        if choice.startswith("function:"):
            return tuple(t for t in self.offered_tools if t.name == choice.removeprefix("function:"))
        return self.offered_tools

    def _check_combinations(self) -> None:
        super()._check_combinations()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        for field, tools in (("tool_choice", self.tools), ("function_call", self.functions)):
            choice = getattr(self, field)
            if choice is None:
                continue
            if not tools and not self.offered_tools:
                raise InvalidRequestError(f"{field} is only allowed when tools are given", param=field)
            if choice.startswith("function:") and not any(
                t.name == choice.removeprefix("function:") for t in self.offered_tools
            ):
                raise InvalidRequestError(
                    f"{field} names {choice.removeprefix('function:')!r}, which is not among the tools", param=field
                )
        if self.uses_tools and self.response_format is not None:
            raise InvalidRequestError(
                "response_format cannot be combined with tools (unless tool_choice is 'none')",
                param=self.param_for("schema"), code="unsupported_parameter",
            )
        answered: set[str] = set()
        for i, message in enumerate(self.messages):
            answered.update(c.id for c in message.tool_calls)
            if message.role != "tool" or (message.tool_call_id is None and message.name is not None):
                continue  # a legacy `function` message names its function, not a call
            where = self._tool_result_param(i)
            if message.tool_call_id is None:
                raise InvalidRequestError(f"{where} is required in a tool message", param=where)
            if message.tool_call_id not in answered:
                raise InvalidRequestError(
                    f"{where} {message.tool_call_id!r} answers no earlier tool call", param=where
                )

    def _tool_result_param(self, index: int) -> str:
        """The field that names the call the tool result at message `index` answers."""
        return f"messages[{index}].tool_call_id"

    def tool_parameters_param(self, index: int) -> str:
        """The field that holds the `index`-th offered tool's parameters schema."""
        if self.tools:
            return f"tools[{index}].function.parameters"
        return f"functions[{index}].parameters"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionRequest(GenerationRequest):
    """A `POST /v1/completions` body. It may carry several prompts;
    `split` gives one request per prompt, each run through the pipeline."""

    endpoint: ClassVar[str] = COMPLETIONS_ENDPOINT
    prompt_field: ClassVar[str] = "prompt"

    prompts: tuple[Prompt, ...] = param((), read_prompts, key="prompt", required=True)
    logprobs: int | None = param(None, integer(0, MAX_TOP_LOGPROBS))
    echo: bool = param(False, boolean)
    suffix: str | None = param(None, string)
    best_of: int | None = param(None, integer(1))

    @property
    def prompt(self) -> Prompt:
        """This request's prompt (the first, before `split`)."""
        return self.prompts[0]

    def split(self) -> list["CompletionRequest"]:
        """One request per prompt; ids get a `-i` suffix when there are several."""
        if len(self.prompts) == 1:
            return [self]
        return [
            dataclasses.replace(self, id=f"{self.id}-{i}", prompts=(prompt,))
            for i, prompt in enumerate(self.prompts)
        ]

    def requested_logprobs(self) -> int | None:
        return self.logprobs


REQUEST_TYPES: dict[str, type[GenerationRequest]] = {
    CHAT_ENDPOINT: ChatRequest,
    COMPLETIONS_ENDPOINT: CompletionRequest,
}


def read_fields(cls: type[GenerationRequest], body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields `cls` declares with a reader, read from `body`: those
    present and not null; a required one missing is an error."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        reader = field.metadata.get("reader")
        if reader is None:
            continue
        key = field.metadata["key"] or field.name
        value = body.get(key)
        if value is None:
            if field.metadata["required"]:
                raise InvalidRequestError(f"{key} is required", param=key)
            continue
        values[field.name] = reader(value, key)
    return values


def parse_request(endpoint: str, body: Mapping[str, Any], *, request_id: str) -> GenerationRequest:
    """Read `body` (a decoded JSON object) as a request to `endpoint`.

    :raises InvalidRequestError: (400) naming the first field that is
        missing, of the wrong type or out of range.
    """
    cls = REQUEST_TYPES[endpoint]
    request = cls(id=request_id, body=body, **read_fields(cls, body))
    request._check_combinations()
    return request
