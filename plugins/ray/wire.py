"""What crosses the wire between the front and an engine replica.

The front sends a `RemoteWork`; the replica answers with a stream of
messages: `Admitted` (or `Failed`, if the engine refused the work), then
lists of `Delta`s, then `Finished` (or `Failed`, if it failed mid-way).
Everything here pickles. A compiled grammar does not (it holds native
matcher state), so it travels as its source and the replica rebuilds it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from lockgate.engine import Work
from lockgate.plugin_api.grammars import rebuild_grammar

#: prompt tokens per affinity block (the KV page size of the built-in executor)
AFFINITY_BLOCK = 16
#: the longest prompt prefix the router looks at, in tokens
AFFINITY_SPAN = 512


@dataclasses.dataclass(frozen=True)
class RemoteWork:
    """A `Work` on its way to a replica."""

    #: the work, its grammar left out
    work: Work
    #: `Grammar.source` of the work's grammar, if it has one
    grammar_source: str | None
    #: chained hashes of the prompt's first whole blocks (`prefix_hashes`),
    #: read by the prefix-affinity router; empty when it is not used
    prefix_hashes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Admitted:
    """The replica's engine took the work."""

    replica: str
    #: the completion budget the engine settled on (`RequestHandle.max_tokens`)
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Finished:
    """The request ended normally."""

    #: prompt tokens whose KV came from the replica's prefix cache
    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class Failed:
    """The engine refused the work (before `Admitted`) or failed it."""

    error: BaseException


def to_wire(work: Work, *, prefix_affinity: bool) -> RemoteWork:
    grammar = work.params.grammar
    if grammar is not None:
        work = dataclasses.replace(work, params=dataclasses.replace(work.params, grammar=None))
    return RemoteWork(
        work=work,
        grammar_source=None if grammar is None else grammar.source,
        prefix_hashes=prefix_hashes(work.prompt_token_ids) if prefix_affinity else (),
    )


def from_wire(remote: RemoteWork, tokenizer, eos_token_ids: Sequence[int]) -> Work:
    if remote.grammar_source is None:
        return remote.work
    grammar = rebuild_grammar(remote.grammar_source, tokenizer, eos_token_ids=eos_token_ids)
    return dataclasses.replace(remote.work, params=dataclasses.replace(remote.work.params, grammar=grammar))


def prefix_hashes(tokens: Sequence[int]) -> tuple[int, ...]:
    """One hash per whole `AFFINITY_BLOCK` of the prompt's first
    `AFFINITY_SPAN` tokens, each covering every block before it too, so two
    prompts share the first k hashes exactly when they share the first k
    blocks. The last token is left out: a prompt equal to a block boundary
    still prefills one token of its own."""
    usable = min(len(tokens) - 1, AFFINITY_SPAN) // AFFINITY_BLOCK * AFFINITY_BLOCK
    data = np.asarray(tokens[:usable], dtype=np.int64).tobytes()
    hashes = []
    digest = hashlib.blake2b(digest_size=8)
    step = AFFINITY_BLOCK * 8
    for start in range(0, len(data), step):
        digest.update(data[start:start + step])
        hashes.append(int.from_bytes(digest.copy().digest(), "little"))
    return tuple(hashes)
