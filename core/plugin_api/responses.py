"""The Responses API's request, typed: one more protocol mapping onto the
chat request the hooks already know.

A `POST /v1/responses` body is read into a `ResponsesRequest`, which holds
the Responses fields alone, and becomes (`to_chat`) the `ChatRequest` the
hooks see: its `messages` built from `instructions`, the stored
conversation of `previous_response_id` and `input`, its `tools` from the
Responses tool shape, its `response_format` from `text.format`. A plugin
sees it exactly as a chat request (`request.endpoint` says "responses");
the Responses request itself, with `store`, `previous_response_id`,
`metadata` and `instructions`, is its `origin`. Every error names the
Responses field (`input[2].content[0].text`, `tools[0].type`,
`max_output_tokens`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from lockgate.errors import InvalidRequestError, UnsupportedParameter
from lockgate.plugin_api.readers import (
    Message,
    OutputFormat,
    content_text,
    json_object,
    boolean,
    integer,
    json_type,
    read_arguments,
    read_reasoning_effort,
    read_response_format,
    string,
)
from lockgate.plugin_api.fields import RESPONSES, STRICT, FieldPolicy, check_fields
from lockgate.plugin_api.body import param, read_fields, same_as
from lockgate.plugin_api.request import ChatRequest, with_thinking
from lockgate.plugin_api.shared_fields import SharedFields
from lockgate.plugin_api.tool_calls import Tool, ToolCall, ToolChoice
from lockgate.plugin_api.tool_readers import read_tools

RESPONSES_ENDPOINT = "responses"

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
MAX_METADATA_KEYS = 16


def read_input(value: Any, where: str) -> tuple[Message, ...]:
    """`input`: a string (one user message) or a list of items."""
    if isinstance(value, str):
        return (Message("user", value),)
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{where} must be a string or a non-empty array of items", param=where)
    messages: list[Message] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        item = json_object(item, at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, at)
            if message.role == "assistant" and _thinking_only(messages):
                # the answer that followed a reasoning item: one assistant turn
                message = dataclasses.replace(message, reasoning=messages.pop().reasoning)
            messages.append(message)
        elif kind == "reasoning":
            messages.append(Message("assistant", "", reasoning=_reasoning_text(item, at)))
        elif kind == "function_call":
            call = _function_call(item, at)
            if messages and messages[-1].role == "assistant" and (messages[-1].tool_calls or not messages[-1].content):
                last = messages.pop()  # consecutive calls are one assistant turn
                messages.append(dataclasses.replace(last, tool_calls=(*last.tool_calls, call)))
            else:
                messages.append(Message("assistant", "", tool_calls=(call,)))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            string(call_id, f"{at}.call_id")
            text = _text_parts(item.get("output"), f"{at}.output")
            messages.append(Message("tool", text, tool_call_id=call_id))
        else:
            raise UnsupportedParameter(
                f"{at}.type {json.dumps(kind)[:40]} is not supported: this server reads message, reasoning, "
                "function_call and function_call_output items",
                param=f"{at}.type",
            )
    return tuple(messages)


def _thinking_only(messages: list[Message]) -> bool:
    """Whether the last message is a reasoning item's thinking, with no answer yet."""
    last = messages[-1] if messages else None
    return last is not None and last.role == "assistant" and last.reasoning is not None and not (
        last.content or last.tool_calls)


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    """A reasoning item's thinking (as this server writes it, `content`'s
    `reasoning_text` parts), else its summary's text. Encrypted content
    is another server's, which only it can read."""
    if item.get("encrypted_content") is not None and not item.get("content"):
        raise UnsupportedParameter(
            f"{where}.encrypted_content cannot be read by this server: send the reasoning item's content",
            param=f"{where}.encrypted_content",
        )
    if item.get("content"):
        return content_text(item["content"], f"{where}.content", part_types=("reasoning_text",))
    return content_text(item.get("summary") or [], f"{where}.summary", part_types=("summary_text",))


def _message(item: Mapping[str, Any], where: str) -> Message:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidRequestError(
            f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", param=f"{where}.role"
        )
    text = _text_parts(item.get("content"), f"{where}.content")
    return Message("system" if role == "developer" else role, text)


def _text_parts(value: Any, where: str) -> str:
    return content_text(value, where, part_types=("input_text", "output_text", "text"))


def _function_call(item: Mapping[str, Any], where: str) -> ToolCall:
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise InvalidRequestError(f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    arguments = read_arguments(item.get("arguments", "{}"), f"{where}.arguments")
    return ToolCall(item["name"], arguments, id=item["call_id"])


def read_responses_tools(value: Any, where: str):
    """Function tools in the Responses shape, `{"type": "function", "name",
    "description", "parameters", "strict"}`; a tool this server cannot run
    (web_search, file_search, computer_use, mcp, ...) is refused by name."""
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array, not {json_type(value)}", param=where)
    as_chat = []
    for i, tool in enumerate(value):
        tool = json_object(tool, f"{where}[{i}]")
        if tool.get("type") != "function":
            raise UnsupportedParameter(
                f"{where}[{i}].type {json.dumps(tool.get('type'))[:40]} is not supported: this server runs "
                "no built-in tools; declare functions and run them yourself",
                param=f"{where}[{i}].type",
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        as_chat.append({"type": "function", "function": function})
    try:
        return read_tools(as_chat, where)
    except InvalidRequestError as exc:  # tools[i].function.name -> tools[i].name
        exc.param = exc.param.replace(".function", "") if exc.param else exc.param
        exc.message = exc.message.replace(".function", "")
        raise


def read_responses_tool_choice(value: Any, where: str) -> ToolChoice:
    if isinstance(value, str):
        if value not in ToolChoice.MODES:
            raise InvalidRequestError(f"{where} must be none, auto, required or name a function", param=where)
        return ToolChoice(value)
    choice = json_object(value, where)
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise UnsupportedParameter(
            f"{where} must be {{\"type\": \"function\", \"name\": ...}} on this server", param=where
        )
    return ToolChoice.function(choice["name"])


def read_reasoning(value: Any, where: str) -> str | None:
    """`reasoning`: its `effort` (None when not given); a `summary` cannot
    be written here (the thinking is returned whole, in reasoning items)."""
    reasoning = json_object(value, where)
    for key, member in reasoning.items():
        if key == "effort" or member is None:
            continue
        if key in ("summary", "generate_summary"):
            raise UnsupportedParameter(
                f"{where}.{key} is not supported by this server: the thinking comes whole, as reasoning items",
                param=f"{where}.{key}",
            )
        raise InvalidRequestError(f"{where}.{key} is not a reasoning option (effort, summary)", param=f"{where}.{key}")
    effort = reasoning.get("effort")
    return None if effort is None else read_reasoning_effort(effort, f"{where}.effort")


def read_text(value: Any, where: str) -> OutputFormat | None:
    """`text`: `{"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}`;
    `verbosity` other than `medium` cannot be honoured."""
    text = json_object(value, where)
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise UnsupportedParameter(
            f"{where}.verbosity is not supported by this server: the model's answers cannot be made shorter "
            "or longer on request",
            param=f"{where}.verbosity",
        )
    for key in text:
        if key not in ("format", "verbosity"):
            raise InvalidRequestError(f"{where}.{key} is not a text option (format, verbosity)", param=f"{where}.{key}")
    fmt = text.get("format")
    if fmt is None:
        return None
    fmt = json_object(fmt, f"{where}.format")
    if fmt.get("type") == "json_schema":  # the chat shape nests the schema one level deeper
        spec = {k: v for k, v in fmt.items() if k != "type"}
        fmt = {"type": "json_schema", "json_schema": spec}
    return read_response_format(fmt, f"{where}.format")


def read_metadata(value: Any, where: str) -> dict[str, str]:
    metadata = json_object(value, where)
    if len(metadata) > MAX_METADATA_KEYS or not all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()
    ):
        raise InvalidRequestError(
            f"{where} holds at most {MAX_METADATA_KEYS} string values (keys up to 64 characters, values up to 512)",
            param=where,
        )
    return dict(metadata)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResponsesRequest(SharedFields):
    """A `POST /v1/responses` body, its own fields only; `to_chat` gives
    the chat request the hooks see (`ChatRequest.origin` is this)."""

    endpoint: ClassVar[str] = RESPONSES_ENDPOINT

    input: tuple[Message, ...] = param((), read_input, required=True)
    instructions: str | None = param(None, string)
    max_output_tokens: int | None = param(None, integer(1))
    tools: tuple[Tool, ...] = param((), read_responses_tools)
    tool_choice: ToolChoice | None = param(None, read_responses_tool_choice)
    #: `text.format` as chat's `response_format`
    text: OutputFormat | None = param(None, read_text)
    #: `reasoning.effort`
    reasoning: str | None = param(None, read_reasoning)
    #: keep the response (and its conversation) for `previous_response_id`
    store: bool = param(True, boolean)
    previous_response_id: str | None = param(None, string)
    metadata: Mapping[str, str] = param({}, read_metadata)
    temperature: float = same_as(ChatRequest, "temperature")
    user: str | None = same_as(ChatRequest, "user")
    presence_penalty: float = same_as(ChatRequest, "presence_penalty")
    frequency_penalty: float = same_as(ChatRequest, "frequency_penalty")
    stop: tuple[str, ...] = same_as(ChatRequest, "stop")
    #: the conversation before this request's `input` (from `previous_response_id`)
    history: tuple[Message, ...] = ()

    @property
    def messages(self) -> tuple[Message, ...]:
        """The conversation the model sees: the instructions (this
        request's only: a previous response's are not carried over), the
        stored history, then the input."""
        system = (Message("system", self.instructions),) if self.instructions else ()
        return (*system, *self.history, *self.input)

    def to_chat(self, *, thinks: bool = False) -> ChatRequest:
        """The chat request this one is, for a model that thinks (`thinks`) or not.

        :raises InvalidRequestError: (400) naming the Responses field, as
            `reasoning.effort` for an effort the model cannot take.
        """
        values = self.shared_values()
        with_thinking(values, self.reasoning, thinks=thinks, where="reasoning.effort")
        return ChatRequest.checked(
            id=self.id, body=self.body, origin=self, messages=self.messages, max_tokens=self.max_output_tokens,
            tools=self.tools, tool_choice=self.tool_choice, response_format=self.text,
            reasoning_effort=self.reasoning, **values)

    def param_for(self, subject: str) -> str | None:
        return {"prompt": "input", "max_tokens": "max_output_tokens", "schema": "text.format"}.get(subject)

    def tool_result_param(self, index: int) -> str:
        # messages are instructions, history, then input: name the input item
        offset = len(self.messages) - len(self.input)
        return f"input[{index - offset}].call_id" if index >= offset else "previous_response_id"

    def tool_parameters_param(self, index: int) -> str:
        return f"tools[{index}].parameters"


def parse_responses_request(
    body: Mapping[str, Any], *, request_id: str, history: Sequence[Message] = (), fields: FieldPolicy = STRICT,
    thinks: bool = False,
) -> ChatRequest:
    """Read a Responses body for a model that thinks (`thinks`) or not,
    as the chat request the hooks see (its `origin` the `ResponsesRequest`);
    `history` is the stored conversation of its `previous_response_id` (the
    caller looks it up).

    :raises InvalidRequestError: (400) naming the Responses field at fault
        (one the field table refuses or does not know included).
    """
    check_fields(RESPONSES, body, fields)
    values = read_fields(ResponsesRequest, body)
    return ResponsesRequest(id=request_id, body=body, history=tuple(history), **values).to_chat(thinks=thinks)
