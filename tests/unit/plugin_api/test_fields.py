"""The request field tables (`lockgate.plugin_api.fields`): the docs show
them, every implemented row is a field its request type reads, and the
check refuses what no row names and what a refused row asks for."""

from __future__ import annotations

import dataclasses

import pytest

from paths import ROOT

from lockgate.errors import UnknownParameter, UnsupportedParameter
from lockgate.plugin_api import fields
from lockgate.plugin_api.constraints import CONSTRAINT_FIELDS
from lockgate.plugin_api.fields import (
    ACCEPTED, ALIAS, CHAT, COMPLETIONS, EMBEDDINGS, FIELDS, IMPLEMENTED, MESSAGES, OLLAMA_EMBED, REFUSED, RESPONSES,
    TOKENIZE, FieldPolicy, check_fields, markdown_table,
)
from lockgate.plugin_api.embeddings import EmbeddingRequest
from lockgate.plugin_api.rerank import RerankRequest, ScoreRequest
from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.plugin_api.messages import MessagesRequest
from lockgate.plugin_api.request import ChatRequest, CompletionRequest
from lockgate.plugin_api.responses import ResponsesRequest

FEATURES = ROOT / "docs" / "features.md"
START = "<!-- request fields: python -m lockgate.plugin_api.fields -->\n"
END = "<!-- end of request fields -->\n"


def test_the_docs_table_is_the_field_table():
    text = FEATURES.read_text()
    assert START in text and END in text, "docs/features.md lost the request fields' markers"
    documented = text[text.index(START) + len(START):text.index(END)]
    assert documented == markdown_table(), (
        "docs/features.md is stale: paste `python -m lockgate.plugin_api.fields` between the markers")


def readers(cls) -> set[str]:
    """The body keys a request type reads itself."""
    return {f.metadata.get("key") or f.name for f in dataclasses.fields(cls) if f.metadata.get("reader")}


def read_rows(endpoint: str) -> set[str]:
    """The rows whose field acts: implemented ones and aliases."""
    return {name for name, f in FIELDS[endpoint].items() if f.kind in (IMPLEMENTED, ALIAS)}


@pytest.mark.parametrize("endpoint, read", [
    (CHAT, readers(ChatRequest) | set(CONSTRAINT_FIELDS)),
    (COMPLETIONS, readers(CompletionRequest) | set(CONSTRAINT_FIELDS)),
    (RESPONSES, readers(ResponsesRequest)),
    # cache_control is read by parse_messages_request itself
    (MESSAGES, readers(MessagesRequest) | {"cache_control"}),
    (TOKENIZE, {"model", "prompt", "messages", "add_special_tokens", "return_token_strs", "tools", "tool_choice",
                "functions", "function_call", "chat_template_kwargs", "reasoning_effort"}),
    (EMBEDDINGS, readers(EmbeddingRequest)),
    # read by parse_ollama_embed itself, keep_alive by the route
    (OLLAMA_EMBED, {"model", "input", "truncate", "dimensions", "options", "keep_alive"}),
    (fields.RERANK, readers(RerankRequest)),
    (fields.SCORE, readers(ScoreRequest)),
])
def test_what_the_table_says_acts_is_what_the_code_reads(endpoint, read):
    assert read_rows(endpoint) == read


def test_every_row_says_what_it_does():
    for endpoint, rows in FIELDS.items():
        for name, row in rows.items():
            assert row.name == name and row.note, (endpoint, name)
            assert row.kind != REFUSED or not row.asks_for_nothing(row.example), (endpoint, name)
            assert row.kind == REFUSED or not row.neutral, (endpoint, name)


def test_refused_fields_are_refused_unless_they_ask_for_nothing():
    check_fields(CHAT, {"typical_p": 1.0, "audio": None, "modalities": ["text"], "echo": False})
    for value in (0.9, True, "1"):
        with pytest.raises(UnsupportedParameter) as raised:
            check_fields(CHAT, {"typical_p": value})
        assert raised.value.param == "typical_p"
        assert "locally typical sampling is not implemented" in raised.value.message
    # true is not 1 in JSON, and 0 is not false
    with pytest.raises(UnsupportedParameter):
        check_fields(CHAT, {"mirostat": False})
    with pytest.raises(UnsupportedParameter):
        check_fields(CHAT, {"use_beam_search": 0})


def test_accepted_fields_still_have_a_type():
    check_fields(CHAT, {"store": True, "metadata": {"a": "b"}, "service_tier": "flex"})
    with pytest.raises(Exception) as raised:
        check_fields(CHAT, {"store": "yes"})
    assert raised.value.param == "store"
    with pytest.raises(UnsupportedParameter):
        check_fields(MESSAGES, {"service_tier": "priority"})


def test_a_field_in_no_row_is_refused_as_openai_refuses_it():
    with pytest.raises(UnknownParameter) as raised:
        check_fields(CHAT, {"model": "m", "foo_bar": 1, "baz": 2})
    error = raised.value
    assert (error.status, error.type, error.code, error.param) == (
        400, "invalid_request_error", "unknown_parameter", "foo_bar")
    assert error.message == "Unrecognized request argument supplied: foo_bar"


def test_the_operator_can_accept_unknown_fields():
    check_fields(CHAT, {"foo_bar": 1}, FieldPolicy(accept_unknown=True))
    # refused rows stay refused
    with pytest.raises(UnsupportedParameter):
        check_fields(CHAT, {"foo_bar": 1, "typical_p": 0.5}, FieldPolicy(accept_unknown=True))


class DeclaresAField:
    @hookimpl
    def lockgate_add_request_fields(self, register):
        register("teapot_strength")
        register("teapot_color", endpoints=("responses",))


def test_plugins_declare_their_fields():
    pm = get_plugin_manager(autoload=False, plugins=[DeclaresAField()])
    policy = FieldPolicy.from_plugins(pm)
    check_fields(CHAT, {"teapot_strength": 3}, policy)
    check_fields(COMPLETIONS, {"teapot_strength": 3}, policy)
    check_fields(RESPONSES, {"teapot_color": "green"}, policy)
    with pytest.raises(UnknownParameter):
        check_fields(RESPONSES, {"teapot_strength": 3}, policy)
    with pytest.raises(UnknownParameter):
        check_fields(CHAT, {"teapot_strength": 3})


@pytest.mark.parametrize("name, endpoints, says", [
    ("temperature", ("chat.completions",), "reads it itself"),
    ("x", ("chat",), "not one of"),
])
def test_a_plugin_cannot_declare_what_lockgate_reads_or_a_missing_endpoint(name, endpoints, says):
    class Bad:
        @hookimpl
        def lockgate_add_request_fields(self, register):
            register(name, endpoints=endpoints)

    with pytest.raises(ValueError, match=says):
        FieldPolicy.from_plugins(get_plugin_manager(autoload=False, plugins=[Bad()]))


def test_counts_add_up():
    counts = fields.counts()
    for endpoint, rows in FIELDS.items():
        assert sum(counts[endpoint].values()) == len(rows)
    assert counts[CHAT][ACCEPTED] >= 5 and counts[CHAT][REFUSED] >= 30
