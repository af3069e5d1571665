"""`response_format` end to end: constrained output parses and validates; bad
schemas are a 400 before any byte, streaming or not."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

FAMILY = {
    "$defs": {
        "Person": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "surname": {"type": "string", "maxLength": 20},
        "members": {"type": "array", "items": {"$ref": "#/$defs/Person"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["surname", "members"],
    "additionalProperties": False,
}

TREE = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["a", "b", "c"]},
        "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
    },
    "required": ["label", "children"],
    "additionalProperties": False,
}


def schema_format(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.default_model
async def test_family_schema_output_validates(default_model, make_openai):
    client = await make_openai(default_model)
    messages = [{"role": "user", "content": "Describe the Smith family: two parents and a child, as JSON."}]
    for stream in (False, True):
        kwargs = dict(model="smollm2", messages=messages, max_tokens=200, temperature=0,
                      response_format=schema_format(FAMILY, "family"))
        if stream:
            chunks = await client.chat.completions.create(**kwargs, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in chunks])
        else:
            reply = await client.chat.completions.create(**kwargs)
            assert reply.choices[0].finish_reason == "stop"
            text = reply.choices[0].message.content
        jsonschema.validate(json.loads(text), FAMILY)


@pytest.mark.default_model
async def test_recursive_schema_and_json_object(default_model, make_openai):
    client = await make_openai(default_model)
    # a recursive grammar lets a small model nest without end; of a few seeded
    # samples some finish, and every one that does is a valid tree
    finished = 0
    for seed in range(1, 5):
        reply = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "A small tree of labels as JSON."}],
            max_tokens=150, temperature=0.7, seed=seed, response_format=schema_format(TREE, "tree"),
        )
        if reply.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(reply.choices[0].message.content), TREE)
            finished += 1
    assert finished >= 1
    older_form = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give me a person as JSON."}],
        max_tokens=100, temperature=0,
        response_format={"type": "json_object", "schema": FAMILY["$defs"]["Person"]},
    )
    jsonschema.validate(json.loads(older_form.choices[0].message.content), FAMILY["$defs"]["Person"])
    anything = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give me a JSON object with your name and age."}],
        max_tokens=100, temperature=0, response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


async def test_constrained_beside_unconstrained_on_the_tiny_model(tiny_model, make_openai):
    """A random-weight model still emits valid JSON under the grammar, and the
    unconstrained request batched with it is the same as alone."""
    import asyncio

    client = await make_openai(tiny_model)
    plain = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                 temperature=0, extra_body={"ignore_eos": True})
    alone = (await client.chat.completions.create(**plain)).choices[0].message.content
    tree = schema_format({"type": "object", "properties": {"label": {"type": "string", "enum": ["a", "b"]}},
                          "required": ["label"], "additionalProperties": False})
    constrained, together = await asyncio.gather(
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=40, response_format=tree, seed=3),
        client.chat.completions.create(**plain),
    )
    assert json.loads(constrained.choices[0].message.content)["label"] in ("a", "b")
    assert constrained.choices[0].finish_reason == "stop"
    assert together.choices[0].message.content == alone


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "response_format, fragment",
    [
        (schema_format({"type": "nonsense"}), ""),
        (schema_format({"type": "object", "properties": {"p": {"$ref": "#/$defs/Person"}}}), "Person"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}, ""),
    ],
)
async def test_invalid_schemas_are_400_before_any_byte(tiny_model, make_openai, stream, response_format, fragment):
    client = await make_openai(tiny_model)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format=response_format, stream=stream,
        )
    error = caught.value.body
    assert error["code"] == "invalid_schema" and error["param"] == "response_format"
    assert fragment in error["message"]


def ref_chain(length: int) -> dict:
    """The schema that killed the server: `$ref`s chained `length` deep."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    defs[f"d{length}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_10000_deep_ref_chain_is_a_400_and_the_server_serves_on(tiny_model, make_openai, stream):
    """Before the limits, llguidance overflowed its native stack on this
    schema and the process died with a segmentation fault."""
    from helpers import wait_idle

    client = await make_openai(tiny_model)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format=schema_format(ref_chain(10_000)), stream=stream,
        )
    error = caught.value.body
    assert error["code"] == "schema_too_complex" and error["param"] == "response_format"
    assert "$ref" in error["message"] and "256" in error["message"]
    reply = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
        response_format=schema_format(ref_chain(20)),
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert (await wait_idle(tiny_model.engine)).kv_pages_used == 0
