"""Helpers the built-in tool-call formats share: the tool list shown to a
model, and reading JSON calls back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from lockgate.plugin_api.tool_calls import Tool, ToolCall, arguments_text


def tool_list(tools: Sequence[Tool]) -> str:
    """The tools as JSON lines, for a system prompt that lists them."""
    return "\n".join(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools)


def calls_from(objects, arguments_key: str = "arguments") -> list[ToolCall] | None:
    """Calls from decoded JSON objects, or None if any is not a call."""
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
        calls.append(ToolCall(obj["name"], arguments_text(arguments)))
    return calls


def parse_json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def complete_items(text: str, opening: str) -> list:
    """The JSON values of an array that `text` opens with `opening` and that
    were written out whole before the text ends."""
    text = text.strip()
    if not text.startswith(opening):
        return []
    decoder, items, at = json.JSONDecoder(), [], len(opening)
    while True:
        while at < len(text) and text[at] in " ,\n":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)


#: how the generic envelope opens, with calls or with an answer: what its
#: grammar writes and what its parser reads a cut output by
