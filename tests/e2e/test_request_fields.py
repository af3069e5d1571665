"""Every row of every endpoint's field table, sent over HTTP to the tiny
model: an implemented field, an alias and an accepted one are answered, a
refused one is a 400 `unsupported_parameter` naming it (and answered at
the values that ask for nothing), and a field in no row is a 400
`unknown_parameter` unless the operator accepts those."""

from __future__ import annotations

import pytest

from lockgate.plugin_api.fields import (
    ACCEPTED, ALIAS, CHAT, COMPLETIONS, EMBEDDINGS, FIELDS, IMPLEMENTED, MESSAGES, OLLAMA_CHAT, OLLAMA_EMBED,
    OLLAMA_GENERATE, REFUSED, RERANK, RESPONSES, SCORE, TOKENIZE,
)

ROUTES = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", RESPONSES: "/v1/responses",
          MESSAGES: "/v1/messages", TOKENIZE: "/tokenize", OLLAMA_CHAT: "/api/chat", OLLAMA_GENERATE: "/api/generate",
          EMBEDDINGS: "/v1/embeddings", OLLAMA_EMBED: "/api/embed", RERANK: "/v1/rerank", SCORE: "/v1/score"}
#: the endpoints whose errors are Ollama's: `{"error": "message"}`
OLLAMA = (OLLAMA_CHAT, OLLAMA_GENERATE, OLLAMA_EMBED)
USER = [{"role": "user", "content": "Hi"}]
BASE = {
    CHAT: {"model": "tiny", "messages": USER, "max_tokens": 2},
    COMPLETIONS: {"model": "tiny", "prompt": "Hi", "max_tokens": 2},
    RESPONSES: {"model": "tiny", "input": "Hi", "max_output_tokens": 2},
    MESSAGES: {"model": "tiny", "messages": USER, "max_tokens": 2},
    TOKENIZE: {"model": "tiny", "messages": USER},
    OLLAMA_CHAT: {"model": "tiny", "messages": USER, "stream": False, "options": {"num_predict": 2}},
    OLLAMA_GENERATE: {"model": "tiny", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}},
    EMBEDDINGS: {"model": "tiny", "input": "Hi"},
    OLLAMA_EMBED: {"model": "tiny", "input": "Hi"},
    RERANK: {"model": "tiny", "query": "Hi", "documents": ["a"]},
    SCORE: {"model": "tiny", "text_1": "Hi", "text_2": "a"},
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
#: what a field needs beside it to be valid at all
COMPANIONS = {
    "tool_choice": {"tools": [TOOL]},
    "function_call": {"functions": [TOOL["function"]]},
    "top_logprobs": {"logprobs": True},
    "stream_options": {"stream": True},
}
ENDPOINT_COMPANIONS = {
    (RESPONSES, "tool_choice"): {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]},
    (MESSAGES, "tool_choice"): {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    (RESPONSES, "top_logprobs"): {},
    (TOKENIZE, "prompt"): {"messages": None},
    (TOKENIZE, "add_special_tokens"): {"messages": None, "prompt": "Hi"},
    (OLLAMA_CHAT, "top_logprobs"): {},
    (OLLAMA_GENERATE, "top_logprobs"): {},
}
#: a field that acts and so is answered otherwise than 200
ACTING = {
    # a response id that was never stored: looked up, and not found
    (RESPONSES, "previous_response_id"): 404,
    # the tiny model is no reranker: the body passes its table, then the
    # model is refused (tests/e2e/test_rerank.py sends these to rerankers)
    **{(endpoint, name): 400 for endpoint in (RERANK, SCORE) for name in FIELDS[endpoint]},
}


def rows(kinds):
    return [(endpoint, name) for endpoint, table in FIELDS.items() for name, row in table.items() if row.kind in kinds]


def body_with(endpoint: str, name: str, value) -> dict:
    companions = ENDPOINT_COMPANIONS.get((endpoint, name), COMPANIONS.get(name, {}))
    body = {**BASE[endpoint], **companions}
    body[name] = value
    return {k: v for k, v in body.items() if v is not None or k == name}


@pytest.fixture
async def client(tiny_model, make_client):
    return await make_client(tiny_model)


@pytest.mark.parametrize("endpoint, name", rows((IMPLEMENTED, ALIAS, ACCEPTED)))
async def test_a_field_that_acts_or_is_accepted_is_answered(client, endpoint, name):
    body = body_with(endpoint, name, FIELDS[endpoint][name].example)
    response = await client.post(ROUTES[endpoint], json=body)
    expected = ACTING.get((endpoint, name), 200)
    assert response.status == expected, (body, await response.text())


@pytest.mark.parametrize("endpoint, name", rows((REFUSED,)))
async def test_a_refused_field_is_a_400_naming_it(client, endpoint, name):
    row = FIELDS[endpoint][name]
    response = await client.post(ROUTES[endpoint], json=body_with(endpoint, name, row.example))
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    if endpoint == MESSAGES:  # Anthropic's shape
        assert error["type"] == "invalid_request_error" and name in error["message"]
        return
    if endpoint in OLLAMA:  # Ollama's: the message alone
        assert name in error and row.note in error
    else:
        assert (error["code"], error["param"]) == ("unsupported_parameter", name)
        assert row.note in error["message"]
    for neutral in (None, *row.neutral):
        response = await client.post(ROUTES[endpoint], json=body_with(endpoint, name, neutral))
        assert response.status == 200, (neutral, await response.text())


@pytest.mark.parametrize("endpoint", list(FIELDS))
async def test_a_field_in_no_row_is_refused_as_openai_refuses_it(client, endpoint):
    response = await client.post(ROUTES[endpoint], json={**BASE[endpoint], "foo_bar": 1})
    assert response.status == 400
    error = (await response.json())["error"]
    if endpoint in OLLAMA:  # Ollama's: the message alone
        assert "Unrecognized request argument supplied: foo_bar" in error
        return
    assert "Unrecognized request argument supplied: foo_bar" in error["message"]
    if endpoint != MESSAGES:
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "unknown_parameter",
                                                                  "foo_bar")


async def test_the_operator_accepts_unknown_fields_and_logs_them(tiny_model, make_client, caplog):
    client = await make_client(tiny_model, accept_unknown_fields=True)
    response = await client.post(ROUTES[CHAT], json={**BASE[CHAT], "foo_bar": 1})
    assert response.status == 200, await response.text()
    assert any("unknown request fields accepted and ignored" in str(r.msg) for r in caplog.records)
    # a refused field is refused all the same
    response = await client.post(ROUTES[CHAT], json={**BASE[CHAT], "typical_p": 0.5})
    assert response.status == 400
