"""The extensions other servers' clients send, acting through the openai
SDK's `extra_body`: the output constraints of vLLM, llama.cpp's server and
SGLang (one grammar compiler for all), `min_tokens`, and `return_token_ids`
in vLLM's shape, whole and streamed."""

from __future__ import annotations

import json
import re

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]

#: (extra_body, what every output must be)
CONSTRAINTS = [
    ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda text: text in ("red", "green", "blue")),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
    ({"regex": "(ab)+"}, lambda text: re.fullmatch("(ab)+", text)),
    ({"structured_outputs": {"regex": "x[yz]{2,4}"}}, lambda text: re.fullmatch("x[yz]{2,4}", text)),
    ({"grammar": 'root ::= "(" [0-9] [0-9]? ")"'}, lambda text: re.fullmatch(r"\([0-9]{1,2}\)", text)),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no")),
    ({"ebnf": 'root ::= "a" "b"? "b"?'}, lambda text: re.fullmatch("ab{0,2}", text)),
    ({"structured_outputs": {"grammar": 'start: "q" /[0-9]/'}}, lambda text: re.fullmatch("q[0-9]", text)),
    ({"json_schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                      "required": ["n"]}},
     lambda text: isinstance(json.loads(text)["n"], int)),
    ({"json_schema": json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 2})},
     lambda text: all(isinstance(v, bool) for v in json.loads(text))),
    ({"guided_json": {"enum": ["left", "right"]}}, lambda text: json.loads(text) in ("left", "right")),
    ({"structured_outputs": {"json_object": True}}, lambda text: isinstance(json.loads(text), dict)),
]


@pytest.mark.parametrize("extra, holds", CONSTRAINTS, ids=[json.dumps(c[0])[:40] for c in CONSTRAINTS])
async def test_every_constraint_holds_whole_and_streamed(tiny_model, make_openai, extra, holds):
    client = await make_openai(tiny_model)
    for seed in (1, 2):
        kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=seed, extra_body=extra)
        reply = await client.chat.completions.create(**kwargs)
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", text
        assert holds(text), text
        chunks = await client.chat.completions.create(**kwargs, stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]) == text


async def test_constraints_on_completions(tiny_model, make_openai):
    client = await make_openai(tiny_model)
    reply = await client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=0,
                                            extra_body={"guided_choice": ["alpha", "beta"]})
    assert reply.choices[0].text in ("alpha", "beta")


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"grammar": "root ::= nothing"}, "grammar"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_choice": ["a"], "regex": "b"}, "regex"),
])
async def test_a_bad_constraint_is_a_400_naming_its_field(tiny_model, make_openai, extra, param):
    client = await make_openai(tiny_model)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, stream=stream,
                                                 extra_body=extra)
        assert raised.value.body["param"] == param


async def test_min_tokens_on_chat_holds_end_of_turn_back(tiny_model, make_openai):
    client = await make_openai(tiny_model)
    eos = str(tiny_model.eos_token_ids[0])
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, logit_bias={eos: 100})
    ended = await client.chat.completions.create(**kwargs)
    assert ended.usage.completion_tokens == 1
    held = await client.chat.completions.create(**kwargs, extra_body={"min_tokens": 6})
    assert held.usage.completion_tokens == 7 and held.choices[0].finish_reason == "stop"


async def test_return_token_ids_whole_and_streamed(tiny_model, make_client):
    http = await make_client(tiny_model)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    reply = await (await http.post("/v1/chat/completions", json=body)).json()
    prompt = (await (await http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES})).json())["tokens"]
    assert reply["prompt_token_ids"] == prompt
    token_ids = reply["choices"][0]["token_ids"]
    assert len(token_ids) == reply["usage"]["completion_tokens"]
    text = tiny_model.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert text == reply["choices"][0]["message"]["content"]

    response = await http.post("/v1/chat/completions", json={**body, "stream": True})
    streamed, prompt_ids = [], None
    for line in (await response.text()).splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: "):])
        prompt_ids = chunk.get("prompt_token_ids", prompt_ids)
        for choice in chunk["choices"]:
            streamed += choice.get("token_ids") or []
    assert prompt_ids == prompt and streamed == token_ids

    # completions: each choice its prompt's ids and its own
    body = await (await http.post("/v1/completions", json={
        "model": "tiny", "prompt": ["a", "b b"], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})).json()
    for choice, text in zip(body["choices"], ("a", "b b")):
        assert choice["prompt_token_ids"] == tiny_model.tokenizer.encode(text)
        assert len(choice["token_ids"]) == 3
    # off by default
    plain = await (await http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                                  "max_tokens": 2})).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
