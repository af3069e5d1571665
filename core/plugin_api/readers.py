"""Readers of a request body's fields, which the request kinds (`request.py`)
declare theirs with: each turns the JSON value at a param path
(`messages[2].content`) into its typed form or raises `InvalidRequestError`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from lockgate.errors import InvalidRequestError, InvalidSchema
from lockgate.plugin_api.tool_calls import ToolCall

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: roles read as another: the current API's `developer` is a system message,
#: the legacy `function` a tool result
ROLE_ALIASES = {"developer": "system", "function": "tool"}
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

#: reads one JSON value found at `where` (a param path) into its typed form,
#: or raises `InvalidRequestError` naming `where`
Reader = Callable[[Any, str], Any]


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


def json_object(value: Any, where: str) -> Mapping[str, Any]:
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
    bias = json_object(value, where)
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


def read_prediction(value: Any, where: str) -> str:
    """`prediction`: `{"type": "content", "content": text or text parts}`,
    the text the answer is expected to largely be (OpenAI's Predicted Outputs)."""
    prediction = json_object(value, where)
    if prediction.get("type") != "content":
        raise InvalidRequestError(f"{where}.type must be 'content'", param=f"{where}.type")
    for key in prediction:
        if key not in ("type", "content"):
            raise InvalidRequestError(f"{where}.{key} is not a prediction field (type, content)",
                                      param=f"{where}.{key}")
    return content_text(prediction.get("content"), f"{where}.content")


#: OpenAI's reasoning efforts (and DeepSeek's `max`)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def read_reasoning_effort(value: Any, where: str) -> str:
    if value not in REASONING_EFFORTS:
        raise InvalidRequestError(
            f"{where} must be one of {', '.join(REASONING_EFFORTS)}, got {json.dumps(value)[:40]}", param=where
        )
    return value


def read_include_usage(value: Any, where: str) -> bool:
    """`stream_options`: only `include_usage` is read."""
    options = json_object(value, where)
    found = options.get("include_usage")
    return False if found is None else boolean(found, f"{where}.include_usage")


#: the kinds of `OutputFormat`
JSON_SCHEMA, REGEX, CHOICE, GRAMMAR = "json_schema", "regex", "choice", "grammar"


@dataclasses.dataclass(frozen=True)
class OutputFormat:
    """What a request constrains its output to: a JSON schema (`kind`
    `JSON_SCHEMA`, from `response_format` or an extension), a regular
    expression (`REGEX`), one string of a list (`CHOICE`), or a context-free
    grammar in GBNF or llguidance's Lark (`GRAMMAR`); the last three held as
    `source` (the choices as a JSON array)."""

    schema: Mapping[str, Any] | None = None
    #: refuse schema features the grammar compiler does not implement
    strict: bool = False
    kind: str = JSON_SCHEMA
    source: str = ""
    #: the field it was read from, which an error compiling it names; None:
    #: the endpoint's own `response_format` field (`param_for("schema")`)
    param: str | None = None


def read_response_format(value: Any, where: str) -> OutputFormat | None:
    """`response_format`: None for text, else the JSON schema to follow.

    Accepted: `{"type": "text"}`; `{"type": "json_object"}` (any object) and
    its older form with a `schema`; `{"type": "json_schema", "json_schema":
    {"name", "description", "schema", "strict"}}` where only `schema` is
    required. The schema itself is compiled, and checked, with the grammar.
    """
    fmt = json_object(value, where)
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
    #: an `assistant` message: the thinking before it (templates of models
    #: that think read it as `reasoning_content`)
    reasoning: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it (tool calls as Hugging Face
        templates expect them: arguments decoded)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
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
    reasoning = None
    for key in ("reasoning_content", "reasoning"):  # vLLM's name, and the newer one
        if value.get(key) is not None and role == "assistant":
            reasoning = string(value[key], f"{where}.{key}")
    return Message(role, content_text(content, f"{where}.content"), name, tool_call_id, calls, reasoning)


def _tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array, not {json_type(value)}", param=where)
    calls = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        call = json_object(item, at)
        if call.get("type", "function") != "function":
            raise InvalidRequestError(f"{at}.type must be 'function'", param=f"{at}.type")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{at}.id must be a non-empty string", param=f"{at}.id")
        calls.append(_call(call.get("function"), f"{at}.function", call_id=call_id))
    return tuple(calls)


def _call(value: Any, where: str, *, call_id: str | None) -> ToolCall:
    function = json_object(value, where)
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


def content_text(value: Any, where: str, part_types: tuple[str, ...] = ("text",)) -> str:
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


#: names a chat template is rendered with, or that steer the renderer
#: (transformers' `apply_chat_template` arguments): a client's
#: `chat_template_kwargs` may not set them
TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now",
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens",
})
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024


def read_chat_template_kwargs(value: Any, where: str) -> dict[str, Any]:
    """`chat_template_kwargs`: variables for the chat template to read
    (Qwen3's `enable_thinking`), JSON values, at most
    `MAX_TEMPLATE_KWARGS` of them in `MAX_TEMPLATE_KWARGS_BYTES` of JSON;
    a name the renderer sets itself is refused by name."""
    kwargs = json_object(value, where)
    if len(kwargs) > MAX_TEMPLATE_KWARGS or len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequestError(
            f"{where} holds at most {MAX_TEMPLATE_KWARGS} variables in {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON",
            param=where,
        )
    for name in kwargs:
        if name in TEMPLATE_RESERVED or name.startswith("_"):
            raise InvalidRequestError(
                f"{where}.{name} cannot be set: the server renders the template with its own {name!r}"
                if name in TEMPLATE_RESERVED else f"{where}.{name}: names starting with _ are not template variables",
                param=f"{where}.{name}",
            )
    return dict(kwargs)
