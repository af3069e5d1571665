"""The speculative decode step: a batch's last tokens and their drafts in
one executor call, then each position sampled as a decode step would.

`speculative_step` runs a step's decode rows where speculation is on:
through `verify_step` where the policy chose drafts, else as a plain
decode step, timed, and its tokens checked against what was proposed
(`SpeculationPolicy.decoded`).

`verify_step` gives each decode row its pending token followed by its
drafts (none for a row without any) as one prefill chunk, which returns the
logits after every token of a chunk with drafts and after the last of one
without. Sampling then goes position by position over the rows still
going: each choice's token is drawn from the logits after the tokens before
it, with its own random stream, penalties over what it has generated and
its grammar's mask after the tokens accepted so far (`Engine._sample`,
unchanged). A draft the sampler drew is accepted, and the next position is
sampled from the logits its own row gives; the first token drawn otherwise
is the choice's last of the step, as is a token that ends the choice (a
stop, `max_tokens`) and the one drawn after the last draft. Then the
scheduler truncates every sequence to the tokens it accepted (`settle`, as
it does before a choice it finishes goes to the prefix cache).

What the client receives is what a decode step after each token would have
produced: each position's logits are those of its tokens, and the random
stream draws once per token emitted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lockgate.engine.loop import Engine, Events
    from lockgate.engine.scheduler import Batch
    from lockgate.engine.state import Choice


def speculative_step(engine: "Engine", batch: "Batch", events: "Events") -> None:
    """The decode rows of `batch`, verifying its drafts if it has any."""
    if batch.drafts:
        verify_step(engine, batch.decode, batch.drafts, events)
        return
    started, lengths = time.perf_counter(), [len(c.output_ids) for c in batch.decode]
    engine._run_decode(batch.decode, events)
    engine.scheduler.speculation.decoded(batch.decode, lengths, batch.proposed, time.perf_counter() - started)


def verify_step(engine: "Engine", choices: list["Choice"], drafts: list[tuple[list[int], str | None]],
                events: "Events") -> None:
    """One decode step of `choices` with `drafts` (one entry per choice)."""
    scheduler = engine.scheduler
    started = time.perf_counter()
    chunks = [[choice.next_pending(), *tokens] for choice, (tokens, _) in zip(choices, drafts)]
    every = [bool(tokens) for tokens, _ in drafts]
    try:
        logits = engine.executor.prefill([c.seq_id for c in choices], chunks, every)
    except Exception as exc:
        engine._executor_failed(exc, {c.request for c in choices}, events)
        return
    engine._consecutive_failures = 0
    first_rows, row = [], 0
    for choice, (tokens, _) in zip(choices, drafts):
        first_rows.append(row)
        row += len(tokens) + 1 if tokens else 1
        scheduler.advance(choice, 1)
        if tokens:
            scheduler.hold_drafts(choice, len(tokens))
    # a one-token prompt goes in as a decode row (it drafts nothing): it may be the one to fork
    ready, rows = engine._forked_when_prompt_is_in(list(zip(first_rows, choices)), events)
    if not ready:
        _settle(engine, choices)
        return
    drafted = {id(c): (tokens, name, first_row) for c, (tokens, name), first_row in zip(choices, drafts, first_rows)}
    accepted = {id(c): 0 for c in choices}
    engine._sample(ready, logits[rows], events)
    # (a choice forked just now is ready too, with no drafts)
    going = [c for c in ready if drafted.get(id(c), ((), None, 0))[0]]
    position = 0
    while going:
        following = []
        for choice in going:
            tokens, _, _ = drafted[id(choice)]
            if choice.finished or choice.request.done or choice.output_ids[-1] != tokens[position]:
                continue
            # the draft drawn is in the KV cache already: the next row follows it
            choice.kv_len += 1
            accepted[id(choice)] += 1
            following.append(choice)
        position += 1
        if following:
            engine._sample(following, logits[[drafted[id(c)][2] + position for c in following]], events)
        going = [c for c in following if position < len(drafted[id(c)][0])]
    for choice in choices:
        tokens, name, _ = drafted[id(choice)]
        if tokens:
            choice.request.drafts.note(name, len(tokens), accepted[id(choice)])
            engine.observer.speculated(name, len(tokens), accepted[id(choice)])
    _settle(engine, choices)
    scheduler.speculation.verified(sum(map(len, chunks)), time.perf_counter() - started)


def _settle(engine: "Engine", choices: list["Choice"]) -> None:
    for choice in choices:
        if not choice.finished:
            engine.scheduler.settle(choice)
