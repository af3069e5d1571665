"""`qwen3-coder`: `<tool_call>` around `<function=NAME>` and one
`<parameter=KEY>` per argument, its value bare text read by the tool's
schema (Qwen3-Coder, Qwen3.5).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from lockgate.plugin_api.tool_calls import (
    ParsedOutput,
    Tool,
    ToolCall,
    ToolCallFormat,
    arguments_text,
    lark_json,
    lark_string,
    repeated,
)
from lockgate.plugins.tool_formats.common import parse_json, tool_list


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
            f"parameters):\n\n<tools>\n{tool_list(tools)}\n</tools>\n\n"
            "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
            "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
            "</parameter>\n<parameter=example_parameter_2>\nvalue_2\n</parameter>\n</function>\n</tool_call>"
        )

    def render_calls(self, calls):
        written = []
        for call in calls:
            arguments = parse_json(call.arguments)
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
