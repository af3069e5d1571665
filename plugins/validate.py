"""Built-in `lockgate_validate_request`: the OpenAI parameters, their types and ranges.

Each check raises `InvalidRequestError` with `param` naming the field. Unknown
fields are ignored, as OpenAI does. A known parameter that the engine cannot
honour yet is refused (`UnsupportedParameter`) rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

from lockgate.errors import InvalidRequestError, UnsupportedParameter
from lockgate.plugin_api.hookspecs import hookimpl

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
#: messages in one chat request (OpenAI's own limit)
MAX_MESSAGES = 2048
#: characters of text in one request's messages or prompts, checked before
#: the template and the tokenizer spend time on it
MAX_TEXT_CHARS = 1_000_000
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(body, name, low, high, *, low_open=False, integer=False):
    """`body[name]`, when present and not null, is a number in [low, high]
    ((low, high] with `low_open`); an integer when `integer`."""
    value = body.get(name)
    if value is None:
        return
    if not (_is_int(value) if integer else _is_number(value)):
        kind = "an integer" if integer else "a number"
        raise InvalidRequestError(
            f"{name} must be {kind}, not {_type_name(value)}", param=name
        )
    if value != value or (value <= low if low_open else value < low) or value > high:
        bracket = "(" if low_open else "["
        raise InvalidRequestError(
            f"{name} must be in {bracket}{low}, {high}], got {value}", param=name
        )


def check_bool(body, name):
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, not {_type_name(value)}", param=name)


def check_messages(body):
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequestError("messages is required", param="messages")
    if not isinstance(messages, list):
        raise InvalidRequestError(
            f"messages must be an array, not {_type_name(messages)}", param="messages"
        )
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequestError(
            f"messages holds {len(messages)} messages; the limit is {MAX_MESSAGES}", param="messages"
        )
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                param=f"{where}.role",
            )
        if message.get("tool_calls"):
            raise UnsupportedParameter(
                "tool calls are not supported by this server", param=f"{where}.tool_calls"
            )
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError(f"{where}.name must be a string", param=f"{where}.name")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(
                f"{where}.content must be a string or an array of text parts, "
                f"not {_type_name(content)}",
                param=f"{where}.content",
            )
        for j, part in enumerate(content):
            part_where = f"{where}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise InvalidRequestError(
                    f"{part_where} must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                    f"this model reads text only, got {kind!r}",
                    param=part_where,
                )
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{part_where}.text must be a string", param=part_where)
    check_text_size(
        "messages",
        (
            text
            for message in messages
            for text in (
                [message.get("name") or ""]
                + ([message["content"]] if isinstance(message["content"], str)
                   else [part["text"] for part in message["content"]])
            )
        ),
    )


def check_text_size(param, texts) -> None:
    """The texts of `param` together hold at most `MAX_TEXT_CHARS` characters."""
    total = 0
    for text in texts:
        total += len(text)
        if total > MAX_TEXT_CHARS:
            raise InvalidRequestError(
                f"{param} holds more than {MAX_TEXT_CHARS} characters of text; that is the limit",
                param=param,
            )


def _check_token_ids(ids, vocab_size, where):
    if not ids:
        raise InvalidRequestError(f"{where} must not be empty", param="prompt")
    for token in ids:
        if not _is_int(token):
            raise InvalidRequestError(
                f"{where} must hold integer token ids, found {_type_name(token)}", param="prompt"
            )
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"{where} holds token id {token}, outside the vocabulary (0..{vocab_size - 1})",
                param="prompt",
            )


def check_prompt(body, vocab_size):
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequestError("prompt is required", param="prompt")
    if isinstance(prompt, str):
        check_text_size("prompt", [prompt])
        return
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(
            "prompt must be a string, an array of strings, an array of token ids "
            "or an array of token-id arrays",
            param="prompt",
        )
    if all(isinstance(p, str) for p in prompt):
        check_text_size("prompt", prompt)
        return
    if all(isinstance(p, list) for p in prompt):
        for i, ids in enumerate(prompt):
            _check_token_ids(ids, vocab_size, f"prompt[{i}]")
        return
    _check_token_ids(prompt, vocab_size, "prompt")


def check_stop(body):
    stop = body.get("stop")
    if stop is None or isinstance(stop, str) and stop:
        return
    if isinstance(stop, list) and len(stop) <= MAX_STOP_SEQUENCES and all(
        isinstance(s, str) and s for s in stop
    ):
        return
    raise InvalidRequestError(
        f"stop must be a non-empty string or an array of at most {MAX_STOP_SEQUENCES} "
        "non-empty strings",
        param="stop",
    )


def check_logit_bias(body, vocab_size):
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must be an object", param="logit_bias")
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                param="logit_bias",
            )
        if not _is_number(value) or not -100 <= value <= 100:
            raise InvalidRequestError(
                f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key}",
                param="logit_bias",
            )


def check_logprobs(body, chat):
    if chat:
        check_bool(body, "logprobs")
        check_number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )
    else:
        check_number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)


def check_stream(body):
    check_bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return
    if body.get("stream") is not True:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options must be an object", param="stream_options")
    check_bool(options, "include_usage")


def check_response_format(body):
    fmt = body.get("response_format")
    if fmt is None:
        return
    # the schema itself is compiled and checked with the grammar (lockgate.engine.structured)
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError(
            "response_format.type must be one of text, json_object, json_schema",
            param="response_format",
        )


def check_unsupported(body, chat):
    if body.get("tools") or body.get("functions"):
        raise UnsupportedParameter("tools are not supported by this server", param="tools")
    if "chat_template" in body:
        # the template is the server's (--chat-template); a client's own
        # would be code this server runs
        raise UnsupportedParameter(
            "chat_template cannot be set by a request; the server's operator sets it with --chat-template",
            param="chat_template",
        )
    if not chat:
        if body.get("echo"):
            raise UnsupportedParameter("echo is not supported by this server", param="echo")
        if body.get("suffix"):
            raise UnsupportedParameter("suffix is not supported by this server", param="suffix")
        best_of = body.get("best_of")
        if best_of is not None and best_of != body.get("n", 1):
            raise UnsupportedParameter("best_of is not supported by this server", param="best_of")


@hookimpl
def lockgate_validate_request(request, model):
    body = request.body
    vocab_size = model.vocab_size
    if request.is_chat:
        check_messages(body)
    else:
        check_prompt(body, vocab_size)
    check_stream(body)
    check_number(body, "temperature", 0, 2)
    check_number(body, "top_p", 0, 1, low_open=True)
    check_number(body, "n", 1, model.engine.options.max_n, integer=True)
    check_number(body, "max_tokens", 1, INT64_MAX, integer=True)
    check_number(body, "max_completion_tokens", 1, INT64_MAX, integer=True)
    check_number(body, "seed", INT64_MIN, INT64_MAX, integer=True)
    check_number(body, "presence_penalty", -2, 2)
    check_number(body, "frequency_penalty", -2, 2)
    # extensions, as vLLM and llama.cpp's server name them
    check_number(body, "top_k", -1, vocab_size, integer=True)
    check_number(body, "min_p", 0, 1)
    check_number(body, "repetition_penalty", 0, 10, low_open=True)
    check_bool(body, "ignore_eos")
    check_bool(body, "skip_special_tokens")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise InvalidRequestError("stop_token_ids must be an array", param="stop_token_ids")
        for token in stop_ids:
            if not _is_int(token) or not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids must be token ids in 0..{vocab_size - 1}",
                    param="stop_token_ids",
                )
    check_stop(body)
    check_logit_bias(body, vocab_size)
    check_logprobs(body, request.is_chat)
    check_response_format(body)
    check_unsupported(body, request.is_chat)
