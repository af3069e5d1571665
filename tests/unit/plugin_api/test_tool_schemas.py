"""Tool parameters compile as the documents they are, in every built-in
format: `$ref`s resolve against their own tool's parameters (also when
several tools define `$defs` of the same names), call lists end, and the one
keyword rule holds for tools and `response_format` alike. Grammar walks on
the default model's tokenizer; no compiled model."""

from __future__ import annotations

import json
import logging

import pytest

from lockgate.plugin_api.grammars import compile_grammar, compile_json_schema
from lockgate.errors import InvalidSchema
from lockgate.plugin_api.grammars import compile_schema
from lockgate.plugin_api.tool_calls import Tool, ToolCall
from lockgate.plugins.tool_formats import BUILT_IN_FORMATS

#: two tools whose `$defs` share a name but not a shape (pydantic names both `Address`)
PERSON = Tool("person", None, {
    "type": "object", "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/Address"}},
    "required": ["name", "address"],
    "$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"]}},
})
PLACE = Tool("place", None, {
    "type": "object", "properties": {"address": {"$ref": "#/$defs/Address"}}, "required": ["address"],
    "$defs": {"Address": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}},
})
#: `#` itself: a recursive tree
TREE = Tool("tree", None, {
    "type": "object", "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["value", "children"],
})
#: draft-07's `definitions`, and a pointer into `properties`
LEGACY = Tool("legacy", None, {
    "type": "object",
    "properties": {"a": {"$ref": "#/definitions/Small"}, "b": {"$ref": "#/properties/a"}},
    "required": ["a", "b"],
    "definitions": {"Small": {"type": "integer", "maximum": 9}},
})
#: a `$ref` by the document's `$id`
BY_ID = Tool("by_id", None, {
    "$id": "https://example.com/by-id", "type": "object",
    "properties": {"n": {"$ref": "https://example.com/by-id#/$defs/N"}}, "required": ["n"],
    "$defs": {"N": {"type": "integer", "minimum": 100}},
})
TOOLS = [PERSON, PLACE, TREE, LEGACY, BY_ID]

#: a valid call of each tool, and a call that mixes up the two Address definitions
GOOD = {
    "person": {"name": "Ada", "address": {"street": "Main St"}},
    "place": {"address": {"zip": 12345}},
    "tree": {"value": 1, "children": [{"value": 2, "children": []}]},
    "legacy": {"a": 3, "b": 4},
    "by_id": {"n": 120},
}
BAD = [
    ("place", {"address": {"street": "Main St"}}),  # the other tool's Address
    ("person", {"name": "Ada", "address": {"zip": 1}}),
    ("tree", {"value": 1, "children": [{"value": "x", "children": []}]}),
    ("legacy", {"a": 3, "b": 10}),  # b is a's schema: at most 9
    ("by_id", {"n": 5}),
]


def written(name: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as the format named writes them under its grammar."""
    key = "parameters" if name == "llama3" else "arguments"
    objects = [json.dumps({"name": n, key: args}) for n, args in calls]
    return {
        "generic": lambda: '{"tool_calls": [' + ", ".join(objects) + "]}",
        "hermes": lambda: "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects),
        "llama3": lambda: "; ".join(objects),
        "mistral": lambda: "[" + ", ".join(objects) + "]",
        # values as bare text, anything but a string as JSON
        "qwen3-coder": lambda: BUILT_IN_FORMATS[name]().render_calls([ToolCall(n, json.dumps(a)) for n, a in calls]),
        # JSON arguments between Gemma 4's markers, as its grammar has them
        "gemma4": lambda: "".join(f"<|tool_call>call:{n}{json.dumps(a)}<tool_call|>" for n, a in calls),
    }[name]()


def accepts(grammar, text: str, tokenizer) -> bool:
    """Whether the grammar lets a model write exactly `text` and end."""
    matcher = grammar.matcher()
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.accept(token)
    except ValueError:
        return False
    return matcher.is_accepting


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer):
    """Each format's required grammar for all of TOOLS, at most 3 calls."""
    return {
        name: compile_grammar(fmt().grammar(TOOLS, required=True, max_calls=3), smollm2_tokenizer)
        for name, fmt in BUILT_IN_FORMATS.items()
    }


@pytest.mark.parametrize("name", sorted(BUILT_IN_FORMATS))
def test_each_tools_refs_resolve_against_its_own_parameters(name, grammars, smollm2_tokenizer):
    for tool, arguments in GOOD.items():
        assert accepts(grammars[name], written(name, [(tool, arguments)]), smollm2_tokenizer), tool
    for tool, arguments in BAD:
        assert not accepts(grammars[name], written(name, [(tool, arguments)]), smollm2_tokenizer), tool


@pytest.mark.parametrize("name", sorted(BUILT_IN_FORMATS))
def test_a_call_list_ends_at_max_calls(name, grammars, smollm2_tokenizer):
    calls = [("tree", GOOD["tree"]), ("place", GOOD["place"]), ("person", GOOD["person"]), ("legacy", GOOD["legacy"])]
    assert accepts(grammars[name], written(name, calls[:3]), smollm2_tokenizer)
    assert not accepts(grammars[name], written(name, calls), smollm2_tokenizer)
    one = compile_grammar(BUILT_IN_FORMATS[name]().grammar(TOOLS, required=True, max_calls=1), smollm2_tokenizer)
    assert accepts(one, written(name, calls[:1]), smollm2_tokenizer)
    assert not accepts(one, written(name, calls[:2]), smollm2_tokenizer)


def test_generic_auto_is_calls_or_an_answer_and_both_end(smollm2_tokenizer):
    grammar = compile_grammar(
        BUILT_IN_FORMATS["generic"]().grammar(TOOLS, required=False, max_calls=2), smollm2_tokenizer
    )
    assert accepts(grammar, '{"response": "It is sunny."}', smollm2_tokenizer)
    assert accepts(grammar, written("generic", [("place", GOOD["place"])] * 2), smollm2_tokenizer)
    assert not accepts(grammar, written("generic", [("place", GOOD["place"])] * 3), smollm2_tokenizer)
    assert not accepts(grammar, '{"response": "x", "tool_calls": []}', smollm2_tokenizer)


def test_parameters_are_not_changed_by_building_a_grammar():
    before = json.dumps(PERSON.parameters, sort_keys=True)
    for fmt in BUILT_IN_FORMATS.values():
        fmt().grammar([PERSON, PLACE], required=True, max_calls=4)
    assert json.dumps(PERSON.parameters, sort_keys=True) == before


# ------------------------------------------------------------------ the keyword rule

#: keywords the grammar enforces: (schema, an instance it allows, one it refuses)
ENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2], [1]),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}, "abc", "abcde"),
    ({"type": "integer", "minimum": 1, "exclusiveMaximum": 5}, 4, 5),
    ({"enum": ["a", "b"]}, "b", "c"),
    ({"type": "string", "format": "date"}, "2026-12-01", "yesterday"),
    ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    ({"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]}, {"k": 1}, {"k": 2}),
]
#: annotations: accepted and ignored, strict or not
ANNOTATIONS = {"title": "T", "description": "d", "default": 1, "examples": [1], "$comment": "c",
               "deprecated": False, "readOnly": True, "writeOnly": False, "x-vendor": {"a": 1},
               "strict": True, "discriminator": {"propertyName": "kind"}, "contentMediaType": "text/plain"}
#: keywords that change what is valid but that the grammar cannot enforce:
#: (schema, what the refusal names, an instance the lenient grammar still allows though invalid)
UNENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'", [1, 1]),
    ({"type": "integer", "not": {"const": 3}}, "'not'", 3),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": {}},
     "'if'", {"a": 1}),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "'contains'", [1]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "'dependentRequired'", {"a": 1}),
    ({"type": "string", "format": "binary"}, "the string format 'binary'", "x"),
]


def layout(value) -> str:
    return json.dumps(value)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("schema, good, bad", ENFORCED)
def test_enforced_keywords_are_enforced_strict_or_not(schema, good, bad, strict, smollm2_tokenizer):
    grammar = compile_json_schema(schema, smollm2_tokenizer, strict=strict)
    assert grammar.unenforced == ()
    assert accepts(grammar, layout(good), smollm2_tokenizer)
    assert not accepts(grammar, layout(bad), smollm2_tokenizer)


@pytest.mark.parametrize("strict", [False, True])
def test_annotations_are_accepted_and_ignored_strict_or_not(strict, smollm2_tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer", **ANNOTATIONS}}, "required": ["n"],
              **ANNOTATIONS}
    grammar = compile_json_schema(schema, smollm2_tokenizer, strict=strict)
    assert grammar.unenforced == ()
    assert accepts(grammar, '{"n": 7}', smollm2_tokenizer)


@pytest.mark.parametrize("schema, named, invalid", UNENFORCED)
def test_unenforced_keywords_are_refused_in_strict_mode_by_name(schema, named, invalid, smollm2_tokenizer):
    with pytest.raises(InvalidSchema) as refused:
        compile_json_schema(schema, smollm2_tokenizer, strict=True)
    assert named in str(refused.value) and "strict" in str(refused.value)


@pytest.mark.parametrize("schema, named, invalid", UNENFORCED)
def test_unenforced_keywords_are_accepted_and_named_when_lenient(schema, named, invalid, smollm2_tokenizer):
    grammar = compile_json_schema(schema, smollm2_tokenizer, strict=False)
    assert named in grammar.unenforced
    assert accepts(grammar, layout(invalid), smollm2_tokenizer)  # not enforced: as the README says


def test_one_rule_for_tools_and_response_format(smollm2_tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="lockgate.pipeline")
    schema = UNENFORCED[0][0]
    eos = [smollm2_tokenizer.eos_token_id]
    for param in ("response_format", "tools[2].function.parameters", "tools[0].parameters"):
        with pytest.raises(InvalidSchema) as refused:
            compile_schema(schema, smollm2_tokenizer, eos, strict=True, param=param)
        assert refused.value.param == param
        caplog.clear()
        compile_schema(schema, smollm2_tokenizer, eos, strict=False, param=param)
        [warning] = [r.msg for r in caplog.records if r.name == "lockgate.pipeline"]
        assert warning["event"] == "schema keywords accepted but not enforced"
        assert warning["param"] == param and warning["keywords"] == ["'uniqueItems'"]


# ------------------------------------------------------------------ errors in a sentence

REFUSED = [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}},
     "the $ref '#/$defs/Missing' points at nothing in this schema"),
    ({"$ref": "https://example.com/schema.json"}, "names a schema outside this one"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems (3) is greater than maxItems (1)"),
    ({"type": "string", "pattern": "(("}, "regex parse error"),
]


@pytest.mark.parametrize("schema, message", REFUSED)
def test_a_schema_error_says_what_is_wrong_without_grammar_text(schema, message, smollm2_tokenizer):
    with pytest.raises(InvalidSchema) as refused:
        compile_json_schema(schema, smollm2_tokenizer)
    text = str(refused.value)
    assert message in text
    assert "%json" not in text and "start:" not in text and "x-guidance" not in text
