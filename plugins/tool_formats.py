"""Built-in `lockgate_tool_call_format`: the tool-call formats lockgate
knows, and which one a model gets.

* `generic`: a JSON envelope, `{"tool_calls": [{"name", "arguments"}]}` or
  `{"response": "..."}`, for models whose template knows no tools (the
  default model's); llama.cpp's server does the same for such templates.
* `hermes`: `<tool_call>{"name", "arguments"}</tool_call>` (Hermes, Qwen 2+).
* `qwen3-coder`: `<tool_call>` around `<function=NAME>` and one
  `<parameter=KEY>` per argument, its value bare text (Qwen3-Coder, Qwen3.5).
* `llama3`: a bare JSON object `{"name", "parameters"}`, optionally after
  `<|python_tag|>`, several joined by `;` (Llama 3.1+ JSON tool calling).
* `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`
  (Mistral v0.3+), or `[TOOL_CALLS]name[ARGS]{...}` (newer templates).
* `gemma4`: `<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>` (Gemma 4).

The format follows from the chat template (the markers it writes), unless
the operator names one with `--tool-call-format`; formats of other plugins
are tried first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
import string
from collections.abc import Sequence

from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.plugin_api.tool_calls import (
    CALL,
    ParsedOutput,
    Tool,
    ToolCall,
    ToolCallFormat,
    arguments_text,
    calls_grammar,
    lark_json,
    lark_string,
    repeated,
)


def _tool_list(tools: Sequence[Tool]) -> str:
    return "\n".join(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools)


def _calls_from(objects, arguments_key: str = "arguments") -> list[ToolCall] | None:
    """Calls from decoded JSON objects, or None if any is not a call."""
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
        calls.append(ToolCall(obj["name"], arguments_text(arguments)))
    return calls


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _complete_items(text: str, opening: str) -> list:
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
_CALLS_OPENING = '{"tool_calls": ['
_ANSWER_OPENING = '{"response": "'


def _opens_envelope(text: str) -> bool:
    """Whether `text` is the generic envelope cut short: a start of either
    opening, or calls none of which was written out whole."""
    text = text.strip()
    return bool(text) and any(
        opening.startswith(text) or text.startswith(opening) for opening in (_CALLS_OPENING, _ANSWER_OPENING)
    )


def _string_prefix(text: str, opening: str) -> str | None:
    """The text of a JSON string that `text` opens with `opening`, as far as
    it was written before the text ends."""
    text = text.strip()
    if not text.startswith(opening):
        return None
    rest = text[len(opening):]
    for end in range(len(rest), max(len(rest) - 8, -1), -1):  # an escape may be cut in half
        try:
            return json.loads('"' + rest[:end] + '"')
        except ValueError:
            continue
    return None


class GenericFormat(ToolCallFormat):
    name = "generic"

    @classmethod
    def fits(cls, chat_template):
        return True  # the catch-all, registered last

    def instructions(self, tools):
        return (
            "You can call these tools (each with a JSON schema of its arguments):\n"
            f"{_tool_list(tools)}\n"
            'Answer with one JSON object: {"tool_calls": [{"name": "<tool name>", "arguments": {...}}]} '
            'to call tools, or {"response": "<your answer>"} to answer directly. Once the tool results '
            'you need are in the conversation, answer with {"response": "..."}.'
        )

    def render_calls(self, calls):
        return json.dumps(
            {"tool_calls": [{"name": c.name, "arguments": _json(c.arguments) or {}} for c in calls]},
            ensure_ascii=False,
        )

    def grammar(self, tools, *, required, max_calls):
        # "{" a lexeme of its own: the answer's `%json` opens with one too, and
        # llguidance's lexer does not back off a longer literal it has begun
        envelope = (lark_string("{"), lark_string(_CALLS_OPENING[1:]), repeated(CALL, ", ", max_calls),
                    lark_string("]}"))
        calls = " ".join(envelope)
        return calls_grammar(calls if required else f"({calls}) | {lark_json(self._ANSWER)}", tools)

    _ANSWER = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
               "additionalProperties": False}

    def answer_grammar(self):
        # the conversation's earlier turns are envelopes: so is this answer
        return "start: " + lark_json(self._ANSWER)

    def parse(self, text):
        obj = _json(text.strip())
        if obj is None:  # cut short (max_tokens): the calls written out whole still count
            calls = _calls_from(_complete_items(text, _CALLS_OPENING))
            if calls:
                return ParsedOutput(None, calls)
            answer = _string_prefix(text, _ANSWER_OPENING)
            if answer is not None:  # and an answer cut short is still the answer
                return ParsedOutput(answer or None, [])
            if _opens_envelope(text):  # cut before a call or an answer was whole: neither
                return ParsedOutput(None, [])
        if isinstance(obj, dict):
            if isinstance(obj.get("tool_calls"), list):
                calls = _calls_from(obj["tool_calls"])
                if calls is not None:
                    return ParsedOutput(None, calls)
            if isinstance(obj.get("tool_call"), dict):  # one call, as some models write it
                calls = _calls_from([obj["tool_call"]])
                if calls is not None:
                    return ParsedOutput(None, calls)
            if isinstance(obj.get("response"), str):
                return ParsedOutput(obj["response"], [])
        return ParsedOutput(text or None, [])


class HermesFormat(ToolCallFormat):
    name = "hermes"

    @classmethod
    def fits(cls, chat_template):
        return "<tool_call>" in (chat_template or "")
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def instructions(self, tools):
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{_tool_list(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def render_calls(self, calls):
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": c.name, "arguments": _json(c.arguments) or {}}) + "\n</tool_call>"
            for c in calls
        )

    def grammar(self, tools, *, required, max_calls):
        if not required:
            return None
        tagged = " ".join((lark_string("<tool_call>\n"), CALL, lark_string("\n</tool_call>")))
        return calls_grammar(repeated(tagged, "\n", max_calls), tools)

    def parse(self, text):
        calls, spans = [], []
        for match in self._CALL.finditer(text):
            found = _calls_from([_json(match[1])])
            if found is None:
                continue
            calls += found
            spans.append(match.span())
        content = text
        for start, end in reversed(spans):
            content = content[:start] + content[end:]
        return ParsedOutput(content.strip() or None, calls)

    def start_markers(self):
        return ("<tool_call>",)


class Llama3Format(ToolCallFormat):
    name = "llama3"

    @classmethod
    def fits(cls, chat_template):
        template = chat_template or ""
        return "<|python_tag|>" in template or "ipython" in template
    keeps_special_tokens = True
    _TAG = "<|python_tag|>"

    def instructions(self, tools):
        return (
            "Given the following functions, please respond with a JSON for a function call with its "
            "proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name '
            "and its value}. Do not use variables.\n\n" + _tool_list(tools)
        )

    def render_calls(self, calls):
        return "; ".join(json.dumps({"name": c.name, "parameters": _json(c.arguments) or {}}) for c in calls)

    def grammar(self, tools, *, required, max_calls):
        if not required:
            return None
        return calls_grammar(repeated(CALL, "; ", max_calls), tools, arguments_key="parameters")

    def parse(self, text):
        body = text.strip().removeprefix(self._TAG).strip()
        if body.startswith("{"):
            decoded = _json(body)
            objects = [decoded] if decoded is not None else [_json(part) for part in body.split(";")]
            calls = _calls_from(objects, "parameters")
            if calls:
                return ParsedOutput(None, calls)
        return ParsedOutput(text or None, [])

    def leading_markers(self):
        return (self._TAG, "{")


class MistralFormat(ToolCallFormat):
    name = "mistral"

    @classmethod
    def fits(cls, chat_template):
        return "[TOOL_CALLS]" in (chat_template or "")
    keeps_special_tokens = True
    _TAG = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_-]+)\s*\[ARGS\]\s*(\{.*?\})(?=\s*\[TOOL_CALLS\]|\s*$)", re.S)

    def instructions(self, tools):
        return (
            f"You can call these tools (each with a JSON schema of its arguments):\n{_tool_list(tools)}\n"
            f'To call tools, answer with {self._TAG} then a JSON array of {{"name": ..., "arguments": {{...}}}}.'
        )

    def render_calls(self, calls):
        return self._TAG + json.dumps([{"name": c.name, "arguments": _json(c.arguments) or {}} for c in calls])

    def grammar(self, tools, *, required, max_calls):
        if not required:
            return None
        return calls_grammar(" ".join((lark_string("["), repeated(CALL, ", ", max_calls), lark_string("]"))), tools)

    def parse(self, text):
        body = text.strip()
        named = self._NAMED.findall(body)
        if named:
            return ParsedOutput(None, [
                ToolCall(name, arguments_text(_json(args) or {}), id=self.new_call_id()) for name, args in named
            ])
        head, tag, rest = body.partition(self._TAG)
        candidate = rest if tag else body
        decoded = _json(candidate.strip())
        if isinstance(decoded, list) and decoded:
            calls = _calls_from(decoded)
            if calls is not None:
                # Nemo's template writes each call's id after it: a model
                # that writes one in the right shape keeps it
                ids = [item.get("id") for item in decoded]
                return ParsedOutput(head.strip() or None, [
                    dataclasses.replace(call, id=i if _is_mistral_id(i) else self.new_call_id())
                    for call, i in zip(calls, ids)
                ])
        return ParsedOutput(text or None, [])

    def start_markers(self):
        return (self._TAG,)

    def leading_markers(self):
        return ("[",)

    def new_call_id(self):
        # Mistral's templates refuse an id that is not 9 letters and digits
        # ("Tool call IDs should be alphanumeric strings with length 9!"),
        # as Mistral's API does; vLLM makes them so for these models too
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))

    def template_call_id(self, call_id):
        """An id of another shape (another server's, or lockgate's own from
        before) as 9 letters and digits from its hash: the same id maps the
        same way in the call and in its result, and in every later request
        of the conversation (vLLM keeps the last 9 characters, which two
        ids can share)."""
        if _is_mistral_id(call_id):
            return call_id
        number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        digits = []
        for _ in range(_ID_LENGTH):
            number, digit = divmod(number, len(_ID_ALPHABET))
            digits.append(_ID_ALPHABET[digit])
        return "".join(digits)


_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 9


def _is_mistral_id(value) -> bool:
    return isinstance(value, str) and len(value) == _ID_LENGTH and all(c in _ID_ALPHABET for c in value)


# --- Qwen3-Coder's XML calls ------------------------------------------------------------------

#: one parameter's closing, which its text value runs up to
_PARAMETER_CLOSE = "\n</parameter>\n"
#: Lark tokens for a text value and its closing as one lexeme: text that
#: holds no closing, then the closing. Apart, the lexer would take the
#: closing's first characters as text and could not back off them.
_TEXT_VALUE_TOKENS = (
    f"TEXT_VALUE: VALUE_TEXT {lark_string(_PARAMETER_CLOSE)}\n"
    r"VALUE_TEXT: /(?s:.*)/ & ~/(?s:.*)\n<\/parameter>(?s:.*)/" "\n"
    r"PARAMETER_NAME: /[^>\n]+/" "\n"
)
#: where a parameter's `$ref`s find the tool's parameters in the document
#: of that parameter alone
_PARAMETERS_DEF = "lockgate_parameters"
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null",
               dict: "object", list: "array"}


def _json_type(value) -> str:
    return _JSON_TYPES.get(type(value), "string")


def _pointer(root, ref: str):
    """What a `$ref` into `root` (`#`, `#/a/b`, or that behind the
    document's own `$id`) points to, or None."""
    own_id = root.get("$id") if isinstance(root, dict) else None
    if isinstance(own_id, str) and ref.startswith(own_id + "#"):
        ref = ref[len(own_id):]
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _value_types(schema, root, depth: int = 0) -> set[str] | None:
    """The JSON types a parameter's schema allows, None for any (or for
    what cannot be told: a `$ref` by URI, a cycle)."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    if isinstance(schema.get("$ref"), str):
        return _value_types(_pointer(root, schema["$ref"]), root, depth + 1)
    if "const" in schema:
        return {_json_type(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_json_type(value) for value in schema["enum"]}
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            found: set[str] = set()
            for branch in schema[key]:
                types = _value_types(branch, root, depth + 1)
                if types is None:
                    return None
                found |= types
            return found
    if "properties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return None


def _fits_types(value, types: set[str] | None) -> bool:
    if types is None:
        return True
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return bool({"integer", "number"} & types)
    return _json_type(value) in types


def _parameter_document(schema, root) -> dict:
    """One parameter's schema as a JSON Schema document of its own, its
    `$ref`s (which point into the tool's parameters: `#`, `#/$defs/...`,
    `#/properties/...`, or by the parameters' `$id`) turned to a copy of the
    parameters under `$defs`."""
    if "$ref" not in json.dumps(schema):
        return schema
    own_id = root.get("$id") if isinstance(root.get("$id"), str) else None

    def moved(node):
        if isinstance(node, list):
            return [moved(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                if own_id and value.startswith(own_id + "#"):
                    value = value[len(own_id):]
                if value.startswith("#"):
                    value = f"#/$defs/{_PARAMETERS_DEF}" + value[1:]
                out[key] = value
            elif key != "$id" or node is not root:
                out[key] = moved(value)
        return out

    document = moved(schema)
    defs = dict(document.get("$defs") or {}) if isinstance(document.get("$defs"), dict) else {}
    defs[_PARAMETERS_DEF] = moved(root)
    return {**document, "$defs": defs}


def _value_lark(schema, parameters) -> str:
    """One parameter's value and its closing as a Lark expression: JSON for
    a value that cannot be a string (its schema a `%json` document of its
    own), one of the texts a string enum or const allows, else any text (a
    string, or a value that may be one: as llama.cpp, the text alternative
    takes anything)."""
    types = _value_types(schema, parameters)
    if types is not None and "string" not in types:
        return f"{lark_json(_parameter_document(schema, parameters))} {lark_string(_PARAMETER_CLOSE)}"
    choices = None
    if types == {"string"} and isinstance(schema, dict):
        choices = schema.get("enum") if "enum" in schema else [schema["const"]] if "const" in schema else None
    if choices:
        return "(" + " | ".join(lark_string(str(choice) + _PARAMETER_CLOSE) for choice in choices) + ")"
    return "TEXT_VALUE"


class Qwen3CoderFormat(ToolCallFormat):
    """`<tool_call>` around `<function=NAME>`, each argument a
    `<parameter=KEY>` holding its value as bare text (a string as it is,
    anything else as JSON), as Qwen3-Coder, Qwen3.5 and Nemotron Nano 3
    write calls. llama.cpp's server picks it for a template with all three
    markers (common/chat.cpp) and reads values by the tool's schema, as this
    does once `with_tools` has told it the tools."""

    name = "qwen3-coder"
    _CALL = re.compile(
        r"(?:<tool_call>\s*)?<function=(?P<name>[^>\n]*)>(?P<body>.*?)"
        r"(?:(?P<closed></function>)\s*(?:</tool_call>)?|\Z)",
        re.S,
    )
    _PARAMETER = re.compile(r"<parameter=(?P<key>[^>\n]*)>\n?(?P<value>.*?)\n?</parameter>", re.S)
    _CUT_OPENING = re.compile(r"<tool_call>\s*\Z")

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        self.tools = {tool.name: tool for tool in tools}

    @classmethod
    def fits(cls, chat_template):
        template = chat_template or ""
        return all(marker in template for marker in ("<tool_call>", "<function=", "<parameter="))

    def with_tools(self, tools):
        return type(self)(tools)

    def instructions(self, tools):
        return (
            "# Tools\n\nYou have access to the following functions (each with a JSON schema of its "
            f"parameters):\n\n<tools>\n{_tool_list(tools)}\n</tools>\n\n"
            "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
            "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
            "</parameter>\n<parameter=example_parameter_2>\nvalue_2\n</parameter>\n</function>\n</tool_call>"
        )

    def render_calls(self, calls):
        written = []
        for call in calls:
            arguments = _json(call.arguments)
            parameters = "".join(
                f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
                f"{_PARAMETER_CLOSE}"
                for key, value in (arguments.items() if isinstance(arguments, dict) else ())
            )
            written.append(f"<tool_call>\n<function={call.name}>\n{parameters}</function>\n</tool_call>")
        return "\n".join(written)

    def grammar(self, tools, *, required, max_calls):
        if not required:
            return None
        rules = [f"start: {repeated('call', chr(10), max_calls)}",
                 "call: " + " | ".join(f"function_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            opening = lark_string(f"<tool_call>\n<function={tool.name}>\n")
            arguments = self._arguments_lark(tool.parameters)
            rules.append(f"function_{i}: {opening} {arguments} {lark_string('</function>' + chr(10) + '</tool_call>')}")
        return "\n".join(rules) + "\n" + _TEXT_VALUE_TOKENS

    @staticmethod
    def _arguments_lark(parameters) -> str:
        """The parameters in the schema's order, each required one once and
        each other one at most once; an object without `properties` takes
        any parameters as text."""
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if not isinstance(properties, dict):
            return '("<parameter=" PARAMETER_NAME ">\\n" TEXT_VALUE)*'
        required = set(parameters.get("required") or ())
        parts = []
        for key, schema in properties.items():
            part = f"{lark_string(f'<parameter={key}>' + chr(10))} {_value_lark(schema, parameters)}"
            parts.append(f"({part})" if key in required else f"({part})?")
        return " ".join(parts)

    def parse(self, text):
        text = self._CUT_OPENING.sub("", text)
        calls, kept, at = [], [], 0
        for match in self._CALL.finditer(text):
            kept.append(text[at:match.start()])
            at = match.end()
            if match["closed"] is None:
                continue  # cut short (max_tokens): neither a call nor text
            name = match["name"].strip()
            arguments = {
                parameter["key"].strip(): self._value(name, parameter["key"].strip(), parameter["value"])
                for parameter in self._PARAMETER.finditer(match["body"])
            }
            calls.append(ToolCall(name, arguments_text(arguments)))
        kept.append(text[at:])
        content = "".join(kept).strip()
        return ParsedOutput(content or None, calls)

    def _value(self, function: str, key: str, text: str):
        """A parameter's text as the value the tool's schema asks for: text
        for a string, JSON for anything else, JSON where it reads as one of
        the types allowed (a bare `42` for a string-or-number is 42); with
        no schema, JSON where the text reads as other than a string."""
        tool = self.tools.get(function)
        properties = (tool.parameters.get("properties") if tool else None) or {}
        types = _value_types(properties[key], tool.parameters) if key in properties else None
        if types == {"string"}:
            return text
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return value if not isinstance(value, str) and _fits_types(value, types) else text

    def start_markers(self):
        # a call without its <tool_call>, as Qwen3-Coder sometimes writes,
        # starts at <function= and an offered tool's name (llama.cpp's rule:
        # the bare tag also starts C++'s #include <functional>)
        return ("<tool_call>", *(f"<function={name}>" for name in self.tools))


# --- Gemma 4's calls -----------------------------------------------------------------------

_GEMMA_QUOTE = '<|"|>'
_GEMMA_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_GEMMA_WORDS = {"true": True, "false": False, "null": None, "none": None, "None": None}


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
        value, at = {}, _skip_space(text, at + 1)
        while not text.startswith("}", at):
            key, at = _gemma_key(text, at)
            value[key], at = _gemma_value(text, at)
            at = _skip_space(text, at)
            if text.startswith(",", at):
                at = _skip_space(text, at + 1)
            elif not text.startswith("}", at):
                raise ValueError("expected , or }")
        return value, at + 1
    if text.startswith("[", at):
        items, at = [], _skip_space(text, at + 1)
        while not text.startswith("]", at):
            item, at = _gemma_value(text, at)
            items.append(item)
            at = _skip_space(text, at)
            if text.startswith(",", at):
                at = _skip_space(text, at + 1)
            elif not text.startswith("]", at):
                raise ValueError("expected , or ]")
        return items, at + 1
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
            f"{_tool_list(tools)}\n"
            f"To call one, write {self._OPEN}NAME{{key:{_GEMMA_QUOTE}text{_GEMMA_QUOTE},count:1}}{self._CLOSE}"
        )

    def render_calls(self, calls):
        return "".join(
            f"{self._OPEN}{c.name}{_gemma_argument(_json(c.arguments) or {})}{self._CLOSE}" for c in calls
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


#: in the order they are tried against a template: the catch-all last
BUILT_IN_FORMATS: dict[str, type[ToolCallFormat]] = {
    f.name: f for f in (Qwen3CoderFormat, HermesFormat, MistralFormat, Llama3Format, Gemma4Format, GenericFormat)
}


def format_for_template(template: str | None) -> str:
    """The built-in format a chat template's own markers point to."""
    return next(f.name for f in BUILT_IN_FORMATS.values() if f.fits(template))


@hookimpl(trylast=True)
def lockgate_register_tool_call_formats(register) -> None:
    for fmt in BUILT_IN_FORMATS.values():
        register(fmt)
