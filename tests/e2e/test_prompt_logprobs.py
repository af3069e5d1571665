"""Completions' `echo` with prompt logprobs, as loglikelihood evaluation
(lm-evaluation-harness) sends it: the answer starts with the prompt, and
with `logprobs` each prompt token has its log-probability given the tokens
before it (the first none), then the generated tokens follow. Each prompt
position's figures are checked against a separate request whose prompt
stops just before that token."""

from __future__ import annotations

import json

import pytest

COMPLETIONS = "/v1/completions"
PROMPT = "the cat sat on the mat and the dog sat on the log"


async def completion(client, **fields) -> dict:
    response = await client.post(COMPLETIONS, json={"model": "tiny", "temperature": 0, **fields})
    assert response.status == 200, await response.text()
    return await response.json()


def token_ids(model, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_special_tokens=True)


@pytest.fixture(scope="module")
def chunked_model(load_tiny):
    """The tiny model with a step budget of 5 tokens: prompts go in in chunks."""
    return load_tiny(max_num_batched_tokens=5)


@pytest.mark.parametrize("which", ["whole", "chunked"])
async def test_each_prompt_token_has_the_logprob_a_prompt_ending_before_it_gives(
    tiny_model, chunked_model, make_client, which
):
    model = tiny_model if which == "whole" else chunked_model
    client = await make_client(model)
    ids = token_ids(model, PROMPT)
    assert len(ids) > 8
    echoed = await completion(client, prompt=PROMPT, echo=True, logprobs=5, max_tokens=1)
    choice = echoed["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt's tokens, then the one generated
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    spelled = [model.token_bytes.text(t) for t in ids]
    assert logprobs["tokens"][: len(ids)] == spelled
    assert logprobs["text_offset"][: len(ids)] == [sum(map(len, spelled[:i])) for i in range(len(ids))]
    for q in range(1, len(ids) + 1):
        # the distribution after ids[:q], asked for on its own
        alone = (await completion(client, prompt=ids[:q], logprobs=5, max_tokens=1))["choices"][0]["logprobs"]
        top_alone = alone["top_logprobs"][0]
        top_echoed = logprobs["top_logprobs"][q]
        assert list(top_echoed) == list(top_alone), q
        assert list(top_echoed.values()) == pytest.approx(list(top_alone.values()), abs=2e-3), q
        assert list(top_echoed.values()) == sorted(top_echoed.values(), reverse=True)  # the likeliest of a spelling
        if q < len(ids) and spelled[q] in top_alone:
            assert logprobs["token_logprobs"][q] == pytest.approx(top_alone[spelled[q]], abs=2e-3), q
        assert logprobs["token_logprobs"][q] <= max(top_echoed.values()) + 1e-6
    # the generated token is the one greedy decoding gives
    assert logprobs["token_logprobs"][-1] == pytest.approx(alone["token_logprobs"][0], abs=2e-3)


async def test_max_tokens_0_echoes_the_prompt_alone_and_a_cached_prefix_changes_nothing(tiny_model, make_client):
    client = await make_client(tiny_model)
    first = await completion(client, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    # the same prompt again: its prefix is in the prefix cache, but the
    # logprobs are computed again, not read from it
    second = await completion(client, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    for answer in (first, second):
        choice = answer["choices"][0]
        assert choice["text"] == PROMPT
        assert choice["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 0
        assert len(choice["logprobs"]["token_logprobs"]) == answer["usage"]["prompt_tokens"]
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_batched_token_id_prompts_with_n_each_echo_their_own_prompt(tiny_model, make_client):
    client = await make_client(tiny_model)
    prompts = [token_ids(tiny_model, "the cat sat"), token_ids(tiny_model, "a dog ran far away")]
    answer = await completion(client, prompt=prompts, echo=True, logprobs=0, max_tokens=3, n=2,
                              temperature=0.8, seed=1)
    assert len(answer["choices"]) == 4
    for choice in answer["choices"]:
        prompt = prompts[choice["index"] // 2]
        text = tiny_model.tokenizer.decode(prompt)
        assert choice["text"].startswith(text)
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 3
        assert logprobs["top_logprobs"][1] == {}  # logprobs 0: no alternatives, as OpenAI has it
    # echo without logprobs: the text alone
    plain = await completion(client, prompt="the cat sat", echo=True, max_tokens=2)
    assert plain["choices"][0]["text"].startswith("the cat sat") and plain["choices"][0]["logprobs"] is None


async def test_a_streamed_echo_starts_with_the_prompt_and_its_logprobs(tiny_model, make_client):
    client = await make_client(tiny_model)
    whole = await completion(client, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, ignore_eos=True)
    response = await client.post(COMPLETIONS, json={"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 2,
                                                    "max_tokens": 4, "ignore_eos": True, "temperature": 0,
                                                    "stream": True})
    assert response.status == 200
    chunks = [json.loads(line[6:]) for line in (await response.text()).splitlines()
              if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    token_logprobs = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    offsets = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    expected = whole["choices"][0]
    assert text == expected["text"]
    assert tokens == expected["logprobs"]["tokens"]
    assert offsets == expected["logprobs"]["text_offset"]
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(expected["logprobs"]["token_logprobs"][1:], abs=1e-4)


async def test_chat_refuses_max_tokens_0_and_completions_without_echo_too(tiny_model, make_client):
    client = await make_client(tiny_model)
    response = await client.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "max_tokens": 0})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == "max_tokens" and "echo" in error["message"]
    response = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert response.status == 400


# ------------------------------------------------------------------ the tokenizer routes


async def test_tokenize_counts_as_the_api_does_and_detokenize_inverts_it(tiny_model, make_client):
    client = await make_client(tiny_model)
    response = await client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True})
    assert response.status == 200, await response.text()
    tokenized = await response.json()
    assert tokenized["tokens"] == token_ids(tiny_model, PROMPT)
    assert tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == tiny_model.context_length
    assert tokenized["token_strs"] == [tiny_model.token_bytes.text(t) for t in tokenized["tokens"]]
    # the count is the one the completions API reports
    usage = (await completion(client, prompt=PROMPT, max_tokens=1))["usage"]
    assert usage["prompt_tokens"] == tokenized["count"]
    plain = await (await client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})).json()
    assert plain["tokens"] == tiny_model.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert plain["token_strs"] is None
    back = await client.post("/detokenize", json={"model": "tiny", "tokens": plain["tokens"]})
    assert back.status == 200 and (await back.json())["prompt"] == PROMPT
    # a chat, rendered through the template as the chat API renders it
    messages = [{"role": "user", "content": "hello there"}]
    chat = await (await client.post("/tokenize", json={"messages": messages})).json()
    answer = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1})
    assert chat["count"] == (await answer.json())["usage"]["prompt_tokens"]


async def test_tokenizer_info_names_the_special_tokens_and_the_template(tiny_model, make_client):
    client = await make_client(tiny_model)
    info = await (await client.get("/tokenizer_info")).json()
    tokenizer = tiny_model.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["model_max_length"] == tiny_model.context_length
    assert info["vocab_size"] == tiny_model.vocab_size
    assert "messages" in info["chat_template"]


@pytest.mark.parametrize("route, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, "model"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
async def test_bad_tokenizer_requests_are_400_naming_the_field(tiny_model, make_client, route, body, param):
    client = await make_client(tiny_model)
    response = await client.post(route, json=body)
    assert response.status in (400, 404), await response.text()
    assert (await response.json())["error"]["param"] == param


async def test_the_tokenizer_routes_are_behind_the_api_key(tiny_model, make_client):
    client = await make_client(tiny_model, api_keys=("k",))
    assert (await client.get("/tokenizer_info")).status == 401
    assert (await client.post("/tokenize", json={"prompt": "a"})).status == 401
    assert (await client.post("/detokenize", json={"tokens": [1]})).status == 401
    ok = await client.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer k"})
    assert ok.status == 200


# ------------------------------------------------------------------ vLLM's prompt_logprobs


async def test_the_prompt_logprobs_extension_has_vllms_shape(tiny_model, make_client):
    client = await make_client(tiny_model)
    ids = token_ids(tiny_model, PROMPT)
    echoed = (await completion(client, prompt=PROMPT, echo=True, logprobs=4, max_tokens=0))["choices"][0]
    answer = await completion(client, prompt=PROMPT, prompt_logprobs=2, max_tokens=2, n=2, ignore_eos=True)
    text = tiny_model.token_bytes.text
    for choice in answer["choices"]:
        assert choice["text"] and not choice["text"].startswith(PROMPT)  # no echo: the answer alone
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for q, entry in enumerate(entries[1:], 1):
            token = entry[str(ids[q])]
            assert token["decoded_token"] == text(ids[q])
            assert token["logprob"] == pytest.approx(echoed["logprobs"]["token_logprobs"][q], abs=1e-5)
            # the two likeliest, ranked, the first the echo's likeliest too
            # (the echo keys its alternatives by text, which tokens can share)
            top_two = sorted((v for v in entry.values() if v["rank"] <= 2), key=lambda v: v["rank"])
            assert [v["rank"] for v in top_two] == [1, 2]
            assert top_two[0]["logprob"] >= top_two[1]["logprob"] >= token["logprob"] - 1e-6
            assert top_two[0]["logprob"] == pytest.approx(max(echoed["logprobs"]["top_logprobs"][q].values()),
                                                          abs=1e-5)
            assert len(entry) == (2 if token["rank"] <= 2 else 3)
    # chat: once, for the prompt the template rendered
    chat = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    body = await chat.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])  # the token alone
    # streaming does not carry them: refused, not dropped
    refused = await client.post(COMPLETIONS, json={"model": "tiny", "prompt": "a", "prompt_logprobs": 1,
                                                   "stream": True})
    assert refused.status == 400 and (await refused.json())["error"]["param"] == "prompt_logprobs"
