"""Every accepted sampling parameter reaches the sampler and changes what the
server returns: each test here fails if a parameter is dropped anywhere
between the HTTP body and the sampler. (The arithmetic of each one is tested
in test_engine.py.)"""

from __future__ import annotations

import pytest

from lockgate.params import SamplingParams


def test_from_body_reads_every_parameter():
    body = {
        "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1,
        "presence_penalty": 0.3, "frequency_penalty": 0.4, "repetition_penalty": 1.2,
        "logit_bias": {"5": -3}, "seed": 9, "stop": "x", "stop_token_ids": [3],
        "ignore_eos": True, "n": 2, "skip_special_tokens": False, "logprobs": 3,
    }
    params = SamplingParams.from_body(body)
    assert params == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, presence_penalty=0.3,
        frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={5: -3.0}, seed=9, stop=("x",),
        stop_token_ids=(3,), ignore_eos=True, n=2, skip_special_tokens=False, logprobs=3,
    )
    assert SamplingParams.from_body({"max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3
    assert SamplingParams.from_body({"logprobs": True, "top_logprobs": 4}).logprobs == 4
    assert SamplingParams.from_body({"logprobs": False}).logprobs is None
    assert SamplingParams.from_body({"top_k": -1}).top_k == 0


@pytest.fixture
async def complete(tiny_model, make_client):
    client = await make_client(tiny_model)
    a, b = (tiny_model.tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")

    async def run(**body):
        """Greedy by default, with tokens "a" and "b" far above all others."""
        body = {"model": "tiny", "prompt": "x", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, **body}
        body.setdefault("logit_bias", {str(a): 50, str(b): 50})
        response = await client.post("/v1/completions", json=body)
        assert response.status == 200, await response.text()
        return await response.json()

    async def text(**body):
        return (await run(**body))["choices"][0]["text"]

    run.text = text
    return run


async def test_penalties_break_repetition(complete):
    baseline = await complete.text()
    assert set(baseline) <= {"a", "b"} and len(baseline) == 12
    # each "a" or "b" is 50 logits above the rest: the model alone picks between them
    for params in ({"frequency_penalty": 2.0}, {"repetition_penalty": 1.5}):
        penalized = await complete.text(**params)
        assert set(penalized) <= {"a", "b"}
        assert penalized != baseline, params
        longest_run = max(len(run) for run in penalized.replace("a", " a").replace("b", " b").split())
        assert longest_run < 12


async def test_bias_temperature_and_filters(complete):
    free = {"logit_bias": {}}
    greedy = await complete.text(**free)
    assert greedy != await complete.text()  # logit_bias acts
    hot = {**free, "temperature": 2.0}
    assert await complete.text(**hot, seed=5) != greedy
    assert await complete.text(**hot, seed=5, top_k=1) == greedy
    assert await complete.text(**hot, seed=5, top_p=1e-9) == greedy
    assert await complete.text(**hot, seed=5, min_p=1.0) == greedy


async def test_seed_reproduces(complete):
    hot = {"temperature": 1.5, "logit_bias": {}}
    first = await complete.text(**hot, seed=11)
    assert await complete.text(**hot, seed=11) == first
    assert await complete.text(**hot, seed=12) != first


async def test_stops_and_lengths(complete, tiny_model):
    baseline = await complete.text()
    cut = await complete(stop=[baseline[3:5]])
    assert cut["choices"][0]["text"] == baseline[: baseline.index(baseline[3:5])]
    assert cut["choices"][0]["finish_reason"] == "stop"
    first = tiny_model.tokenizer.encode(baseline[0], add_special_tokens=False)[0]
    stopped = await complete(stop_token_ids=[first])
    assert stopped["choices"][0]["text"] == "" and stopped["usage"]["completion_tokens"] == 1
    assert await complete.text(max_tokens=3) == baseline[:3]
    eos = tiny_model.eos_token_ids[0]
    ended = await complete(ignore_eos=False, logit_bias={str(eos): 100})
    assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] == 1
    ignored = await complete(logit_bias={str(eos): 100})
    assert ignored["usage"]["completion_tokens"] == 12


async def test_n_and_logprobs(complete):
    many = await complete(n=3, temperature=1.0, logit_bias={})
    assert len(many["choices"]) == 3
    with_logprobs = await complete(logprobs=2)
    assert len(with_logprobs["choices"][0]["logprobs"]["tokens"]) == 12
