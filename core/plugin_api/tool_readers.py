"""Readers of the tool fields of a chat body (`tools`, the deprecated
`functions`, `tool_choice`), which the request kinds declare theirs with
(the Responses and Messages kinds through `read_function`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from lockgate.errors import InvalidRequestError
from lockgate.plugin_api.readers import json_object, boolean, json_type, string
from lockgate.plugin_api.tool_calls import Tool, ToolChoice

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOL_CHOICES = ToolChoice.MODES

#: functions one request may offer (OpenAI's limit)
MAX_TOOLS = 128


def tool_objects(value: Any, where: str) -> list[tuple[str, Mapping[str, Any]]]:
    """The objects of a `tools` array (at most `MAX_TOOLS`), each with its param path."""
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array, not {json_type(value)}", param=where)
    _at_most_max_tools(value, where)
    return [(f"{where}[{i}]", json_object(item, f"{where}[{i}]")) for i, item in enumerate(value)]


def read_tools(value: Any, where: str) -> tuple[Tool, ...]:
    """`tools`: `[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]`."""
    tools, names = [], set()
    for at, tool in tool_objects(value, where):
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"{at}.type must be 'function' (this server runs no built-in tools)", param=f"{at}.type"
            )
        tools.append(read_function(tool.get("function"), f"{at}.function", names))
    return tuple(tools)


def read_functions(value: Any, where: str) -> tuple[Tool, ...]:
    """The deprecated `functions`: `[{"name", "description", "parameters"}]`."""
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be an array, not {json_type(value)}", param=where)
    _at_most_max_tools(value, where)
    names: set[str] = set()
    return tuple(read_function(item, f"{where}[{i}]", names) for i, item in enumerate(value))


def _at_most_max_tools(value: list, where: str) -> None:
    if len(value) > MAX_TOOLS:
        raise InvalidRequestError(f"{where} holds {len(value)} functions; at most {MAX_TOOLS} are supported",
                                  param=where)


def read_function(value: Any, where: str, names: set[str]) -> Tool:
    function = json_object(value, where)
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
    (legacy: `{"name"}`), as a `ToolChoice`."""
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise InvalidRequestError(
                f"{where} must be one of {', '.join(TOOL_CHOICES)} or names a function, got {json.dumps(value)[:60]}",
                param=where,
            )
        return ToolChoice(value)
    choice = json_object(value, where)
    function = choice.get("function") if "function" in choice else choice
    if "function" in choice and choice.get("type") != "function":
        raise InvalidRequestError(f"{where}.type must be 'function'", param=f"{where}.type")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError(f"{where}.function.name must be a string", param=where)
    return ToolChoice.function(name)
