"""`gemma4`: `<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>` (Gemma 4).
"""

from __future__ import annotations

import json
import re
from typing import Any

from lockgate.plugin_api.tool_calls import (
    CALL,
    ParsedOutput,
    ToolCall,
    ToolCallFormat,
    arguments_text,
    lark_json,
    lark_string,
)
from lockgate.plugins.tool_formats.common import parse_json, tool_list


_GEMMA_QUOTE = '<|"|>'
_GEMMA_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_GEMMA_WORDS = {"true": True, "false": False, "null": None, "none": None, "None": None}


def _gemma_items(text: str, at: int, close: str, item) -> tuple[list, int]:
    """The items of an object or array opening at `at`, each read by
    `item(at) -> (item, at)`, separated by commas up to `close`."""
    items, at = [], _skip_space(text, at + 1)
    while not text.startswith(close, at):
        one, at = item(at)
        items.append(one)
        at = _skip_space(text, at)
        if text.startswith(",", at):
            at = _skip_space(text, at + 1)
        elif not text.startswith(close, at):
            raise ValueError(f"expected , or {close}")
    return items, at + 1


def _gemma_value(text: str, at: int):
    """The value Gemma 4 wrote at `at` and where it ends: `<|"|>`-quoted
    text, `{key:value,...}` with bare keys, `[...]`, numbers, true, false,
    null (jinja's `None` too); JSON's quoted strings and keys are read as
    well (what the grammar has it write under `required`).

    :raises ValueError: not such a value.
    """
    at = _skip_space(text, at)
    if text.startswith(_GEMMA_QUOTE, at):
        end = text.find(_GEMMA_QUOTE, at + len(_GEMMA_QUOTE))
        if end < 0:
            raise ValueError("unclosed string")
        return text[at + len(_GEMMA_QUOTE):end], end + len(_GEMMA_QUOTE)
    if text.startswith('"', at):
        return json.JSONDecoder().raw_decode(text, at)
    if text.startswith("{", at):
        def member(at: int) -> tuple[tuple[str, Any], int]:
            key, at = _gemma_key(text, at)
            value, at = _gemma_value(text, at)
            return (key, value), at

        members, at = _gemma_items(text, at, "}", member)
        return dict(members), at
    if text.startswith("[", at):
        return _gemma_items(text, at, "]", lambda at: _gemma_value(text, at))
    number = _GEMMA_NUMBER.match(text, at)
    if number:
        return json.loads(number[0]), number.end()
    for word, value in _GEMMA_WORDS.items():
        if text.startswith(word, at):
            return value, at + len(word)
    raise ValueError(f"no value at {at}")


def _gemma_key(text: str, at: int) -> tuple[str, int]:
    if text.startswith(_GEMMA_QUOTE, at) or text.startswith('"', at):
        key, at = _gemma_value(text, at)
    else:
        end = text.find(":", at)
        if end < 0 or "}" in text[at:end]:
            raise ValueError("expected a key")
        key, at = text[at:end].strip(), end
    at = _skip_space(text, at)
    if not text.startswith(":", at):
        raise ValueError("expected :")
    return str(key), at + 1


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _gemma_argument(value) -> str:
    """A value as Gemma 4's template writes an argument (`format_argument`
    with bare keys)."""
    if isinstance(value, str):
        return _GEMMA_QUOTE + value + _GEMMA_QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{_gemma_argument(value[key])}" for key in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_gemma_argument(item) for item in value) + "]"
    return "null" if value is None else json.dumps(value)


class Gemma4Format(ToolCallFormat):
    """`<|tool_call>call:NAME{key:value,...}<tool_call|>`, strings between
    `<|"|>` and keys bare, as Gemma 4 writes calls (llama.cpp's
    common/parsers/gemma4.cpp reads the same). Constrained (`required`, a
    named tool), the arguments are JSON inside those markers, so that the
    grammar engine holds them to the tool's schema, nested objects and
    bounds included (llama.cpp constrains the markers and a schemaless
    Gemma-syntax object; vLLM constrains a JSON list of calls instead of any
    model's own syntax)."""

    name = "gemma4"
    # the markers are tokens of Gemma 4's vocabulary (user-defined in its
    # GGUF files, special in some tokenizer.json)
    keeps_special_tokens = True
    _OPEN = "<|tool_call>call:"
    _CLOSE = "<tool_call|>"
    _NAME = re.compile(r"[^{<\s]+")

    @classmethod
    def fits(cls, chat_template):
        return cls._OPEN in (chat_template or "")

    def instructions(self, tools):
        return (
            "You can call these functions (each with a JSON schema of its parameters):\n"
            f"{tool_list(tools)}\n"
            f"To call one, write {self._OPEN}NAME{{key:{_GEMMA_QUOTE}text{_GEMMA_QUOTE},count:1}}{self._CLOSE}"
        )

    def render_calls(self, calls):
        return "".join(
            f"{self._OPEN}{c.name}{_gemma_argument(parse_json(c.arguments) or {})}{self._CLOSE}" for c in calls
        )

    def grammar(self, tools, *, required, max_calls):
        if not required:
            return None
        calls = " | ".join(
            f"{lark_string(self._OPEN + t.name)} {lark_json(t.parameters)} {lark_string(self._CLOSE)}" for t in tools
        )
        most = f"{{1,{max_calls}}}" if max_calls > 1 else ""
        return f"start: {CALL}{most}\n{CALL}: {calls}\n"

    def parse(self, text):
        calls, kept, at = [], [], 0
        while True:
            start = text.find(self._OPEN, at)
            if start < 0:
                break
            kept.append(text[at:start])
            name = self._NAME.match(text, start + len(self._OPEN))
            try:
                if name is None:
                    raise ValueError("no name")
                arguments, end = _gemma_value(text, name.end())
                if not isinstance(arguments, dict):
                    raise ValueError("arguments are not an object")
            except (ValueError, RecursionError):
                # cut short (max_tokens) or not a call after all: the rest is
                # held back as a call was, and is neither
                at = len(text)
                break
            end = _skip_space(text, end)
            at = end + len(self._CLOSE) if text.startswith(self._CLOSE, end) else end
            calls.append(ToolCall(name[0], arguments_text(arguments)))
        kept.append(text[at:])
        return ParsedOutput("".join(kept).strip() or None, calls)

    def start_markers(self):
        return ("<|tool_call>",)
