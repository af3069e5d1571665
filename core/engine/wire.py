"""What crosses between a front and an engine in another process (a Ray
Serve replica, a model's child process).

The front sends a `RemoteWork`; the engine's side answers with a stream of
messages: `Admitted` (or `Failed`, if the engine refused the work), then
lists of `Delta`s, then `Finished` (or `Failed`, if it failed mid-way).
Everything here pickles. A compiled grammar does not (it holds native
matcher state), so it travels as its source and the other side rebuilds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lockgate.engine.handle import Usage
from lockgate.engine.structured import Grammar
from lockgate.engine.work import Work

#: seconds a front waits for an engine elsewhere to admit or refuse a work
ADMISSION_TIMEOUT = 120.0


@dataclasses.dataclass(frozen=True)
class RemoteWork:
    """A `Work` on its way to an engine elsewhere."""

    #: the work, its grammar left out
    work: Work
    #: `Grammar.source` of the work's grammar, if it has one
    grammar_source: str | None
    #: what a router places the work by (the Ray plugin's prompt-prefix
    #: hashes); empty where nothing routes
    prefix_hashes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Admitted:
    """The engine took the work."""

    #: where it runs (a replica's id), or None
    replica: str | None
    #: the completion budget the engine settled on (`RequestHandle.max_tokens`)
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Finished:
    """The request ended normally."""

    #: prompt tokens whose KV came from the engine's prefix cache
    cached_tokens: int
    #: a predicted output's tokens the output took and those it did not (None without one)
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @classmethod
    def of(cls, usage: Usage) -> "Finished":
        return cls(usage.cached_tokens, usage.accepted_prediction_tokens, usage.rejected_prediction_tokens)

    def complete(self, usage: Usage) -> None:
        """Fill in what the engine's side alone counted (completion tokens
        are counted from the deltas as they arrive)."""
        usage.cached_tokens = self.cached_tokens
        usage.accepted_prediction_tokens = self.accepted_prediction_tokens
        usage.rejected_prediction_tokens = self.rejected_prediction_tokens


@dataclasses.dataclass(frozen=True)
class Failed:
    """The engine refused the work (before `Admitted`) or failed it."""

    error: BaseException


def to_wire(work: Work, prefix_hashes: tuple[int, ...] = ()) -> RemoteWork:
    grammar = work.params.grammar
    if grammar is not None:
        work = dataclasses.replace(work, params=dataclasses.replace(work.params, grammar=None))
    return RemoteWork(work=work, grammar_source=None if grammar is None else grammar.source,
                      prefix_hashes=prefix_hashes)


def from_wire(remote: RemoteWork, rebuild_grammar: Callable[[str], Grammar]) -> Work:
    """The `Work` sent, its grammar rebuilt from its source by
    `rebuild_grammar` (`lockgate.plugin_api.grammars.rebuild_grammar` for
    the engine's model)."""
    if remote.grammar_source is None:
        return remote.work
    grammar = rebuild_grammar(remote.grammar_source)
    return dataclasses.replace(remote.work, params=dataclasses.replace(remote.work.params, grammar=grammar))
