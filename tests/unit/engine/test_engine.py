"""The engine on the tiny real model: batching, every sampling parameter, limits."""

from __future__ import annotations

import asyncio
import collections
import math

import numpy as np
import pytest

from helpers import sample_one, wait_idle
from lockgate.errors import ContextLengthExceeded, InvalidRequestError, Unavailable
from lockgate.engine.params import SamplingParams
from lockgate.engine.sampling import SamplingRow, process_logits, sample_batch
from lockgate.engine import Work

PROMPTS = [[5, 40, 41, 60], [100, 7, 8], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [200]]


@pytest.fixture(scope="module")
def model(load_tiny):
    return load_tiny()


@pytest.fixture
async def engine(model):
    model.engine.start(asyncio.get_running_loop())
    yield model.engine
    await asyncio.get_running_loop().run_in_executor(None, model.engine.shutdown)


async def run(engine, prompt, request_id="r", **params):
    """Generate; returns (text per choice, tokens per choice, finish_reason per choice)."""
    params.setdefault("ignore_eos", True)
    params.setdefault("max_tokens", 16)
    return await collect(engine.add(Work(request_id, list(prompt), SamplingParams(**params))))


async def collect(handle):
    """Read a request to its end, as `run` returns it."""
    texts = collections.defaultdict(str)
    tokens = collections.defaultdict(list)
    finish = {}
    async for delta in handle:
        texts[delta.index] += delta.text
        tokens[delta.index] += delta.token_ids
        if delta.finish_reason:
            finish[delta.index] = delta.finish_reason
    return dict(texts), dict(tokens), finish


async def test_batched_greedy_equals_single(engine):
    alone = [(await run(engine, p, temperature=0))[1][0] for p in PROMPTS]
    together = await asyncio.gather(*(run(engine, p, f"r{i}", temperature=0) for i, p in enumerate(PROMPTS)))
    assert [t[1][0] for t in together] == alone
    assert (await wait_idle(engine)).kv_pages_used == 0


async def test_n_choices_fork_the_prompt(engine):
    single = (await run(engine, PROMPTS[2], temperature=0))[1][0]
    _, tokens, finish = await run(engine, PROMPTS[2], temperature=0, n=3)
    assert tokens == {0: single, 1: single, 2: single}
    assert finish == {0: "length", 1: "length", 2: "length"}
    _, sampled, _ = await run(engine, PROMPTS[2], temperature=1.5, seed=3, n=3, max_tokens=24)
    assert len({tuple(t) for t in sampled.values()}) > 1
    assert (await wait_idle(engine)).kv_pages_used == 0


@pytest.mark.parametrize("prompt", [[200], [5, 40]], ids=["one-token", "two-tokens"])
async def test_every_choice_of_a_short_prompt_is_generated(engine, prompt):
    """A one-token prompt goes in as a decode row, not a prefill chunk; its
    request used to never fork, and choices 1.. of `n` never came (found
    by the fuzzer)."""
    single = (await run(engine, prompt, temperature=0, max_tokens=4))[1][0]
    _, tokens, finish = await run(engine, prompt, temperature=0, n=3, max_tokens=4)
    assert tokens == {0: single, 1: single, 2: single}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert (await wait_idle(engine)).kv_pages_used == 0


async def test_text_is_the_decoded_tokens(engine, model):
    texts, tokens, _ = await run(engine, PROMPTS[0], temperature=1.0, seed=11, max_tokens=40)
    assert texts[0] == model.tokenizer.decode(tokens[0], skip_special_tokens=True)


async def test_seed_reproducible_alone_and_batched(engine):
    first = (await run(engine, PROMPTS[1], temperature=1.0, seed=42, max_tokens=24))[1][0]
    again = (await run(engine, PROMPTS[1], temperature=1.0, seed=42, max_tokens=24))[1][0]
    batched = await asyncio.gather(
        run(engine, PROMPTS[1], "a", temperature=1.0, seed=42, max_tokens=24),
        run(engine, PROMPTS[0], "b", temperature=1.0, seed=1, max_tokens=24),
        run(engine, PROMPTS[3], "c", temperature=1.0, max_tokens=24),
    )
    other = (await run(engine, PROMPTS[1], temperature=1.0, seed=43, max_tokens=24))[1][0]
    assert first == again == batched[0][1][0]
    assert other != first


async def test_temperature_top_k_top_p_min_p(engine):
    greedy = (await run(engine, PROMPTS[0], temperature=0))[1][0]
    hot = (await run(engine, PROMPTS[0], temperature=2.0, seed=5))[1][0]
    assert hot != greedy
    assert (await run(engine, PROMPTS[0], temperature=2.0, top_k=1, seed=5))[1][0] == greedy
    assert (await run(engine, PROMPTS[0], temperature=2.0, top_p=1e-6, seed=5))[1][0] == greedy
    assert (await run(engine, PROMPTS[0], temperature=2.0, min_p=1.0, seed=5))[1][0] == greedy


async def test_logit_bias(engine):
    _, tokens, _ = await run(engine, PROMPTS[0], temperature=0, logit_bias={150: 100.0})
    assert set(tokens[0]) == {150}
    greedy = (await run(engine, PROMPTS[0], temperature=0))[1][0]
    _, banned, _ = await run(engine, PROMPTS[0], temperature=0, logit_bias={greedy[0]: -100.0})
    assert greedy[0] not in banned[0]


async def test_penalties_change_repetitive_output(engine):
    plain = (await run(engine, PROMPTS[3], temperature=0, max_tokens=48))[1][0]
    top_count = collections.Counter(plain).most_common(1)[0][1]
    for params in ({"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}):
        penalized = (await run(engine, PROMPTS[3], temperature=0, max_tokens=48, **params))[1][0]
        assert penalized != plain, params
        assert collections.Counter(penalized).most_common(1)[0][1] < top_count, params


async def test_stop_strings_and_tokens(engine):
    texts, tokens, _ = await run(engine, PROMPTS[0], temperature=0, max_tokens=32, logit_bias={60: 3.0})
    text = texts[0]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut, _, finish = await run(engine, PROMPTS[0], temperature=0, max_tokens=32, logit_bias={60: 3.0}, stop=(stop,))
    assert cut[0] == text[: text.index(stop)]
    assert finish[0] == "stop"
    stop_token = tokens[0][3]
    _, stopped, finish = await run(engine, PROMPTS[0], temperature=0, max_tokens=32, logit_bias={60: 3.0}, stop_token_ids=(stop_token,))
    assert stopped[0] == tokens[0][: tokens[0].index(stop_token) + 1]
    assert finish[0] == "stop"


async def test_eos_and_ignore_eos(engine, model):
    eos = model.eos_token_ids[0]
    texts, tokens, finish = await run(engine, PROMPTS[0], ignore_eos=False, logit_bias={eos: 100.0})
    assert tokens[0] == [eos] and texts[0] == "" and finish[0] == "stop"
    _, tokens, finish = await run(engine, PROMPTS[0], ignore_eos=True, logit_bias={eos: 100.0}, max_tokens=5)
    assert tokens[0] == [eos] * 5 and finish[0] == "length"


async def test_admission_errors(engine, model):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add(Work("e", [], SamplingParams()))
    with pytest.raises(ContextLengthExceeded):
        engine.add(Work("e", [5] * model.context_length, SamplingParams()))
    with pytest.raises(ContextLengthExceeded):
        engine.add(Work("e", [5], SamplingParams(max_tokens=model.context_length)))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add(Work("e", [model.vocab_size], SamplingParams()))
    with pytest.raises(InvalidRequestError) as caught:
        engine.add(Work("e", [5], SamplingParams(n=64)))
    assert caught.value.subject == "n"  # the request field is the pipeline's to name
    assert engine.stats().requests_waiting == 0


async def test_abort_frees_pages(engine):
    handle = engine.add(Work("x", PROMPTS[2], SamplingParams(max_tokens=400, ignore_eos=True)))
    await handle.__anext__()
    assert engine.stats().kv_pages_used > 0
    handle.abort()
    stats = await wait_idle(engine)
    assert stats.kv_pages_used == 0 and stats.requests_running == 0


def test_sampling_filters_on_a_known_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    rng = np.random.default_rng(0)

    def seen(**params):
        p = SamplingParams(temperature=1.0, **params)
        return {sample_one(logits, p, rng) for _ in range(400)}

    assert seen() == {0, 1, 2, 3}
    assert seen(top_k=2) == {0, 1}
    assert seen(top_p=0.7) == {0, 1}
    assert seen(min_p=0.5) == {0, 1}
    assert seen(top_p=0.5) == {0}
    assert sample_one(logits, SamplingParams(temperature=0), rng) == 0


@pytest.mark.parametrize("temperature", [2.2250738585072014e-308, 1e-40, 9e-6])
def test_a_temperature_too_small_for_float32_samples_greedily(temperature):
    """Dividing logits by a temperature that float32 rounds to zero made
    them NaN, and a grammar-masked row then drew a forbidden token."""
    logits = np.array([0.1, 2.0, 1.0, -np.inf], dtype=np.float32)
    allowed = np.array([True, False, True, True])
    rows = [SamplingRow(SamplingParams(temperature=temperature), np.random.default_rng(0), [], [], allowed)]
    for _ in range(20):
        tokens, _ = sample_batch(logits[None, :], rows)
        assert int(tokens[0]) == 2


def test_penalty_arithmetic():
    def logits():
        return np.array([1.0, 2.0, -1.0, 0.5], dtype=np.float32)

    out = process_logits(logits(), SamplingParams(presence_penalty=0.5), [3], [1, 1, 2])
    np.testing.assert_allclose(out, [1.0, 1.5, -1.5, 0.5])
    out = process_logits(logits(), SamplingParams(frequency_penalty=0.5), [3], [1, 1, 2])
    np.testing.assert_allclose(out, [1.0, 1.0, -1.5, 0.5])
    out = process_logits(logits(), SamplingParams(repetition_penalty=2.0), [3], [1, 2])
    np.testing.assert_allclose(out, [1.0, 1.0, -2.0, 0.25])
    out = process_logits(logits(), SamplingParams(logit_bias={0: -100.0, 2: 5.0}), [], [])
    np.testing.assert_allclose(out, [-99.0, 2.0, 4.0, 0.5])


async def test_shutdown_drains_then_fails_leftovers(load_instrumented):
    model = load_instrumented()
    # Each decode takes at least 20 ms, so the long request (~500 decodes)
    # cannot finish within the grace period, which gives the short one
    # (3 decodes) a generous deadline: no outcome hangs on the machine's speed.
    model.executor.decode_seconds = 0.02
    grace = 3.0
    assert (model.context_length - len(PROMPTS[1])) * model.executor.decode_seconds > 3 * grace
    loop = asyncio.get_running_loop()
    engine = model.engine
    engine.start(loop)
    short = engine.add(Work("short", PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True)))
    # until the context is full
    endless = engine.add(Work("long", PROMPTS[1], SamplingParams(ignore_eos=True)))
    await short.__anext__()
    await endless.__anext__()
    stopping = loop.run_in_executor(None, engine.shutdown, grace)
    finished = [d.finish_reason async for d in short]
    assert finished[-1] == "length"  # finished within the grace period
    with pytest.raises(Unavailable):
        async for _ in endless:
            pass
    await stopping
    assert endless.usage.completion_tokens < model.context_length - len(PROMPTS[1])
    assert engine.stats().kv_pages_used == 0
    with pytest.raises(Unavailable):
        engine.add(Work("late", PROMPTS[0], SamplingParams(max_tokens=2)))
    model.executor.decode_seconds = 0.0
    engine.start(loop)  # an app restarted around the same model serves again
    try:
        assert (await run(engine, PROMPTS[0], max_tokens=3))[2] == {0: "length"}
    finally:
        await loop.run_in_executor(None, engine.shutdown)


async def test_preemption_by_recompute_leaves_output_unchanged(load_tiny):
    """A KV cache too small for all requests at once: the newest are
    preempted and recomputed, and every output equals its run alone."""
    model = load_tiny(executor_options={"max_total_tokens": 320, "max_num_seqs": 4})
    engine = model.engine
    loop = asyncio.get_running_loop()
    engine.start(loop)
    try:
        prompts = [[5 + i, 40, 41, 60, 7 + i] for i in range(4)]
        alone = [(await run(engine, p, temperature=0, max_tokens=100))[1][0] for p in prompts]
        seeded_alone = (await run(engine, prompts[0], temperature=1.0, seed=9, max_tokens=100))[1][0]
        assert engine.preemptions == 0
        together = await asyncio.gather(
            *(run(engine, p, f"g{i}", temperature=0, max_tokens=100) for i, p in enumerate(prompts)),
            run(engine, prompts[0], "s", temperature=1.0, seed=9, max_tokens=100),
        )
        assert engine.preemptions > 0
        assert [t[1][0] for t in together[:4]] == alone
        assert together[4][1][0] == seeded_alone
        assert (await wait_idle(engine)).kv_pages_used == 0
    finally:
        await loop.run_in_executor(None, engine.shutdown)


async def test_step_token_budget_chunks_long_prompts(load_instrumented):
    """No engine step carries more than `max_num_batched_tokens` tokens: a
    prompt longer than that is prefilled in chunks over several steps, each
    beside the decode of a running request; greedy output is unaffected."""
    budget = 32
    # without the prefix cache: the second run of the prompt must be prefilled again
    model = load_instrumented(max_num_batched_tokens=budget, prefix_cache=False)
    engine, executor = model.engine, model.executor
    long_prompt = [5 + (i % 200) for i in range(200)]
    # the budget, not the executor's own limit, is what splits the prompt
    assert budget < len(long_prompt) <= executor.prefill_chunk_size
    loop = asyncio.get_running_loop()
    engine.start(loop)
    try:
        alone = (await run(engine, long_prompt, temperature=0, max_tokens=10))[1][0]
        steps_alone = len(executor.steps)
        executor.decodes_allowed.clear()
        decoding = engine.add(Work("d", PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)))
        first = await decoding.__anext__()  # its prompt is in; its first decode waits
        chunked = engine.add(Work("c", long_prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
        executor.decodes_allowed.set()
        assert (await collect(chunked))[1][0] == alone
        assert len(first.token_ids + (await collect(decoding))[1][0]) == 60
    finally:
        await loop.run_in_executor(None, engine.shutdown)

    assert executor.steps and not executor.outside_steps
    for step in executor.steps:
        assert sum(n for _, rows in step for n in rows.values()) <= budget, step
    prefilled = collections.Counter()
    for step in executor.steps[steps_alone:]:
        for kind, rows in step:
            if kind == "prefill":
                prefilled.update(rows)
    (long_seq,) = [seq for seq, n in prefilled.items() if n == len(long_prompt)]
    (decoding_seq,) = [seq for seq, n in prefilled.items() if n == len(PROMPTS[0])]
    chunk_steps = [
        step for step in executor.steps[steps_alone:]
        if any(kind == "prefill" and long_seq in rows for kind, rows in step)
    ]
    assert len(chunk_steps) >= math.ceil(len(long_prompt) / budget)
    for i, step in enumerate(chunk_steps):
        # the running request decodes in every step that prefills a chunk...
        assert ("decode", {decoding_seq: 1}) in step, step
        # ...and the chunk fills the rest of the budget, until the prompt's end
        if i < len(chunk_steps) - 1:
            assert sum(n for _, rows in step for n in rows.values()) == budget, step
