"""Speculative decoding (`lockgate.engine.speculation`, `verification`):
the drafters propose what they should, and the engine's output is the same
with speculation on and off, token for token and logprob for logprob,
whatever the drafts (good ones, a plugin's wrong ones), with stops,
lengths, grammars, penalties, seeds and `n` inside a run; every page comes
back."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from helpers import wait_idle
from lockgate import hookimpl
from lockgate.engine import Work
from lockgate.engine.handle import EngineObserver
from lockgate.engine.params import SamplingParams
from lockgate.engine.speculation import (
    DraftContext, DraftRecord, Drafter, NgramMemory, PredictionDrafter, PromptLookup, SpeculationPolicy, StepCosts,
)
from lockgate.plugin_api.grammars import compile_json_schema
from lockgate.plugin_api.manager import get_plugin_manager


# ------------------------------------------------------------ drafters


def test_prompt_lookup_proposes_what_followed_the_longest_recent_ngram():
    lookup = PromptLookup()
    prompt = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4, 7]
    # the sequence ends "2 3 4": it occurred twice before, the last time followed by 7, 2, 3
    assert lookup.propose(DraftContext(prompt, [2, 3, 4]), 3) == [7, 2, 3]
    assert lookup.propose(DraftContext(prompt[:7], [2, 3]), 3) == [4, 5, 6]
    assert lookup.propose(DraftContext([1, 2, 3], [8, 9]), 3) == []


def test_ngram_memory_draws_on_earlier_sequences_and_forgets_the_oldest():
    memory = NgramMemory(capacity=12)
    memory.learn([10, 11, 12, 13, 14, 15])
    assert memory.propose(DraftContext([5, 11, 12], []), 2) == [13, 14]
    memory.learn([20, 21, 22, 23, 24, 25, 26, 27])
    # no match across the two sequences' seam
    assert memory.propose(DraftContext([15, 20], []), 2) == []
    memory.learn([30, 31, 32, 33])
    assert memory.propose(DraftContext([11, 12], []), 2) == []  # the first went
    assert memory.propose(DraftContext([21, 22], []), 2) == [23, 24]


def test_the_prediction_is_drafted_from_where_the_output_stands():
    drafter = PredictionDrafter()
    prediction = [50, 51, 52, 53, 54, 55]
    assert drafter.propose(DraftContext([1], [], prediction), 3) == [50, 51, 52]
    assert drafter.propose(DraftContext([1], [50], prediction), 3) == [51, 52, 53]
    assert drafter.propose(DraftContext([1], [9, 52, 53], prediction), 2) == [54, 55]
    assert drafter.propose(DraftContext([1], [49], prediction), 2) == []


def test_a_grammar_drafts_what_it_forces(tiny_model):
    tokenizer = tiny_model.tokenizer
    grammar = compile_json_schema({"type": "object", "properties": {"name": {"type": "string"}},
                                   "required": ["name"]}, tokenizer, eos_token_ids=tiny_model.eos_token_ids)
    forced = grammar.matcher().forced_tokens()
    assert tokenizer.decode(forced).startswith('{"name": "')


class Always(Drafter):
    name = "always"

    def propose(self, context, k):
        return [1] * k


def measured(decode_ms: float, verify_ms: dict[int, float]) -> SpeculationPolicy:
    policy = SpeculationPolicy([Always()], max_tokens=0, max_batch=2)
    policy.costs.observe(policy.costs.decode, 1, decode_ms / 1e3)
    for rows, ms in verify_ms.items():
        policy.costs.observe(policy.costs.verify, rows, ms / 1e3)
    return policy


def test_k_is_what_makes_the_most_tokens_a_second():
    # as measured on the default model on a CPU: a verification of 1 + k rows
    policy = measured(5.8, {2: 7.8, 3: 9.2, 4: 8.8, 5: 10.2, 6: 11.0, 7: 11.9, 8: 14.0, 9: 16.5})
    drafts = [([7] * 8, "always")]
    assert policy.worthwhile(2) and not policy.worthwhile(3)
    # at 95%, 7 rows give 6.03 tokens in 11.9 ms; 9 give 7.40 in 16.5
    assert policy.choose(drafts, [0.95]) == 6
    # at 60%, 1 + k rows pay up to k = 3 (2.18 tokens in 8.8 ms) and no further
    assert policy.choose(drafts, [0.6]) == 3
    # 1.2 tokens in 7.8 ms is slower than 1 in 5.8
    assert policy.choose(drafts, [0.2]) == 0
    # a verification as dear as 4 decode steps pays only for sure drafts
    dear = measured(5.8, {rows: 23.2 for rows in range(2, 10)})
    assert dear.choose(drafts, [0.6]) == 0 and dear.choose(drafts, [0.99]) == 8
    # no drafts, no verification; a fixed k takes what was proposed
    assert policy.choose([([], None)], [0.99]) == 0
    fixed = SpeculationPolicy([Always()], max_tokens=3)
    assert fixed.choose([([7, 7], "always")], [0.0]) == 2 and fixed.most == 3


def test_an_unmeasured_verification_is_tried():
    policy = SpeculationPolicy([Always()])
    policy.costs.observe(policy.costs.decode, 1, 0.01)
    assert policy.choose([([7] * 4, "always")], [0.5]) > 0
    policy.verified(5, 0.05)  # then found dear
    assert policy.choose([([7] * 4, "always")], [0.5]) < 4
    # and tried again once its price is old: that time may have been a one-off
    for _ in range(StepCosts.STALE_AFTER):
        policy.costs.observe(policy.costs.decode, 1, 0.01)
    assert policy.choose([([7] * 4, "always")], [0.9]) == 4
    policy.verified(5, 0.012)
    assert policy.costs.verify[5] == 0.012


def test_acceptance_follows_the_drafts_verified_and_the_decode_steps():
    record = DraftRecord()
    record.note("prediction", 4, 4)
    high = record.acceptance
    assert high > 0.5 and (record.prediction_accepted, record.prediction_rejected) == (4, 0)
    for _ in range(10):
        record.note("prompt_lookup", 4, 0)
    assert record.acceptance < 0.2 and record.drafted == 44 and record.accepted == 4
    for _ in range(20):  # a decode step drew the first draft each time
        record.observe(1, 1)
    assert record.acceptance > 0.9


# ------------------------------------------------------------ the engine


class Counts(EngineObserver):
    def __init__(self):
        self.drafted = collections.Counter()
        self.accepted = collections.Counter()

    def speculated(self, drafter, drafted, accepted):
        self.drafted[drafter] += drafted
        self.accepted[drafter] += accepted


class WrongDrafts:
    """Plugin: a drafter that proposes tokens the model rarely writes, so
    nearly every draft is rejected (and truncated)."""

    class Wrong(Drafter):
        name = "wrong"

        def propose(self, context, k):
            last = (context.output_ids or context.prompt_ids)[-1]
            return [(last * 7 + i) % 250 + 3 for i in range(k)]

    @hookimpl(tryfirst=True)
    def lockgate_register_drafters(self, register):
        register(self.Wrong)


@pytest.fixture(scope="module")
def engines(load_tiny):
    """The tiny model's engine with speculation off, on (4 drafts a step),
    on with a plugin's wrong drafter first, and on with k measured; each
    reporting what it drafted."""
    made = {
        "off": load_tiny(speculation=False),
        "on": load_tiny(speculation=True, speculative_tokens=4),
        "wrong": load_tiny(pm=get_plugin_manager(autoload=False, plugins=[WrongDrafts()]), speculation=True,
                           speculative_tokens=4),
        "measured": load_tiny(speculation=True),
    }
    for model in made.values():
        model.engine.observer = Counts()
    return made


@pytest.fixture
async def running(engines):
    loop = asyncio.get_running_loop()
    for model in engines.values():
        model.engine.start(loop)
    yield {name: model.engine for name, model in engines.items()}
    for model in engines.values():
        await loop.run_in_executor(None, model.engine.shutdown)


async def generate(engine, prompt, **params):
    params.setdefault("max_tokens", 40)
    params.setdefault("ignore_eos", True)
    handle = engine.add(Work("r", list(prompt), SamplingParams(**params)))
    tokens, logprobs, finish = collections.defaultdict(list), collections.defaultdict(list), {}
    async for delta in handle:
        tokens[delta.index] += delta.token_ids
        for entry in delta.logprobs or ():
            logprobs[delta.index].append((entry.token_id, entry.logprob, tuple(entry.top)))
        if delta.finish_reason:
            finish[delta.index] = delta.finish_reason
    return dict(tokens), dict(logprobs), finish, handle.usage


#: a prompt that repeats itself, so prompt lookup drafts from the start
PROMPT = [5, 40, 41, 60, 61, 62, 5, 40, 41, 60, 61, 62, 5, 40, 41]

CASES = {
    "greedy": {"temperature": 0},
    "greedy, logprobs": {"temperature": 0, "logprobs": 3},
    "seeded, hot": {"temperature": 1.3, "seed": 7},
    "seeded, top-p and top-k": {"temperature": 1.0, "top_p": 0.8, "top_k": 20, "seed": 1},
    "penalties": {"temperature": 0, "frequency_penalty": 0.7, "presence_penalty": 0.3, "repetition_penalty": 1.2},
    "n=2, seeded": {"temperature": 1.0, "seed": 2, "n": 2},
    "max_tokens inside a run": {"temperature": 0, "max_tokens": 7},
    "stop token inside a run": {"temperature": 0, "stop_token_ids": (62,), "max_tokens": 60},
    "min_tokens": {"temperature": 0, "min_tokens": 9, "ignore_eos": False},
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_speculation_changes_nothing(running, case):
    params = CASES[case]
    off = await generate(running["off"], PROMPT, **params)
    for name in ("on", "wrong", "measured"):
        on = await generate(running[name], PROMPT, **params)
        assert on[:3] == off[:3], name
        assert (await wait_idle(running[name])).kv_pages_used == 0


async def test_drafts_are_verified_and_accepted(running, engines):
    await generate(running["on"], PROMPT, temperature=0, max_tokens=60)
    counts = engines["on"].engine.observer
    assert counts.drafted["prompt_lookup"] > 0
    assert counts.accepted["prompt_lookup"] > 0
    wrong = engines["wrong"].engine.observer
    await generate(running["wrong"], PROMPT, temperature=0, max_tokens=60)
    assert wrong.drafted["wrong"] > wrong.accepted["wrong"]


async def test_k_is_measured_on_the_executor(running, engines):
    """With k chosen by measurement, the tiny model's decode steps and
    verifications are timed, and a prompt that repeats itself is drafted."""
    await generate(running["measured"], PROMPT, temperature=0, max_tokens=80)
    costs = engines["measured"].engine.scheduler.speculation.costs
    assert costs.decode.get(1, 0) > 0 and costs.verify
    assert engines["measured"].engine.observer.accepted["prompt_lookup"] > 0


async def test_a_stop_string_inside_a_run(running, engines):
    off = await generate(running["off"], PROMPT, temperature=0, max_tokens=60)
    text = engines["off"].tokenizer.decode(off[0][0][10:14])
    for name in ("off", "on", "wrong"):
        handle = running[name].add(Work("r", PROMPT, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                                                    stop=(text,))))
        out = [d async for d in handle]
        assert out[-1].finish_reason == "stop"
        if name == "off":
            want = [t for d in out for t in d.token_ids]
        assert [t for d in out for t in d.token_ids] == want, name


async def test_a_prediction_is_drafted_and_counted(running):
    plain = await generate(running["off"], PROMPT, temperature=0, max_tokens=20)
    written = plain[0][0]
    predicted = (*written[:12], 1, 2, 3)
    off = await generate(running["off"], PROMPT, temperature=0, max_tokens=20, prediction=predicted)
    on = await generate(running["on"], PROMPT, temperature=0, max_tokens=20, prediction=predicted)
    assert on[:3] == off[:3] == plain[:3]
    # the first token comes from the prompt's prefill; of the other 11 predicted right, drafts in runs
    assert on[3].accepted_prediction_tokens >= 8 and on[3].rejected_prediction_tokens >= 1
    assert off[3].accepted_prediction_tokens == 0


async def test_an_abort_mid_run_frees_everything(running):
    engine = running["wrong"]
    handle = engine.add(Work("r", PROMPT, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)))
    async for delta in handle:
        if len(delta.token_ids) and delta.index == 0:
            break
    handle.abort()
    stats = await wait_idle(engine)
    assert (stats.requests_running, stats.kv_pages_used) == (0, 0)


def test_only_an_executor_that_truncates_speculates():
    from fake_executor import FakeExecutor
    from lockgate.engine.executor import Executor

    class Bare(Executor):
        add_sequence = remove_sequence = fork_sequence = prefill = decode = free_pages = lambda *a: None

    assert FakeExecutor().can_truncate and not Bare().can_truncate
