"""Chat templates rendered as Hugging Face's `apply_chat_template` renders them.

A chat template is untrusted Jinja from a model file. It runs in Jinja's
immutable sandbox with the environment templates are written for
(transformers' own, which llama.cpp's `minja` follows too): `trim_blocks`
and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}`
block tag (rendered as its body), a `tojson` filter that leaves non-ASCII
text and HTML characters alone, and the globals `raise_exception`,
`strftime_now`, `dict` and a `namespace` that refuses underscore names.

Rendered here rather than by transformers, whose import alone costs a
serving process about 20 MiB (issue 38). `tests/unit/models/test_chat_template.py`
holds the output to transformers' on real templates.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TOOL_USE", "pick_template", "render_chat_template", "templates_by_name"]

#: the name of the template to render with when tools are offered
TOOL_USE = "tool_use"

#: the names a message's reasoning goes by; templates read the first
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text
    for training masks; rendering it is rendering its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)`, with nothing else of the type to reach through."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing attributes that start with an underscore."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's signature trick, so `namespace(self=...)` works
        self, args = args[0], args[1:]
        values = dict(*args, **kwargs)
        for name in values:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot store {name!r} on a namespace (an underscore name)")


@functools.lru_cache(maxsize=32)
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    return environment.from_string(template)


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (a fresh copy the template may
    not escape from); anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):  # np.bool_(False) would be a truthy placeholder
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _messages(conversation: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The messages as templates expect them: plain dicts without the keys
    whose value is None (`content: null` beside tool calls), and the
    reasoning under each of its names."""
    messages = []
    for message in conversation:
        if not isinstance(message, Mapping):
            raise TypeError(f"a chat message must be a mapping, not {type(message).__name__}")
        message = {key: value for key, value in _plain(message).items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def templates_by_name(chat_template: str | Mapping[str, str] | None,
                      named: Mapping[str, str] | None = None) -> dict[str, str]:
    """A tokenizer's chat templates by name: "default" for `chat_template`
    and the named ones beside it (a GGUF's `tokenizer.chat_template.<name>`);
    a Hugging Face config's `chat_template` may itself be such a mapping."""
    if isinstance(chat_template, Mapping):
        return {name: text for name, text in chat_template.items() if text}
    templates = dict(named or {})
    if chat_template:
        templates["default"] = chat_template
    return templates


def pick_template(templates: Mapping[str, str], *, tools: bool) -> str | None:
    """The template a request renders with, as llama.cpp's server picks it:
    `tool_use` when tools are offered and there is one, else the default
    (or `tool_use` when that is all there is); None when there is none."""
    if tools and TOOL_USE in templates:
        return templates[TOOL_USE]
    return templates.get("default") or templates.get(TOOL_USE)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **variables: Any,
) -> str:
    """Render `template` for `messages`.

    :param tools: the tools as JSON schemas (`{"type": "function", ...}`).
    :param documents: retrieval documents, for templates that take them.
    :param variables: more names the template sees: the tokenizer's special
        tokens (`bos_token`, ...) and a request's `chat_template_kwargs`
        (`enable_thinking`, ...).
    :raises jinja2.TemplateError: the template is malformed or refused the
        messages (`raise_exception`); `SecurityError` where it tried what
        the sandbox forbids. Anything else its code raises passes through.
    """
    if not messages:
        raise ValueError("a chat template needs at least one message")
    return _compiled(template).render(
        messages=_messages(messages),
        tools=_plain(list(tools)) if tools is not None else None,
        documents=_plain(list(documents)) if documents is not None else None,
        add_generation_prompt=add_generation_prompt,
        **_plain(variables),
    )
