"""What constrains a request's output, whichever field a client names it
with: OpenAI's `response_format`, and the extensions other servers read
(vLLM's `structured_outputs` and its older `guided_*` fields, llama.cpp's
`grammar` and top-level `json_schema`, SGLang's `regex` and `ebnf`).

Every one is read into the same `OutputFormat` and compiled by the same
path (`grammars.grammar_for`, llguidance), so a regular expression, a choice
or a GBNF grammar constrains generation exactly as a JSON schema does, and a
bad one is a 400 naming the field it came from. A request names at most one
constraint: two are a 400, never one silently winning.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from lockgate.errors import InvalidRequestError, InvalidSchema, UnsupportedParameter
from lockgate.plugin_api.readers import (
    CHOICE,
    GRAMMAR,
    JSON_SCHEMA,
    REGEX,
    OutputFormat,
    Reader,
    json_object,
    json_type,
)

#: characters in one regular expression or grammar, checked before
#: llguidance compiles it
MAX_GRAMMAR_CHARS = 64 * 1024
#: strings one choice may list
MAX_CHOICES = 1024


def _text(kind: str) -> Reader:
    """A regular expression or grammar: a non-empty string, bounded."""

    def read(value: Any, where: str) -> OutputFormat:
        if not isinstance(value, str) or not value.strip():
            raise InvalidRequestError(f"{where} must be a non-empty string, not {json_type(value)}", param=where)
        if len(value) > MAX_GRAMMAR_CHARS:
            raise InvalidSchema(
                f"{where} holds {len(value)} characters; the limit is {MAX_GRAMMAR_CHARS}",
                param=where, code="schema_too_complex",
            )
        return OutputFormat(kind=kind, source=value, param=where)

    return read


def read_choice(value: Any, where: str) -> OutputFormat:
    """A list of strings, one of which the output is, exactly."""
    if not isinstance(value, list) or not value or not all(isinstance(s, str) and s for s in value):
        raise InvalidRequestError(f"{where} must be a non-empty array of non-empty strings", param=where)
    if len(value) > MAX_CHOICES or sum(len(s) for s in value) > MAX_GRAMMAR_CHARS:
        raise InvalidSchema(
            f"{where} lists at most {MAX_CHOICES} strings of {MAX_GRAMMAR_CHARS} characters in all",
            param=where, code="schema_too_complex",
        )
    return OutputFormat(kind=CHOICE, source=json.dumps(value), param=where)


def read_json_constraint(value: Any, where: str) -> OutputFormat:
    """A JSON schema as an object, or as the text of one (SGLang sends a
    string, vLLM either)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidSchema(f"{where} is a string that is not JSON: {exc}", param=where) from None
    if not isinstance(value, dict):
        raise InvalidSchema(f"{where} must be a JSON schema (an object), not {json_type(value)}", param=where)
    return OutputFormat(value, kind=JSON_SCHEMA, param=where)


read_regex = _text(REGEX)
read_grammar = _text(GRAMMAR)

#: `structured_outputs` members that constrain, each read as the field it names
_STRUCTURED = {
    "json": read_json_constraint,
    "regex": read_regex,
    "choice": read_choice,
    "grammar": read_grammar,
}
#: `structured_outputs` options that describe what lockgate does anyway:
#: accepted with these values (and null), refused with any other
_STRUCTURED_SETTLED = {
    # there is no other backend to fall back to
    "disable_fallback": (True, False),
    # generated JSON has no free whitespace (grammars.JSON_LAYOUT)
    "disable_any_whitespace": (True,),
    # objects with properties are closed (grammars.closed_objects)
    "disable_additional_properties": (True,),
}
_STRUCTURED_REFUSED = ("whitespace_pattern", "structural_tag")


def read_structured_outputs(value: Any, where: str) -> OutputFormat | None:
    """vLLM's `structured_outputs`: exactly one of `json`, `regex`,
    `choice`, `grammar` or `json_object: true`."""
    spec = json_object(value, where)
    found: list[OutputFormat] = []
    for key, member in spec.items():
        at = f"{where}.{key}"
        if member is None:
            continue
        if key in _STRUCTURED:
            found.append(_STRUCTURED[key](member, at))
        elif key == "json_object":
            if not isinstance(member, bool):
                raise InvalidRequestError(f"{at} must be a boolean, not {json_type(member)}", param=at)
            if member:
                found.append(OutputFormat({"type": "object"}, kind=JSON_SCHEMA, param=at))
        elif key in _STRUCTURED_SETTLED:
            if not any(member is v for v in _STRUCTURED_SETTLED[key]):
                raise UnsupportedParameter(f"{at}: only {_STRUCTURED_SETTLED[key]} is served", param=at)
        elif key in _STRUCTURED_REFUSED:
            raise UnsupportedParameter(f"{at} is not supported by this server", param=at)
        else:
            raise InvalidRequestError(
                f"{at} is not a structured_outputs option (json, regex, choice, grammar, json_object)", param=at
            )
    if len(found) > 1:
        raise InvalidRequestError(
            f"{where} names {found[0].param} and {found[1].param}; give one constraint", param=found[1].param
        )
    return found[0] if found else None


#: every request field that constrains the output besides `response_format`,
#: with its reader: the extensions of vLLM, llama.cpp's server and SGLang
CONSTRAINT_FIELDS: Mapping[str, Callable[[Any, str], OutputFormat | None]] = {
    "structured_outputs": read_structured_outputs,
    "guided_json": read_json_constraint,
    "guided_regex": read_regex,
    "guided_choice": read_choice,
    "guided_grammar": read_grammar,
    "json_schema": read_json_constraint,
    "grammar": read_grammar,
    "regex": read_regex,
    "ebnf": read_grammar,
}


def read_constraint(body: Mapping[str, Any], response_format: OutputFormat | None,
                    response_format_param: str) -> OutputFormat | None:
    """The one constraint of a request: its `response_format` (already read,
    None for text or absent) or one of the `CONSTRAINT_FIELDS`.

    :raises InvalidRequestError: (400) naming the second constraint given,
        or what is wrong with one.
    """
    found = [(response_format_param, response_format)] if response_format is not None else []
    for name, reader in CONSTRAINT_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        constraint = reader(value, name)
        if constraint is not None:
            found.append((name, constraint))
    if len(found) > 1:
        (first, _), (second, _) = found[:2]
        raise InvalidRequestError(
            f"{first} and {second} both constrain the output; give one of them", param=second
        )
    return found[0][1] if found else None
