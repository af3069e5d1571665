"""Pooled requests (`Work.pooling`: embeddings, rerank) in the engine loop,
on the fake executor (tests/support/fake_executor.py), whose hidden state
after a token is a hash of the whole sequence so far: a chunk lost,
repeated or reordered, or a prefix read from the cache where it must be
computed, changes the pooled vector."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from fake_executor import FakeExecutor
from lockgate.engine import Engine, EngineOptions, Work
from lockgate.engine.params import SamplingParams
from lockgate.engine.pooling import Pooler
from lockgate.errors import ContextLengthExceeded, InvalidRequestError, TooManyChoices
from lockgate.models.tokenizer import load_tokenizer

NOTHING = SamplingParams(max_tokens=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_gguf):
    return load_tokenizer(gguf.GGUFReader(tiny_gguf))


def engine_on(executor, tokenizer, **options) -> Engine:
    engine = Engine(executor, tokenizer, eos_token_ids=[tokenizer.eos_token_id],
                    context_length=executor.max_sequence_length, options=EngineOptions(**options))
    # no event loop: what a step delivers goes straight to the handles
    engine._outbox.deliver = lambda events: [handle.put(item) for handle, item in events]
    return engine


def run(engine: Engine, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not engine.scheduler.has_work:
            return
        engine.step()
    raise AssertionError("the engine made no progress")


def expected(executor: FakeExecutor, prompt: list[int], pooling: str) -> np.ndarray:
    rows = np.stack([executor.hidden_after(prompt[: i + 1]) for i in range(len(prompt))])
    return {"mean": rows.mean(0), "last": rows[-1], "cls": rows[0]}[pooling]


def embedding_of(handle) -> np.ndarray:
    [delta] = [item for item in handle._items if hasattr(item, "embedding")]
    assert delta.token_ids == [] and delta.finish_reason == "stop"
    return delta.embedding


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_pooled_prompts_chunked_and_batched_pool_every_position(tokenizer, pooling, prefix_cache):
    """Prompts longer than a chunk, a one-token prompt (never a decode row),
    prompts sharing a prefix (read from the cache only for `last`), and a
    generating request beside them, which generates what it would alone."""
    executor = FakeExecutor(total_pages=64, page_size=4, prefill_chunk_size=8)
    engine = engine_on(executor, tokenizer, prefix_cache=prefix_cache)
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    prompts = [list(range(20, 45)), [7], shared + [50, 51], shared + [60], shared + [70, 71, 72]]
    handles = [engine.add(Work(str(i), p, NOTHING, pooling=pooling)) for i, p in enumerate(prompts[:3])]
    run(engine)
    handles += [engine.add(Work(str(i + 3), p, NOTHING, pooling=pooling)) for i, p in enumerate(prompts[3:])]
    chat = engine.add(Work("chat", [3, 4, 5], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)))
    run(engine)
    for handle, prompt in zip(handles, prompts):
        np.testing.assert_allclose(embedding_of(handle), expected(executor, prompt, pooling), rtol=1e-6)
        assert handle.usage.completion_tokens == 0
    generated = [t for item in chat._items if hasattr(item, "token_ids") for t in item.token_ids]
    assert len(generated) == 5
    cached = sum(h.usage.cached_tokens for h in handles[3:])
    assert (cached > 0) == (prefix_cache and pooling == "last")


def test_a_preempted_pooled_prompt_starts_its_pooling_again(tokenizer):
    """Two generating requests grow while a long pooled prompt prefills a
    little each step: pages run out, the pooled request (the newest) is
    preempted, recomputed from the start, and pools exactly what it would
    alone."""
    executor = FakeExecutor(total_pages=12, page_size=4, prefill_chunk_size=4, max_num_seqs=3)
    engine = engine_on(executor, tokenizer, prefix_cache=False)
    generating = [engine.add(Work(f"g{i}", [3 + i] * 4, SamplingParams(max_tokens=20, ignore_eos=True,
                                                                         temperature=0)))
                  for i in range(2)]
    engine.step()
    prompt = [3 + (7 * j) % 200 for j in range(20)]
    pooled = engine.add(Work("p", prompt, NOTHING, pooling="mean"))
    run(engine)
    assert engine.preemptions > 0 and pooled.work.pooling == "mean"
    np.testing.assert_allclose(embedding_of(pooled), expected(executor, prompt, "mean"), rtol=1e-6)
    for handle in generating:
        assert sum(len(item.token_ids) for item in handle._items if hasattr(item, "token_ids")) == 20
    assert executor.free_pages() == executor.total_pages


def test_what_a_pooled_request_is_refused(tokenizer):
    executor = FakeExecutor(total_pages=64, page_size=4, max_sequence_length=32)
    engine = engine_on(executor, tokenizer)
    with pytest.raises(InvalidRequestError, match="pooling must be one of"):
        engine.add(Work("a", [5], NOTHING, pooling="max"))
    with pytest.raises(TooManyChoices):
        engine.add(Work("b", [5], SamplingParams(max_tokens=0, n=2), pooling="mean"))
    with pytest.raises(ContextLengthExceeded, match="your input is 33 tokens"):
        engine.add(Work("c", [5] * 33, NOTHING, pooling="mean"))
    # the whole context is allowed: nothing is generated after it
    handle = engine.add(Work("d", [5] * 32, NOTHING, pooling="last"))
    run(engine)
    assert embedding_of(handle).shape == (FakeExecutor.HIDDEN,)


def test_an_executor_without_hidden_states_refuses_pooling(tokenizer):
    class NoHidden(FakeExecutor):
        prefill_hidden = FakeExecutor.__mro__[1].prefill_hidden  # the interface's: not implemented

    engine = engine_on(NoHidden(), tokenizer)
    assert not engine.executor.can_embed
    with pytest.raises(InvalidRequestError, match="cannot return hidden states") as caught:
        engine.add(Work("a", [5], NOTHING, pooling="mean"))
    assert caught.value.subject == "model"


def test_the_pooler_folds_chunks_and_forgets_on_reset():
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)
    for pooling, want in (("mean", rows.mean(0)), ("last", rows[-1]), ("cls", rows[0])):
        pooler = Pooler(pooling)
        assert pooler.every_row == (pooling != "last")
        pooler.add(rows[:3] if pooler.every_row else rows[2:3])
        pooler.add(rows[3:] if pooler.every_row else rows[5:])
        np.testing.assert_allclose(pooler.result(), want)
        pooler.reset()
        assert pooler.every_row == (pooling != "last")
        with pytest.raises(RuntimeError):
            pooler.result()
