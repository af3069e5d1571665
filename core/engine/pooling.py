"""Pooled hidden states: what an embedding (or a classification head) reads
of a prompt instead of generating after it.

A request whose `Work.pooling` is set is prefilled through the executor's
`prefill_hidden` and never decoded: each chunk's final hidden states are
folded into its `Pooler`, and once the whole prompt is in, the pooled vector
goes to the request's handle as its one `Delta` (`Delta.embedding`) and the
request retires. `pooled_prefill` is that step of the engine loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lockgate.engine.handle import Delta

if TYPE_CHECKING:
    from lockgate.engine.delivery import Events
    from lockgate.engine.loop import Engine
    from lockgate.engine.state import Choice

#: the poolings, as llama.cpp names them: the mean of every token's hidden
#: state, the last token's, the first token's
MEAN, LAST, CLS = "mean", "last", "cls"
POOLINGS = (MEAN, LAST, CLS)


def file_pooling(metadata) -> str:
    """The pooling a GGUF file's `{arch}.pooling_type` names (llama.cpp's
    numbering: 1 mean, 2 cls, 3 last, 4 rank, which a decoder's rank head
    reads at the last token), mean where it names none."""
    if metadata is None:
        return MEAN
    field = metadata.fields.get(f"{metadata.fields['general.architecture'].contents()}.pooling_type")
    kind = None if field is None else int(field.contents())
    return {2: CLS, 3: LAST, 4: LAST}.get(kind, MEAN)


#: the finish reason of a pooled request's delta (nothing was generated)
POOLED = "stop"


class Pooler:
    """Folds a prompt's final hidden states, chunk by chunk, into one vector."""

    def __init__(self, pooling: str) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.pooling = pooling
        self._sum: np.ndarray | None = None
        self._rows = 0

    def reset(self) -> None:
        """Forget what was folded: the prompt is computed again (the request
        was preempted)."""
        self._sum, self._rows = None, 0

    @property
    def every_row(self) -> bool:
        """Whether a chunk's every row is read (mean, and the first
        chunk of cls); else only its last. A pooling that reads every row
        needs the whole prompt computed, so none of it may come from the
        prefix cache."""
        return self.pooling == MEAN or (self.pooling == CLS and self._rows == 0)

    def add(self, rows: np.ndarray) -> None:
        """Take the rows `prefill_hidden` returned for one chunk (every row
        when `every_row` was true for it, else the last)."""
        rows = np.asarray(rows, dtype=np.float64)
        if self.pooling == MEAN:
            total = rows.sum(axis=0)
            self._sum = total if self._sum is None else self._sum + total
        elif self.pooling == LAST:
            self._sum = rows[-1]
        elif self._sum is None:  # cls: the first chunk's first row
            self._sum = rows[0]
        self._rows += len(rows)

    def result(self) -> np.ndarray:
        """The pooled vector (float32)."""
        if self._sum is None:
            raise RuntimeError("no hidden states were pooled")
        pooled = self._sum / self._rows if self.pooling == MEAN else self._sum
        return pooled.astype(np.float32)


def pooled_prefill(engine: "Engine", chunks: list[tuple["Choice", list[int]]],
                   events: "Events") -> list[tuple["Choice", list[int]]]:
    """Prefill the chunks of pooled requests (`Work.pooling`) among
    `chunks`, fold their hidden states into each request's pooler, and
    answer and retire each request whose prompt is now all in; the other
    chunks are returned, for the logits' prefill."""
    rest = [chunk for chunk in chunks if chunk[0].request.pooler is None]
    if len(rest) < len(chunks):
        _prefill_pooled(engine, [chunk for chunk in chunks if chunk[0].request.pooler is not None], events)
    return rest


def _prefill_pooled(engine: "Engine", chunks: list[tuple["Choice", list[int]]], events: "Events") -> None:
    every = [choice.request.pooler.every_row for choice, _ in chunks]
    try:
        rows = engine.executor.prefill_hidden([c.seq_id for c, _ in chunks], [t for _, t in chunks], every)
    except Exception as exc:
        engine._executor_failed(exc, {c.request for c, _ in chunks}, events)
        return
    engine._consecutive_failures = 0
    first = 0
    for (choice, tokens), all_rows in zip(chunks, every):
        state = choice.request
        count = len(tokens) if all_rows else 1
        state.pooler.add(rows[first:first + count])
        first += count
        engine.scheduler.advance(choice, len(tokens))
        if not choice.pending_count():
            events.append((state.handle, Delta(0, "", [], POOLED, embedding=state.pooler.result())))
            engine._finish_choice(choice, events)
