"""`chat_template_kwargs` (vLLM's extension, as Qwen3's `enable_thinking`
is switched): its variables reach the chat template; the template's own
names cannot be overridden; size is capped."""

from __future__ import annotations

import pytest

from lockgate.plugin_api.readers import MAX_TEMPLATE_KWARGS

#: a template that branches on a variable only the request can set
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}no thinking{% endif %}"
    "{% if style %}style {{ style }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(load_tiny):
    return load_tiny(chat_template=TEMPLATE)


async def rendered(client, **fields) -> str:
    response = await client.post("/tokenize", json={"messages": MESSAGES, **fields})
    assert response.status == 200, await response.text()
    tokens = (await response.json())["tokens"]
    return (await (await client.post("/detokenize", json={"tokens": tokens})).json())["prompt"]


async def test_the_variables_reach_the_template(model, make_client):
    client = await make_client(model)
    assert not (await rendered(client)).endswith("no thinking")
    off = await rendered(client, chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("assistant\nno thinking")
    assert (await rendered(client, chat_template_kwargs={"style": "terse"})).endswith("style terse")
    # and in a chat request: the prompt it counts is the rendered one
    plain = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
    switched = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert (await switched.json())["usage"]["prompt_tokens"] > (await plain.json())["usage"]["prompt_tokens"]


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"tools": []}, "chat_template_kwargs.tools"),
    ({"tokenize": True}, "chat_template_kwargs.tokenize"),
    ({"bos_token": "x"}, "chat_template_kwargs.bos_token"),
    ({"_private": 1}, "chat_template_kwargs._private"),
    ({f"v{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}, "chat_template_kwargs"),
    ({"big": "x" * 20_000}, "chat_template_kwargs"),
    ("enable_thinking", "chat_template_kwargs"),
])
async def test_what_the_template_is_rendered_with_cannot_be_overridden(model, make_client, kwargs, param):
    client = await make_client(model)
    response = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": kwargs})
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["param"] == param
