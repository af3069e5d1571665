"""Device sampling wired in: `Executor.sample`, the TVM executor's
`DeviceLogits`, and the engine choosing tokens where the logits are.

The tiny model served twice on llvm, once with `device_sampling=True` (its
logits stay in TVM tensors and the sampler's kernels choose the tokens) and
once with it off (numpy), answers every kind of request the same: greedy,
seeded temperature/top-k/top-p/min-p, `n > 1` (forked rows share a prompt's
row), logprobs with top_logprobs, penalties and logit_bias, and a JSON
schema. Timing is measured in benchmarks, never asserted here.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from lockgate.engine.params import SamplingParams
from lockgate.engine.sampling import SamplingRow, make_generator, sample_batch
from lockgate.engine.executor import ExecutorOptions
from lockgate.plugins.tvm.settings import TVMOptions

tvm = pytest.importorskip("tvm")

from lockgate.plugins.tvm.executor import DeviceLogits, TVMExecutor  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi there"}]

SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "pick",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"label": {"type": "string", "enum": ["a", "b", "ab"]}, "n": {"type": "integer"}},
            "required": ["label", "n"],
            "additionalProperties": False,
        },
    },
}

#: one request per kind of row the sampler treats differently
REQUESTS = {
    "greedy": dict(temperature=0, max_tokens=12),
    "temperature": dict(temperature=1.0, seed=3, max_tokens=12),
    "top_k": dict(temperature=0.8, seed=4, max_tokens=12, extra_body={"top_k": 5}),
    "top_p": dict(top_p=0.9, seed=5, max_tokens=12),
    "min_p": dict(temperature=1.2, seed=6, max_tokens=12, extra_body={"min_p": 0.1}),
    "n_sampled": dict(n=3, temperature=1.0, seed=7, max_tokens=10),
    "n_greedy": dict(n=2, temperature=0, max_tokens=8),
    "logprobs": dict(temperature=0.7, seed=8, max_tokens=8, logprobs=True, top_logprobs=5),
    "logprobs_greedy": dict(temperature=0, max_tokens=6, logprobs=True, top_logprobs=20),
    "logprobs_n": dict(n=2, temperature=1.1, seed=10, max_tokens=6, logprobs=True, top_logprobs=3),
    "penalties": dict(
        temperature=0.9, seed=9, max_tokens=12, presence_penalty=0.5, frequency_penalty=0.3,
        logit_bias={"40": 5, "41": -100, "60": 2.5}, extra_body={"repetition_penalty": 1.3},
    ),
    "greedy_penalties": dict(temperature=0, max_tokens=12, frequency_penalty=1.0, logit_bias={"50": 3}),
    "schema": dict(seed=11, max_tokens=40, response_format=SCHEMA),
    "schema_greedy": dict(temperature=0, max_tokens=40, response_format=SCHEMA),
}


def _answer(completion) -> list:
    """What must not depend on where the tokens were chosen: each choice's
    text and finish reason, its tokens and their logprobs (to float32
    tolerance; ids may swap between equal values)."""
    out = []
    for choice in completion.choices:
        logprobs = None
        if choice.logprobs is not None:
            logprobs = [
                (t.token, round(t.logprob, 3), [(a.token, round(a.logprob, 3)) for a in t.top_logprobs])
                for t in choice.logprobs.content
            ]
        out.append((choice.index, choice.message.content, choice.finish_reason, logprobs))
    return out


def _same(host: list, device: list) -> None:
    assert len(host) == len(device)
    for (hi, htext, hfinish, hlp), (di, dtext, dfinish, dlp) in zip(host, device):
        assert (hi, htext, hfinish) == (di, dtext, dfinish)
        assert (hlp is None) == (dlp is None)
        for (htok, hval, htop), (dtok, dval, dtop) in zip(hlp or [], dlp or []):
            assert htok == dtok and dval == pytest.approx(hval, abs=2e-3)
            assert [v for _, v in dtop] == pytest.approx([v for _, v in htop], abs=2e-3)


@pytest.fixture(scope="module")
def models(load_tiny):
    """The tiny model on the host sampler and on the device sampler."""
    host = load_tiny(executor_options={"device_sampling": False})
    device = load_tiny(executor_options={"device_sampling": True})
    return host, device


def _count_device_samples(monkeypatch, executor: TVMExecutor) -> list[int]:
    calls = []
    sampler = executor._sampler
    real = sampler.sample_batch

    def counted(logits, rows):
        calls.append(len(rows))
        return real(logits, rows)

    monkeypatch.setattr(sampler, "sample_batch", counted)
    return calls


def test_auto_is_off_on_llvm(models, tiny_model):
    host, device = models
    assert TVMOptions.of(ExecutorOptions.of()).device_sampling is None
    assert tiny_model.executor._sampler is None  # llvm, automatic: numpy
    assert host.executor._sampler is None
    assert device.executor._sampler is not None


async def test_every_kind_of_request_is_answered_the_same(models, make_openai, monkeypatch):
    host_model, device_model = models
    calls = _count_device_samples(monkeypatch, device_model.executor)
    host = await make_openai(host_model)
    device = await make_openai(device_model)
    alone = {}
    for name, kwargs in REQUESTS.items():
        want = _answer(await host.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs))
        got = _answer(await device.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs))
        _same(want, got)
        alone[name] = want
    assert calls, "the device sampler was never used"
    for name in ("schema", "schema_greedy"):
        assert all(json.loads(text)["label"] in ("a", "b", "ab") for _, text, finish, _ in alone[name]
                   if finish == "stop")
    # the sampled requests really sample: not every choice of n=3 is the same
    assert len({text for _, text, _, _ in alone["n_sampled"]}) > 1

    # all of them at once: batches mix every kind, forks share rows, the
    # engine gathers rows out of order; each answer is still the same
    together = await asyncio.gather(
        *(device.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs) for kwargs in REQUESTS.values())
    )
    assert max(calls) > 1
    for name, completion in zip(REQUESTS, together):
        _same(alone[name], _answer(completion))


async def test_streamed_completions_prompt_ids(models, make_openai):
    """The completions route with token-id prompts, streamed, n=2 sampled."""
    answers = []
    for model in models:
        client = await make_openai(model)
        stream = await client.completions.create(
            model="tiny", prompt=[[5, 6, 7], [9, 10]], max_tokens=10, n=2, temperature=0.9, seed=21,
            stream=True, extra_body={"ignore_eos": True},
        )
        text: dict[int, str] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                text[choice.index] = text.get(choice.index, "") + choice.text
        answers.append(text)
    assert answers[0] == answers[1] and len(answers[0]) == 4


async def test_echoed_prompt_logprobs_are_the_same_from_device_logits(models, make_openai):
    """Prompt logprobs read from logits left on the device (every prompt
    position's row) are those of the host path."""
    answers = []
    for model in models:
        client = await make_openai(model)
        completion = await client.completions.create(
            model="tiny", prompt=[[5, 6, 7, 8, 9, 10, 11], [9, 10]], max_tokens=1, echo=True, logprobs=3,
            temperature=0)
        answers.append([(c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs)
                        for c in completion.choices])
    for host, device in zip(*answers):
        assert host[:2] == device[:2]
        assert host[2][0] is None and device[2][0] is None and len(host[2]) == len(host[1])
        assert device[2][1:] == pytest.approx(host[2][1:], abs=2e-3)
        for want, got in zip(host[3][1:], device[3][1:]):
            assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), abs=2e-3)


# DeviceLogits and TVMExecutor.sample ------------------------------------------


@pytest.fixture
def sequences(models):
    """Three sequences prefilled on both executors: (host, device, ids)."""
    host, device = models[0].executor, models[1].executor
    ids = [9001, 9002, 9003]
    prompts = [[1, 40, 41, 42], [50, 51], [60]]
    for ex in (host, device):
        for seq_id in ids:
            ex.add_sequence(seq_id)
    yield host, device, ids, prompts
    for ex in (host, device):
        for seq_id in ids:
            ex.remove_sequence(seq_id)


def test_device_logits_index_lazily_and_copy_on_request(sequences):
    host, device, ids, prompts = sequences
    want = host.prefill(ids, prompts)
    got = device.prefill(ids, prompts)
    assert isinstance(want, np.ndarray) and isinstance(got, DeviceLogits)
    assert len(got) == 3 and got.shape == want.shape == (3, host.vocab_size)
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.asarray(got, dtype=np.float64).dtype == np.float64

    picked = got[[2, 0, 0, 1]]  # forks repeat a row; order is the caller's
    assert picked.tensor is got.tensor  # nothing copied
    assert len(picked) == 4 and picked.shape == (4, host.vocab_size)
    np.testing.assert_array_equal(picked.index, [2, 0, 0, 1])
    np.testing.assert_array_equal(picked[[3, 1]].numpy(), want[[1, 0]])
    np.testing.assert_array_equal(picked[1:3].numpy(), want[[0, 0]])
    np.testing.assert_array_equal(got[np.array([1])].numpy(), want[[1]])
    np.testing.assert_array_equal(picked[0], want[2])  # one row: on the host
    np.testing.assert_array_equal(picked[-1], want[1])
    with pytest.raises(TypeError):
        got[0, 1]
    with pytest.raises(IndexError):
        got[[3]]

    sampler = device._sampler
    assert sampler.rows(got.tensor, got.index) is got.tensor  # every row, in order
    prefix = got[[0, 1]]
    np.testing.assert_array_equal(sampler.rows(prefix.tensor, prefix.index).numpy(), want[:2])
    np.testing.assert_array_equal(sampler.rows(picked.tensor, picked.index).numpy(), want[[2, 0, 0, 1]])
    with pytest.raises(IndexError):
        sampler.rows(got.tensor, np.array([0, 3]))

    # the next step's logits too
    tokens = [int(t) for t in want.argmax(axis=1)]
    np.testing.assert_array_equal(device.decode(ids, tokens).numpy(), host.decode(ids, tokens))


def test_executor_sample_on_device_logits_and_numpy(sequences):
    host, device, ids, prompts = sequences
    want = host.prefill(ids, prompts)
    got = device.prefill(ids, prompts)
    kinds = [
        {"temperature": 0.0},
        {"temperature": 1.0, "top_k": 7},
        {"top_p": 0.8, "logprobs": 4},
        {"temperature": 0.0, "logit_bias": {3: 4.0}, "repetition_penalty": 1.2},
        {"min_p": 0.05, "presence_penalty": 0.7, "frequency_penalty": 0.2},
    ]
    order = [2, 0, 0, 1, 2]
    for seed in range(6):
        params = [SamplingParams(seed=seed, **kind) for kind in kinds]
        allowed = np.zeros(host.vocab_size, dtype=bool)
        allowed[[4, 40, 77, 200]] = True

        def rows(params=params, allowed=allowed):
            return [
                SamplingRow(p, None if p.greedy else make_generator(p, i), prompts[r], [40, 41, 40],
                            allowed if i == 3 else None)
                for i, (p, r) in enumerate(zip(params, order))
            ]

        host_tokens, host_logprobs = sample_batch(want[order], rows())
        for logits in (got[order], want[order]):  # device logits, then plain numpy on the same executor
            tokens, logprobs = device.sample(logits, rows())
            np.testing.assert_array_equal(tokens, host_tokens)
            assert allowed[tokens[3]]
            for w, g in zip(host_logprobs, logprobs):
                assert (w is None) == (g is None)
                if w is not None:
                    assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-4)
                    assert [t for t, _ in g.top] == [t for t, _ in w.top]
    # the base class's sample is the host sampler
    tokens, _ = host.sample(want, [SamplingRow(SamplingParams(temperature=0.0), None)] * 3)
    np.testing.assert_array_equal(tokens, want.argmax(axis=1))
