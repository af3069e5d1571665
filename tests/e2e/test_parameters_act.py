"""Every sampling parameter reaches the sampler and changes what the server
returns.

`CHANGES` holds, for every field of `SamplingParams`, two requests that differ
in that one parameter and must get different answers through the HTTP app;
`test_every_sampling_parameter_has_a_case` fails when a field has no entry, so
a parameter added later cannot go untested. Each case fails if its parameter
is dropped anywhere between the HTTP body and the sampler. The other tests
here check what each parameter does to the output; the arithmetic of each one
is tested in test_engine.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from lockgate.engine.params import SamplingParams
from lockgate.plugin_api.request import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, parse_request
from tiny_model import tiny_vocab

VOCAB = tiny_vocab()
A, B = VOCAB.index("a"), VOCAB.index("b")
#: the tiny model's end-of-turn token
EOS = VOCAB.index("<|im_end|>")
#: a special token that does not end generation
IM_START = VOCAB.index("<|im_start|>")

#: "a" and "b" far above every other token: the model alone picks between them
AB = {str(A): 50, str(B): 50}
HOT = {"logit_bias": {}, "temperature": 2.0, "seed": 5}
#: Starting after "b" and with "a" raised by 3.5 more than "b", the tiny model
#: still repeats "b" (it favours repeating its last token), but by less than
#: a penalty of 2, so a penalty on "b" turns it to "a".
B_THEN_A = {"prompt": [B], "logit_bias": {str(A): 53.5, str(B): 50}}

#: The request-body key a field is read from, where it is not the field's name.
#: `grammar` is compiled from `response_format` by the pipeline (not by
#: `GenerationRequest.sampling_params`), so that is the key that must act.
BODY_KEYS = {"grammar": "response_format", "prompt_logprobs": "echo"}
#: fields the pipeline fills in (a compiled grammar, a tokenized prediction)
FROM_THE_PIPELINE = ("grammar", "prediction")

#: For every field of `SamplingParams`: (what both requests send, what only
#: the first sends, what only the second sends). On top of `complete`'s
#: defaults: greedy, 12 tokens, ignore_eos, "a" and "b" biased as in `AB`.
CHANGES = {
    "max_tokens": ({}, {}, {"max_tokens": 3}),
    "min_tokens": ({"logit_bias": {str(EOS): 100}, "ignore_eos": False}, {}, {"min_tokens": 5}),
    "temperature": ({"logit_bias": {}, "seed": 5}, {}, {"temperature": 2.0}),
    "top_p": (HOT, {}, {"top_p": 1e-9}),
    "top_k": (HOT, {}, {"top_k": 1}),
    "min_p": (HOT, {}, {"min_p": 1.0}),
    "presence_penalty": (B_THEN_A, {}, {"presence_penalty": 2.0}),
    "frequency_penalty": ({}, {}, {"frequency_penalty": 2.0}),
    "repetition_penalty": ({}, {}, {"repetition_penalty": 1.5}),
    "logit_bias": ({}, {"logit_bias": {}}, {"logit_bias": AB}),
    "seed": ({"logit_bias": {}, "temperature": 1.5}, {"seed": 11}, {"seed": 12}),
    "stop": ({}, {}, {"stop": ["a", "b"]}),
    "stop_token_ids": ({}, {}, {"stop_token_ids": [A, B]}),
    "ignore_eos": ({"logit_bias": {str(EOS): 100}}, {}, {"ignore_eos": False}),
    "n": ({}, {}, {"n": 3}),
    "skip_special_tokens": ({"logit_bias": {str(IM_START): 100}}, {}, {"skip_special_tokens": False}),
    "logprobs": ({}, {}, {"logprobs": 2}),
    # completions' echo with logprobs: the prompt's tokens have theirs too
    "prompt_logprobs": ({"logprobs": 1}, {}, {"echo": True}),
    "grammar": ({}, {}, {"response_format": {"type": "json_object"}}),
    # the same text, and usage.completion_tokens_details counts the predicted tokens taken
    "prediction": ({}, {}, {"prediction": {"type": "content", "content": "abababab"}}),
}


def test_every_sampling_parameter_has_a_case():
    fields = sorted(field.name for field in dataclasses.fields(SamplingParams))
    assert sorted(CHANGES) == fields, "give every SamplingParams field a case in CHANGES"
    for field, (_, first, second) in CHANGES.items():
        # the two requests differ in this parameter and nothing else
        assert set(first) | set(second) == {BODY_KEYS.get(field, field)}, field
        assert first != second, field


def sampling_params(body, endpoint=COMPLETIONS_ENDPOINT):
    """What the engine is given for a body, as the pipeline converts it."""
    required = {"prompt": "x"} if endpoint == COMPLETIONS_ENDPOINT else {"messages": [{"role": "user", "content": "x"}]}
    return parse_request(endpoint, {**required, **body}, request_id="t").sampling_params()


def test_the_typed_request_converts_every_parameter():
    body = {
        "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1,
        "presence_penalty": 0.3, "frequency_penalty": 0.4, "repetition_penalty": 1.2,
        "logit_bias": {"5": -3}, "seed": 9, "stop": "x", "stop_token_ids": [3],
        "ignore_eos": True, "n": 2, "skip_special_tokens": False, "logprobs": 3, "echo": True, "min_tokens": 2,
    }
    params = sampling_params(body)
    assert params == SamplingParams(
        max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, presence_penalty=0.3,
        frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={5: -3.0}, seed=9, stop=("x",),
        stop_token_ids=(3,), ignore_eos=True, n=2, skip_special_tokens=False, logprobs=3, prompt_logprobs=3,
    )
    defaults = SamplingParams()
    for field in dataclasses.fields(SamplingParams):
        if field.name not in FROM_THE_PIPELINE:  # every parameter of the body above was read
            assert getattr(params, field.name) != getattr(defaults, field.name), field.name
    assert sampling_params({"max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3
    assert sampling_params({"logprobs": True, "top_logprobs": 4}, CHAT_ENDPOINT).logprobs == 4
    assert sampling_params({"logprobs": False}, CHAT_ENDPOINT).logprobs is None
    assert sampling_params({"top_k": -1}).top_k == 0


@pytest.fixture
async def complete(tiny_model, make_client):
    assert tiny_model.tokenizer.encode("ab", add_special_tokens=False) == [A, B]
    assert tiny_model.eos_token_ids[0] == EOS
    client = await make_client(tiny_model)

    async def run(**body):
        """Greedy by default, with tokens "a" and "b" far above all others."""
        body = {"model": "tiny", "prompt": "x", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, **body}
        body.setdefault("logit_bias", AB)
        response = await client.post("/v1/completions", json=body)
        assert response.status == 200, await response.text()
        return await response.json()

    async def text(**body):
        return (await run(**body))["choices"][0]["text"]

    run.text = text
    run.client = client
    return run


@pytest.mark.parametrize("field", sorted(CHANGES))
async def test_each_parameter_changes_the_answer(complete, field):
    shared, first, second = CHANGES[field]
    answers = []
    for only in (first, second):
        twice = []
        for _ in range(2):
            answer = await complete(**shared, **only)
            twice.append({"choices": answer["choices"], "usage": answer["usage"]})
        # greedy or seeded, so a difference below is the parameter's doing
        assert twice[0] == twice[1], only
        answers.append(twice[0])
    assert answers[0] != answers[1]
    if field == "logprobs":  # an empty logprobs object would differ too: the figures must be there
        logprobs = answers[1]["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == 12 and all(lp <= 0 for lp in logprobs["token_logprobs"])
        assert [len(top) for top in logprobs["top_logprobs"]] == [2] * 12


async def test_penalties_break_repetition(complete):
    baseline = await complete.text()
    assert set(baseline) <= {"a", "b"} and len(baseline) == 12
    for params in ({"frequency_penalty": 2.0}, {"repetition_penalty": 1.5}):
        penalized = await complete.text(**params)
        assert set(penalized) <= {"a", "b"}
        assert penalized != baseline, params
        longest_run = max(len(run) for run in penalized.replace("a", " a").replace("b", " b").split())
        assert longest_run < 12


async def test_presence_penalty_counts_each_token_once(complete):
    """presence_penalty lowers every token already generated by the same
    amount, however often it came; frequency_penalty grows with the count."""
    assert await complete.text(**B_THEN_A) == "b" * 12
    # "b" is penalized after its first time, so "a" wins; from then on both
    # carry the same penalty and the model keeps repeating "a"
    assert await complete.text(**B_THEN_A, presence_penalty=2.0) == "b" + "a" * 11
    # with frequency_penalty each further "a" costs more, until "b" wins again
    frequency = await complete.text(**B_THEN_A, frequency_penalty=2.0)
    assert frequency.startswith("ba") and "ab" in frequency


async def test_bias_temperature_and_filters(complete):
    free = {"logit_bias": {}}
    greedy = await complete.text(**free)
    assert greedy != await complete.text()  # logit_bias acts
    hot = {**free, "temperature": 2.0}
    assert await complete.text(**hot, seed=5) != greedy
    assert await complete.text(**hot, seed=5, top_k=1) == greedy
    assert await complete.text(**hot, seed=5, top_p=1e-9) == greedy
    assert await complete.text(**hot, seed=5, min_p=1.0) == greedy


async def test_min_tokens_holds_back_every_stop(complete):
    """Before min_tokens tokens are out, end-of-generation and stop token
    ids are not sampled and stop strings are not looked for; after, each
    stops the output as before."""
    baseline = await complete.text()
    ended = await complete(ignore_eos=False, logit_bias={str(EOS): 100}, min_tokens=4)
    assert ended["usage"]["completion_tokens"] == 5 and ended["choices"][0]["finish_reason"] == "stop"
    first = VOCAB.index(baseline[0])
    held = await complete(stop_token_ids=[first], min_tokens=3)
    assert held["usage"]["completion_tokens"] > 3
    stop = baseline[0]
    cut = await complete.text(stop=[stop], min_tokens=3)
    later = baseline.find(stop, 2)
    assert cut == (baseline if later < 0 else baseline[:later])
    # past the context a request cannot reach its min_tokens
    response = await complete.client.post("/v1/completions", json={
        "model": "tiny", "prompt": "x", "max_tokens": 2, "min_tokens": 3})
    assert response.status == 400 and (await response.json())["error"]["param"] == "min_tokens"


async def test_seed_reproduces(complete):
    hot = {"temperature": 1.5, "logit_bias": {}}
    first = await complete.text(**hot, seed=11)
    assert await complete.text(**hot, seed=11) == first
    assert await complete.text(**hot, seed=12) != first


async def test_stops_and_lengths(complete):
    baseline = await complete.text()
    cut = await complete(stop=[baseline[3:5]])
    assert cut["choices"][0]["text"] == baseline[: baseline.index(baseline[3:5])]
    assert cut["choices"][0]["finish_reason"] == "stop"
    first = VOCAB.index(baseline[0])
    stopped = await complete(stop_token_ids=[first])
    assert stopped["choices"][0]["text"] == "" and stopped["usage"]["completion_tokens"] == 1
    assert await complete.text(max_tokens=3) == baseline[:3]
    ended = await complete(ignore_eos=False, logit_bias={str(EOS): 100})
    assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] == 1
    ignored = await complete(logit_bias={str(EOS): 100})
    assert ignored["usage"]["completion_tokens"] == 12


async def test_special_tokens_are_skipped_unless_asked(complete):
    special = {"logit_bias": {str(IM_START): 100}, "max_tokens": 3}
    skipped = await complete(**special)
    assert skipped["choices"][0]["text"] == "" and skipped["usage"]["completion_tokens"] == 3
    assert await complete.text(**special, skip_special_tokens=False) == "<|im_start|>" * 3


async def test_n_and_logprobs(complete):
    many = await complete(n=3, temperature=1.0, logit_bias={})
    assert len(many["choices"]) == 3
    with_logprobs = await complete(logprobs=2)
    assert len(with_logprobs["choices"][0]["logprobs"]["tokens"]) == 12
