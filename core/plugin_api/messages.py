"""Anthropic's Messages API request, typed: one more protocol mapping onto
the chat request the hooks already know.

A `POST /v1/messages` body is read into a `MessagesRequest`, which holds
the Messages fields alone, and becomes (`to_chat`) the `ChatRequest` the
hooks see: its `messages` built from `system` and Anthropic's content
blocks (`text`; `tool_use` in assistant turns as tool calls; `tool_result`
in user turns as tool messages), its `tools` from `input_schema` tools, its
`stop` from `stop_sequences`. A plugin sees it exactly as a chat request
(`request.endpoint` says "messages"; the Messages request is its `origin`). What this server cannot serve
(images, documents, server tools, `cache_control` other than the prefix
cache's ephemeral one, thinking on a model that writes none) is refused with
a 400 naming the field, never dropped. An assistant turn's `thinking` blocks
are its thinking (`Message.reasoning`), as templates of models that think
read it. Every parse error names the Messages field
(`messages[1].content[0].tool_use_id`, `tools[0].input_schema`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar

from lockgate.errors import InvalidRequestError, UnsupportedParameter
from lockgate.plugin_api.readers import (
    MAX_STOP_SEQUENCES,
    Message,
    OutputFormat,
    json_object,
    integer,
    json_type,
    number,
    read_response_format,
    string,
)
from lockgate.plugin_api.fields import MESSAGES, STRICT, FieldPolicy, check_fields
from lockgate.plugin_api.body import param, read_fields, same_as
from lockgate.plugin_api.request import ChatRequest
from lockgate.plugin_api.shared_fields import SharedFields
from lockgate.plugin_api.tool_calls import Tool, ToolCall, ToolChoice
from lockgate.plugin_api.tool_readers import read_function, tool_objects

MESSAGES_ENDPOINT = "messages"

def read_system(value: Any, where: str) -> str:
    """`system`: a string, or text blocks."""
    if isinstance(value, str):
        return value
    return "".join(_text_blocks(value, where))


def _text_blocks(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a string or an array of text blocks, not {json_type(value)}",
                                  param=where)
    texts = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        block = _block(block, at)
        if block.get("type") != "text":
            _refuse_block(block, at, "text blocks")
        texts.append(string(block.get("text"), f"{at}.text"))
    return texts


def _block(value: Any, where: str) -> Mapping[str, Any]:
    """A content block, its `cache_control` checked: the prefix cache keeps
    every prompt's KV without being asked, which is what an `ephemeral`
    breakpoint asks for; other kinds or lifetimes are refused."""
    block = json_object(value, where)
    control = block.get("cache_control")
    if control is not None:
        at = f"{where}.cache_control" if where else "cache_control"
        control = json_object(control, at)
        if control.get("type") != "ephemeral" or control.get("ttl", "5m") != "5m":
            raise UnsupportedParameter(
                f"{at}: only {{\"type\": \"ephemeral\"}} is served (by the prefix cache)", param=at)
    return block


def _refuse_block(block: Mapping[str, Any], where: str, served: str) -> None:
    raise UnsupportedParameter(
        f"{where}.type {json.dumps(block.get('type'))[:40]} is not supported here: this server reads {served}",
        param=f"{where}.type",
    )


def read_anthropic_messages(value: Any, where: str) -> tuple[Message, ...]:
    """`messages`: user and assistant turns, each a string or content
    blocks. A user turn's `tool_result` blocks become tool messages (before
    its text); an assistant turn's `tool_use` blocks become its tool calls."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{where} must be a non-empty array of messages", param=where)
    messages: list[Message] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        item = json_object(item, at)
        role = item.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequestError(f"{at}.role must be user or assistant, got {role!r}", param=f"{at}.role")
        content = item.get("content")
        if isinstance(content, str):
            messages.append(Message(role, content))
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(f"{at}.content must be a string or an array of content blocks, not "
                                      f"{json_type(content)}", param=f"{at}.content")
        texts: list[str] = []
        calls: list[ToolCall] = []
        thoughts: list[str] = []
        for j, block in enumerate(content):
            block_at = f"{at}.content[{j}]"
            block = _block(block, block_at)
            kind = block.get("type")
            if kind == "text":
                texts.append(string(block.get("text"), f"{block_at}.text"))
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_use(block, block_at))
            elif kind == "thinking" and role == "assistant":
                # its signature is Anthropic's, for Anthropic's models: there is nothing to check it against
                thoughts.append(string(block.get("thinking"), f"{block_at}.thinking"))
            elif kind == "tool_result" and role == "user":
                tool_use_id = string(block.get("tool_use_id"), f"{block_at}.tool_use_id")
                result = block.get("content", "")
                text = result if isinstance(result, str) else "".join(_text_blocks(result, f"{block_at}.content"))
                messages.append(Message("tool", text, tool_call_id=tool_use_id))
            else:
                served = ("text, thinking and tool_use blocks" if role == "assistant"
                          else "text and tool_result blocks")
                _refuse_block(block, block_at, served)
        if texts or calls or role == "assistant":
            messages.append(Message(role, "".join(texts), tool_calls=tuple(calls),
                                    reasoning="".join(thoughts) if thoughts else None))
    return tuple(messages)


def _tool_use(block: Mapping[str, Any], where: str) -> ToolCall:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise InvalidRequestError(f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    arguments = json_object(block.get("input", {}), f"{where}.input")
    return ToolCall(block["name"], json.dumps(arguments, ensure_ascii=False), id=block["id"])


def read_anthropic_tools(value: Any, where: str) -> tuple[Tool, ...]:
    """`tools`: `{"name", "description", "input_schema"}` (type absent or
    "custom"); Anthropic's server tools (web search, code execution, bash,
    the text editor, ...) are refused by name: this server runs none."""
    tools, names = [], set()
    for at, tool in tool_objects(value, where):
        if tool.get("type", "custom") != "custom":
            raise UnsupportedParameter(
                f"{at}.type {json.dumps(tool.get('type'))[:60]} is not supported: this server runs no server "
                "tools; declare tools with an input_schema and run them yourself",
                param=f"{at}.type",
            )
        if "input_schema" not in tool:
            raise InvalidRequestError(f"{at}.input_schema is required", param=f"{at}.input_schema")
        as_function = {"name": tool.get("name"), "description": tool.get("description"),
                       "parameters": tool["input_schema"]}
        try:
            tools.append(read_function(as_function, at, names))
        except InvalidRequestError as exc:
            exc.param = (exc.param or "").replace(".parameters", ".input_schema") or None
            exc.message = exc.message.replace(".parameters", ".input_schema")
            raise
    return tuple(tools)


def read_anthropic_tool_choice(value: Any, where: str) -> ToolChoice:
    """`tool_choice`: `{"type": "auto" | "any" | "tool" | "none"}` ("tool"
    with a `name`), as the chat request's "auto", "required", a named
    function and "none"."""
    choice = json_object(value, where)
    kind = choice.get("type")
    if kind == "tool":
        return ToolChoice.function(string(choice.get("name"), f"{where}.name"))
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if mapped is None:
        raise InvalidRequestError(f"{where}.type must be auto, any, tool or none, got {kind!r}",
                                  param=f"{where}.type")
    return ToolChoice(mapped)


def read_output_config(value: Any, where: str) -> OutputFormat | None:
    """`output_config`: its `format` (`{"type": "json_schema", "schema"}`),
    the chat request's `response_format`; other settings (`effort`, which
    tunes extended thinking) are refused."""
    config = json_object(value, where)
    for key in config:
        if key != "format" and config[key] is not None:
            raise UnsupportedParameter(f"{where}.{key} is not supported by this server", param=f"{where}.{key}")
    fmt = config.get("format")
    if fmt is None:
        return None
    fmt = json_object(fmt, f"{where}.format")
    if fmt.get("type") != "json_schema":
        raise InvalidRequestError(f"{where}.format.type must be json_schema", param=f"{where}.format.type")
    spec = {"name": "output", "schema": fmt.get("schema")}
    try:
        return read_response_format({"type": "json_schema", "json_schema": spec}, f"{where}.format")
    except InvalidRequestError as exc:
        exc.message = exc.message.replace(f"{where}.format.json_schema", f"{where}.format")
        raise


#: Anthropic's least thinking budget
MIN_THINKING_BUDGET = 1024


def read_thinking(value: Any, where: str) -> bool | None:
    """`thinking`: `{"type": "enabled", "budget_tokens"}` or `{"type":
    "disabled"}`, as the template's `enable_thinking` (what Qwen3's reads).
    The budget is checked as Anthropic checks it (at least 1024 and below
    `max_tokens`, see `parse_messages_request`); the thinking is bounded by
    `max_tokens` as a whole, not by the budget."""
    thinking = json_object(value, where)
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind != "enabled":
        raise InvalidRequestError(f"{where}.type must be enabled or disabled, got {kind!r}", param=f"{where}.type")
    integer(MIN_THINKING_BUDGET)(thinking.get("budget_tokens"), f"{where}.budget_tokens")
    return True


def read_stop_sequences(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, list) and len(value) <= MAX_STOP_SEQUENCES and all(isinstance(s, str) and s for s in value):
        return tuple(value)
    raise InvalidRequestError(f"{where} must be an array of at most {MAX_STOP_SEQUENCES} non-empty strings",
                              param=where)


def read_anthropic_metadata(value: Any, where: str) -> str | None:
    """`metadata`: its `user_id`, the chat request's `user`."""
    metadata = json_object(value, where)
    user_id = metadata.get("user_id")
    return None if user_id is None else string(user_id, f"{where}.user_id")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MessagesRequest(SharedFields):
    """A `POST /v1/messages` (or `/v1/messages/count_tokens`) body, its own
    fields only; `to_chat` gives the chat request the hooks see
    (`ChatRequest.origin` is this)."""

    endpoint: ClassVar[str] = MESSAGES_ENDPOINT

    messages: tuple[Message, ...] = param((), read_anthropic_messages, required=True)
    system: str | None = param(None, read_system)
    max_tokens: int | None = param(None, integer(1))
    temperature: float = param(1.0, number(0, 1))
    stop_sequences: tuple[str, ...] = param((), read_stop_sequences)
    tools: tuple[Tool, ...] = param((), read_anthropic_tools)
    tool_choice: ToolChoice | None = param(None, read_anthropic_tool_choice)
    #: `thinking` switched on (True) or off (False); None: the template's default
    thinking: bool | None = param(None, read_thinking)
    #: `output_config.format` as chat's `response_format`
    output_config: OutputFormat | None = param(None, read_output_config)
    #: `metadata.user_id`
    metadata: str | None = param(None, read_anthropic_metadata)
    skip_special_tokens: bool = same_as(ChatRequest, "skip_special_tokens")
    stop_token_ids: tuple[int, ...] = same_as(ChatRequest, "stop_token_ids")

    def to_chat(self) -> ChatRequest:
        """The chat request this one is: the system prompt as the first
        message, `thinking` as the template's `enable_thinking`, Anthropic's
        `disable_parallel_tool_use` as `parallel_tool_calls` false."""
        values = self.shared_values()
        if self.thinking is not None:
            values["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        choice = self.body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True:
            values["parallel_tool_calls"] = False
        system = (Message("system", self.system),) if self.system else ()
        return ChatRequest.checked(
            id=self.id, body=self.body, origin=self, messages=(*system, *self.messages), max_tokens=self.max_tokens,
            temperature=self.temperature, stop=self.stop_sequences, tools=self.tools, tool_choice=self.tool_choice,
            response_format=self.output_config, user=self.metadata, **values)

    def param_for(self, subject: str) -> str | None:
        if subject == "schema":
            return "output_config.format" if self.output_config is not None else "tools"
        return {"prompt": "messages", "max_tokens": "max_tokens"}.get(subject)

    def tool_result_param(self, index: int) -> str:
        return "messages"  # turns were split into messages: name the field

    def tool_parameters_param(self, index: int) -> str:
        return f"tools[{index}].input_schema"


def parse_messages_request(body: Mapping[str, Any], *, request_id: str, count_only: bool = False,
                           thinks: bool = False, fields: FieldPolicy = STRICT) -> ChatRequest:
    """Read a Messages body (`count_only`: a count_tokens body, which has
    no `max_tokens`) for a model that thinks (`thinks`: it has a reasoning
    format) or not, as the chat request the hooks see (its `origin` the
    `MessagesRequest`).

    :raises InvalidRequestError: (400) naming the Messages field at fault
        (one the field table refuses or does not know included).
    """
    check_fields(MESSAGES, body, fields)
    if body.get("cache_control") is not None:
        _block({"cache_control": body["cache_control"]}, "")  # automatic caching: the prefix cache's
    if not count_only and body.get("max_tokens") is None:
        raise InvalidRequestError("max_tokens is required", param="max_tokens")
    values = read_fields(MessagesRequest, body)
    if values.get("thinking"):
        if not thinks:
            raise UnsupportedParameter(
                "thinking is not supported for this model: it writes no reasoning apart from its answer",
                param="thinking",
            )
        budget = body["thinking"]["budget_tokens"]
        if not count_only and budget >= values["max_tokens"]:
            raise InvalidRequestError(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                      f"({values['max_tokens']})", param="thinking.budget_tokens")
    return MessagesRequest(id=request_id, body=body, **values).to_chat()
