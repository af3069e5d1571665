"""`POST /v1/embeddings` through the openai SDK, against llama.cpp's own
embeddings of the same tiny files (`tests/data/embedding_goldens.json`,
recorded by `tests/data/record_embedding_goldens.py`)."""

from __future__ import annotations

import base64
import json
import pathlib
import sys

import numpy as np
import openai
import pytest

from helpers import TINY_EXECUTOR, wait_idle
from paths import DATA

from lockgate.engine import EngineOptions
from lockgate.engine.executor import ExecutorOptions
from lockgate.models import load_model
from lockgate.plugin_api.manager import get_plugin_manager

sys.path.insert(0, str(DATA))
from record_embedding_goldens import CASES, sha256, write_case  # noqa: E402

GOLDENS = json.loads((DATA / "embedding_goldens.json").read_text())


@pytest.fixture(scope="module")
def case_files(tmp_path_factory) -> dict[str, pathlib.Path]:
    d = tmp_path_factory.mktemp("embedding-cases")
    return {name: write_case(d, name) for name in CASES}


@pytest.fixture(scope="module")
def load_case(case_files):
    loaded = {}

    def load(name: str):
        if name not in loaded:
            loaded[name] = load_model(
                get_plugin_manager(autoload=False), str(case_files[name]), served_name="tiny",
                executor_options=ExecutorOptions.of(**TINY_EXECUTOR), engine_options=EngineOptions(),
                pooling=CASES[name][1],
            )
        return loaded[name]

    yield load
    for model in loaded.values():
        model.engine.shutdown()
        model.executor.close()


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("name", list(CASES))
async def test_embeddings_equal_llama_cpp(name, case_files, load_case, make_openai):
    """Each family and pooling: the same tokens as llama.cpp makes of each
    text, and vectors within cosine 0.9999 of llama.cpp's, unit length."""
    golden = GOLDENS["cases"][name]
    assert sha256(case_files[name]) == golden["sha256"], "the tiny writer changed: record the goldens again"
    model = load_case(name)
    for text, tokens in zip(GOLDENS["texts"], golden["tokens"]):
        assert model.tokenizer.encode(text, add_special_tokens=True) == tokens
    client = await make_openai(model)
    reply = await client.embeddings.create(model="tiny", input=GOLDENS["texts"], encoding_format="float")
    assert [d.index for d in reply.data] == list(range(len(GOLDENS["texts"])))
    assert reply.usage.prompt_tokens == sum(map(len, golden["tokens"])) == reply.usage.total_tokens
    for data, want in zip(reply.data, golden["embeddings"]):
        assert len(data.embedding) == model.config.hidden_size
        assert abs(np.linalg.norm(data.embedding) - 1) < 1e-5
        assert cosine(data.embedding, want) > 0.9999, name
    assert (await wait_idle(model.engine)).kv_pages_used == 0


async def test_base64_token_ids_and_batches(load_case, make_openai):
    """The SDK's default (base64, decoded by the SDK), token-id inputs equal
    to their text, one input equal to itself in a batch, and a batch larger
    than the engine's queue window."""
    model = load_case("llama-mean")
    golden = GOLDENS["cases"]["llama-mean"]
    client = await make_openai(model)
    text = GOLDENS["texts"][1]
    by_default = await client.embeddings.create(model="tiny", input=text)
    as_floats = await client.embeddings.create(model="tiny", input=text, encoding_format="float")
    np.testing.assert_allclose(by_default.data[0].embedding, as_floats.data[0].embedding, rtol=0, atol=0)
    ids = await client.embeddings.create(model="tiny", input=[golden["tokens"][1], golden["tokens"][0]],
                                         encoding_format="float")
    np.testing.assert_allclose(ids.data[0].embedding, as_floats.data[0].embedding, atol=1e-6)
    many = await client.embeddings.create(model="tiny", input=[text] * 150, encoding_format="float")
    assert len(many.data) == 150 and many.usage.prompt_tokens == 150 * len(golden["tokens"][1])
    for data in many.data:
        np.testing.assert_allclose(data.embedding, as_floats.data[0].embedding, atol=1e-5)
    raw = await client.with_raw_response.embeddings.create(model="tiny", input="hello", encoding_format="base64")
    body = json.loads(raw.http_response.text)
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (model.config.hidden_size,)
    assert (await wait_idle(model.engine)).kv_pages_used == 0


@pytest.mark.parametrize("body, param, says", [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["a", ""]}, "input[1]", "empty string"),
    ({"input": [[1, 100000]]}, "input", "outside the vocabulary"),
    ({"input": 3}, "input", "must be a string"),
    ({"input": "hi", "dimensions": 7}, "dimensions", "cannot shorten"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "hi", "temperature": 0.5}, "temperature", "Unrecognized request argument"),
    ({"input": [[5] * 600]}, "input", "maximum context length is 512"),
    ({"input": "hi " * 3000}, "input", "maximum context length is 512"),
    ({"input": ["x"] * 2049}, "input", "the limit is 2048"),
])
async def test_bad_input_is_a_400_naming_the_field(body, param, says, load_case, make_openai):
    model = load_case("llama-mean")
    client = await make_openai(model)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.post("/embeddings", body={"model": "tiny", **body}, cast_to=object)
    error = caught.value.body
    assert error["param"] == param and says in error["message"], error
    assert (await wait_idle(model.engine)).kv_pages_used == 0


async def test_an_input_filling_the_whole_context_is_embedded(load_case, make_openai):
    model = load_case("llama-last")
    client = await make_openai(model)
    reply = await client.embeddings.create(model="tiny", input=[[5] * 512], encoding_format="float")
    assert reply.usage.prompt_tokens == 512
    assert abs(np.linalg.norm(reply.data[0].embedding) - 1) < 1e-5


async def test_embeddings_and_generation_share_the_engine(load_case, make_openai):
    """Chat and embeddings at once on one engine: each answers as it does alone."""
    import asyncio

    model = load_case("llama-mean")
    client = await make_openai(model)
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True})
    alone_chat = (await client.chat.completions.create(**chat)).choices[0].message.content
    alone_vec = (await client.embeddings.create(model="tiny", input="hello world", encoding_format="float")).data
    replies = await asyncio.gather(*[client.chat.completions.create(**chat) for _ in range(3)],
                                   *[client.embeddings.create(model="tiny", input="hello world",
                                                              encoding_format="float") for _ in range(3)])
    for reply in replies[:3]:
        assert reply.choices[0].message.content == alone_chat
    for reply in replies[3:]:
        np.testing.assert_allclose(reply.data[0].embedding, alone_vec[0].embedding, atol=1e-5)
