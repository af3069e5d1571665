"""Structured output (lockgate.plugin_api.grammars compiles, lockgate.engine.structured runs) with real llguidance and real tokenizers.

The central property: whatever a model's logits say, sampling through a
matcher's mask until it finishes yields text that parses as JSON and
validates against the schema. It is checked by random walks over the real
SmolLM2 tokenizer, through the engine's own batch sampler, with logits wider
than the vocabulary as a padded model has.
"""

from __future__ import annotations

import json

import gguf
import types

import jsonschema
import numpy as np
import pytest

from lockgate.errors import InvalidSchema
from lockgate.plugin_api import grammars, schema_limits
from lockgate.engine.params import SamplingParams
from helpers import sample_one
from lockgate.engine.structured import Grammar
from lockgate.plugin_api.grammars import compile_json_schema
from lockgate.errors import InvalidRequestError
from lockgate.plugin_api.grammars import grammar_for
from lockgate.plugin_api.request import CHAT_ENDPOINT, parse_request
from lockgate.models.tokenizer import eos_token_ids, load_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
FAMILY = {
    "$defs": {"Person": PERSON},
    "type": "object",
    "properties": {
        "surname": {"type": "string", "maxLength": 12},
        "members": {
            "type": "array",
            "items": {"$ref": "#/$defs/Person"},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["surname", "members"],
    "additionalProperties": False,
}
TREE = {
    "type": "object",
    "properties": {
        "label": {"enum": ["leaf", "branch", "root"]},
        "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
    },
    "required": ["label", "children"],
    "additionalProperties": False,
}
ANY_OBJECT = {"type": "object"}

# Logits as wide as a model whose embedding is padded past the vocabulary.
PADDING = 64
WALK_CAP = 400


def json_schema_format(schema, **extra):
    return {"type": "json_schema", "json_schema": {"name": "test", "schema": schema, **extra}}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def eos_ids(smollm2_reader, tokenizer):
    return eos_token_ids(smollm2_reader, tokenizer)


@pytest.fixture(scope="module")
def compile_format(tokenizer, eos_ids):
    def compile_(response_format):
        """A chat request's `response_format`, read and compiled as the pipeline does."""
        body = {"messages": [{"role": "user", "content": "x"}]}
        if response_format is not None:
            body["response_format"] = response_format
        model = types.SimpleNamespace(tokenizer=tokenizer, eos_token_ids=eos_ids, tool_call_format=None)
        return grammar_for(parse_request(CHAT_ENDPOINT, body, request_id="t"), model)

    return compile_


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_gguf):
    reader = gguf.GGUFReader(tiny_gguf)
    tokenizer = load_tokenizer(reader)
    return tokenizer, eos_token_ids(reader, tokenizer)


def feed(matcher, tokenizer, text):
    for token in tokenizer.encode(text, add_special_tokens=False):
        matcher.accept(token)


# ------------------------------------------------------------------ accepted forms


@pytest.mark.parametrize("response_format", [None, {"type": "text"}])
def test_unconstrained_formats_compile_to_none(compile_format, response_format):
    assert compile_format(response_format) is None


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object"},
        {"type": "json_object", "schema": FAMILY},
        json_schema_format(FAMILY),
        json_schema_format(FAMILY, strict=True),
        json_schema_format(FAMILY, strict=False, description="a family"),
        json_schema_format(TREE, strict=True),
        {"type": "json_schema", "json_schema": {"schema": ANY_OBJECT}},
    ],
    ids=[
        "json_object", "older-form", "json_schema", "strict", "not-strict", "recursive", "no-name"
    ],
)
def test_accepted_formats_compile(compile_format, response_format):
    grammar = compile_format(response_format)
    assert isinstance(grammar, Grammar)
    assert grammar.warnings == ()


def test_older_form_is_constrained_by_its_schema(compile_format, tokenizer):
    grammar = compile_format({"type": "json_object", "schema": {"enum": [{"a": 1}]}})
    matcher = grammar.matcher()
    feed(matcher, tokenizer, '{"a": 1}')
    assert matcher.is_finished
    with pytest.raises(ValueError):
        feed(grammar.matcher(), tokenizer, '{"a": 2}')


def test_json_object_accepts_any_object_only(compile_format, tokenizer):
    grammar = compile_format({"type": "json_object"})
    matcher = grammar.matcher()
    feed(matcher, tokenizer, '{"a": [1, 2.5, "x", null, true], "b": {"c": {}}}')
    assert matcher.is_finished
    with pytest.raises(ValueError):
        feed(grammar.matcher(), tokenizer, "[1]")


def test_grammar_is_shared_and_matchers_are_independent(compile_format, tokenizer):
    grammar = compile_format(json_schema_format(FAMILY))
    first, second = grammar.matcher(), grammar.matcher()
    feed(first, tokenizer, '{"surname": "Doe", "members": [{"name": "Jo", "age": 3}]}')
    assert first.is_finished
    assert not second.is_finished
    feed(second, tokenizer, '{"surname": "Roe", "members": [')
    assert not second.is_accepting


def test_non_strict_schema_ignores_unsupported_keywords(compile_format):
    schema = {"type": "object", "not": {"required": ["a"]}}
    grammar = compile_format(json_schema_format(schema, strict=False))
    assert grammar.warnings and "not" in grammar.warnings[0]
    with pytest.raises(InvalidSchema, match="not"):
        compile_format(json_schema_format(schema, strict=True))


# ------------------------------------------------------------------ invalid input


@pytest.mark.parametrize(
    "response_format, message",
    [
        (json_schema_format({"type": "nonsense"}), "Invalid type: nonsense"),
        ({"type": "json_object", "schema": {"type": "nonsense"}}, "Invalid type: nonsense"),
        (json_schema_format({"$ref": "#/$defs/Missing"}), "/$defs/Missing"),
        (
            json_schema_format({"type": "object", "properties": {"p": {"$ref": "#/$defs/Nope"}}}),
            "/$defs/Nope",
        ),
        (json_schema_format([{"type": "object"}]), "schema must be a JSON object, got an array"),
        (json_schema_format("object"), "schema must be a JSON object, got a string"),
        (json_schema_format(True), "schema must be a JSON object, got a boolean"),
        ({"type": "json_object", "schema": 3}, "schema must be a JSON object, got a number"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema is required"),
        ({"type": "json_schema"}, "json_schema is required"),
        ({"type": "json_schema", "json_schema": "{}"}, "json_schema must be a JSON object"),
        (json_schema_format(FAMILY, strict="yes"), "strict must be a boolean, got a string"),
        (json_schema_format(FAMILY, strict=1), "strict must be a boolean, got a number"),
        (
            {"type": "json_schema", "json_schema": {"name": 7, "schema": FAMILY}},
            "name must be a string",
        ),
        (json_schema_format({"type": "string", "pattern": "[a-"}), "regex parse error"),
        (json_schema_format({"type": "string", "minLength": "x"}), "minLength"),
        (json_schema_format({"enum": []}), "Unsatisfiable"),
        (json_schema_format({"type": "string", "format": "zipcode"}, strict=True), "zipcode"),
        (json_schema_format({"type": "string", "pattern": "(?=a)b"}), "look-around"),
        (json_schema_format({"$ref": "https://example.com/s.json"}), "https://example.com/s.json"),
        # a $ref cycle that never reaches a value fails at the first step: compile takes it
        (json_schema_format({"$ref": "#"}), "admits no JSON value"),
    ],
)
def test_invalid_response_format_is_a_400_on_response_format(
    compile_format, response_format, message
):
    with pytest.raises(InvalidSchema) as caught:
        compile_format(response_format)
    error = caught.value
    assert error.param == "response_format"
    assert error.status == 400
    assert (error.type, error.code) == ("invalid_request_error", "invalid_schema")
    assert message in error.message
    # the client gets the reason, not llguidance's dump of parser state
    assert "<state>" not in error.message and len(error.message) < 300


@pytest.mark.parametrize(
    "response_format, message",
    [
        ({"type": "xml"}, 'must be one of text, json_object, json_schema, got "xml"'),
        ({}, "response_format.type must be one of"),
        ("json_object", "response_format must be an object, not string"),
    ],
)
def test_unknown_response_format_is_a_400_on_response_format(compile_format, response_format, message):
    with pytest.raises(InvalidRequestError) as caught:
        compile_format(response_format)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "response_format", "invalid_value")
    assert message in error.message


def test_long_error_is_cut_short(compile_format):
    schema = {"type": "string", "pattern": "(?=a)" + "b" * 5000}
    with pytest.raises(InvalidSchema, match="look-around") as caught:
        compile_format(json_schema_format(schema))
    assert len(caught.value.message) < 500


def test_deeply_nested_schema_is_refused_cleanly(compile_format):
    schema = {"type": "array"}
    for _ in range(500):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidSchema) as caught:
        compile_format(json_schema_format(schema))
    assert caught.value.param == "response_format"


# ------------------------------------------------------------------ limits before native code


def ref_chain(length, link=lambda ref: {"$ref": ref}):
    """`$defs` d0 .. d<length>, each nesting the next through `link`."""
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(length)}
    defs[f"d{length}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def escaped_ref_chain(length):
    """Definitions named `a/b~<i>`: their references need JSON pointer escapes."""
    defs = {f"a/b~{i}": {"$ref": f"#/$defs/a~1b~0{i + 1}"} for i in range(length)}
    defs[f"a/b~{length}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/a~1b~00"}


def array_of(ref):
    return {"type": "array", "items": {"$ref": ref}}


def either(ref):
    # two references to the same definition: the expansion is a tree of
    # 2**length paths, which the depth count must not walk one by one
    return {"anyOf": [{"$ref": ref}, {"type": "array", "items": {"$ref": ref}}]}


@pytest.mark.parametrize(
    "schema, limit",
    [
        (ref_chain(10_000), "256"),
        (ref_chain(300), "256"),
        (ref_chain(2_000, array_of), "256"),
        (ref_chain(3_000, either), "256"),
        (escaped_ref_chain(400), "256"),
        ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(25_000)}}, "20000"),
    ],
    ids=["ref-chain", "ref-chain-just-over", "array-chain", "shared-refs", "escaped-pointer", "nodes"],
)
def test_schemas_past_a_limit_are_refused_before_llguidance(compile_format, monkeypatch, schema, limit):
    compiled, resolved = [], []
    monkeypatch.setattr(grammars, "_compile", lambda *args: compiled.append(args))
    resolve = schema_limits._resolve_ref
    monkeypatch.setattr(schema_limits, "_resolve_ref", lambda *args: resolved.append(args) or resolve(*args))
    with pytest.raises(InvalidSchema) as caught:
        compile_format(json_schema_format(schema))
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "response_format", "schema_too_complex")
    assert f"the limit is {limit}" in error.message
    assert compiled == []
    # each reference is followed at most once, even where the expansion
    # has 2**3000 paths: the check is linear in the schema's size
    assert len(resolved) <= json.dumps(schema).count('"$ref"')


def test_nesting_deeper_than_python_recursion_is_measured(compile_format):
    schema = {"type": "integer"}
    for _ in range(5_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidSchema, match="nests 5001 JSON objects and arrays deep; the limit is 128"):
        compile_format(json_schema_format(schema))


@pytest.mark.parametrize(
    "schema",
    [ref_chain(250), ref_chain(120, array_of), ref_chain(60, either), escaped_ref_chain(250), TREE, FAMILY],
    ids=["ref-chain-250", "array-chain-120", "shared-refs-60", "escaped-pointer-250", "recursive", "family"],
)
def test_schemas_within_the_limits_compile(compile_format, schema):
    assert isinstance(compile_format(json_schema_format(schema)), Grammar)


_OVERFLOW = """
import sys, threading
import gguf
from lockgate.plugin_api import grammars
from lockgate.native import run_with_large_stack
from lockgate.plugins.models import locate_smollm2
from lockgate.models.tokenizer import load_tokenizer

llg = grammars._llg_tokenizer(load_tokenizer(gguf.GGUFReader(locate_smollm2())), None)
defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(10000)}
defs["d10000"] = {"type": "integer"}
schema = {"$defs": defs, "$ref": "#/$defs/d0"}  # far past the limits, which are bypassed here
compile_ = lambda: grammars._compile(schema, False, llg)
if sys.argv[1] == "large-stack":
    run_with_large_stack(compile_)
else:
    threading.stack_size(8 * 1024 * 1024)  # the usual default
    thread = threading.Thread(target=compile_)
    thread.start()
    thread.join()
print("survived")
"""


@pytest.mark.parametrize("where, survives", [("large-stack", True), ("8-MiB-thread", False)])
def test_the_compiler_runs_where_a_deep_schema_cannot_overflow_the_stack(tmp_path, where, survives):
    """The second defence behind the limits: the same compile that kills a
    process from a thread with an ordinary stack completes on
    `run_with_large_stack`'s. Run in a child process, since one of the two
    dies by design."""
    import subprocess
    import sys

    script = tmp_path / "overflow.py"
    script.write_text(_OVERFLOW)
    child = subprocess.run([sys.executable, str(script), where], capture_output=True, text=True, timeout=300)
    if survives:
        assert child.returncode == 0 and "survived" in child.stdout, child.stderr[-2000:]
    else:
        assert child.returncode == -11, (child.returncode, child.stderr[-2000:])  # SIGSEGV


# ------------------------------------------------------------------ matcher contract


def test_mask_padding_eos_and_rejected_tokens(tiny_tokenizer):
    tokenizer, eos_ids = tiny_tokenizer
    width = len(tokenizer) + 213
    grammar = compile_json_schema({"type": "object"}, tokenizer, eos_token_ids=eos_ids)
    assert grammar.vocab_size == len(tokenizer)
    matcher = grammar.matcher()

    mask = matcher.allowed(width)
    assert mask.dtype == bool and mask.shape == (width,)
    assert not mask[len(tokenizer):].any()
    assert [tokenizer.decode([t]) for t in np.flatnonzero(mask)] == ["{"]
    assert not any(mask[eos] for eos in eos_ids)

    with pytest.raises(ValueError):
        matcher.accept(eos_ids[0])
    with pytest.raises(ValueError):
        matcher.accept(width - 1)
    # a refused token leaves the matcher where it was
    feed(matcher, tokenizer, "{")
    assert not matcher.is_accepting
    feed(matcher, tokenizer, "}")

    assert matcher.is_accepting and matcher.is_finished and matcher.error is None
    assert set(np.flatnonzero(matcher.allowed(width))) == set(eos_ids)
    with pytest.raises(ValueError):
        feed(matcher, tokenizer, " ")
    matcher.accept(eos_ids[-1])
    assert matcher.is_finished


def test_eos_is_allowed_exactly_when_the_output_may_end(compile_format, tokenizer, eos_ids):
    grammar = compile_format(json_schema_format({"type": "integer", "maximum": 500}))
    matcher = grammar.matcher()
    width = len(tokenizer)
    assert not matcher.allowed(width)[eos_ids].any()
    feed(matcher, tokenizer, "12")
    mask = matcher.allowed(width)
    # "12" may end or go on ("120"): both EOS and digits are allowed
    assert matcher.is_accepting and not matcher.is_finished
    assert mask[eos_ids].all() and mask[tokenizer.convert_tokens_to_ids("0")]
    matcher.accept(eos_ids[0])
    assert matcher.is_finished


def test_llguidance_tokenizer_is_built_once_per_tokenizer(tokenizer, eos_ids):
    built = grammars._llg_tokenizer(tokenizer, eos_ids)
    assert grammars._llg_tokenizer(tokenizer, eos_ids) is built
    grammars.prepare_tokenizer(tokenizer, eos_token_ids=eos_ids)
    assert grammars._llg_tokenizer(tokenizer, eos_ids) is built


# ------------------------------------------------------------------ random walks


@pytest.fixture(scope="module")
def closing_tokens(tokenizer):
    """Ids of tokens that can end a string, an object or an array."""
    width = len(tokenizer) + PADDING
    closing = np.zeros(width, dtype=bool)
    for token_id in range(len(tokenizer)):
        if any(c in tokenizer.decode([token_id]) for c in '"}]'):
            closing[token_id] = True
    return closing


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "name, schema",
    [("family", FAMILY), ("tree", TREE), ("json_object", ANY_OBJECT)],
)
def test_random_walk_produces_valid_json(
    compile_format, tokenizer, eos_ids, closing_tokens, name, schema, seed
):
    """Random logits, masked, sampled by the engine's sampler until the grammar
    completes: the text always parses and validates."""
    response_format = (
        {"type": "json_object"} if schema is ANY_OBJECT else json_schema_format(schema, strict=True)
    )
    grammar = compile_format(response_format)
    matcher = grammar.matcher()
    width = len(tokenizer) + PADDING
    rng = np.random.default_rng([seed, len(name)])
    params = SamplingParams(temperature=1.0)
    output: list[int] = []
    for step in range(WALK_CAP):
        mask = matcher.allowed(width)
        assert not mask[len(tokenizer):].any()
        assert bool(mask[eos_ids].any()) == matcher.is_accepting
        if matcher.is_accepting:
            # end as soon as the grammar allows, as a model that closes would
            matcher.accept(eos_ids[0])
            break
        # a pull toward closing that grows, so every walk ends well within the cap
        logits = rng.standard_normal(width).astype(np.float32) * 2 + closing_tokens * (step / 20)
        logits[~mask] = -np.inf
        token = sample_one(logits, params, rng, (), output)
        assert mask[token]
        matcher.accept(token)
        output.append(token)
    assert matcher.is_finished, f"no end after {WALK_CAP} tokens: {tokenizer.decode(output)!r}"

    text = tokenizer.decode(output)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("additional, extra_key_allowed", [(None, False), (True, True), ({"type": "integer"}, True)])
def test_declared_properties_close_an_object_unless_it_opts_in(compile_format, tokenizer, additional, extra_key_allowed):
    """`llm --schema 'name, age int'` once got back keys it never declared:
    an object with `properties` takes no others unless `additionalProperties`
    allows them, as xgrammar and llama.cpp's server have it."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    if additional is not None:
        schema["additionalProperties"] = additional
    matcher = compile_format(json_schema_format(schema)).matcher()
    feed(matcher, tokenizer, '{"name": "Emma", "age": 28')
    allowed = matcher.allowed(len(tokenizer))
    comma = tokenizer.convert_tokens_to_ids(",")
    assert bool(allowed[comma]) == extra_key_allowed
    assert allowed[tokenizer.convert_tokens_to_ids("}")]
