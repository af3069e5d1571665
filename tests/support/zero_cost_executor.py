"""Test double: an executor whose forward passes cost next to nothing, for
measuring what the engine and the HTTP layer add per step and per token
(`benchmarks/engine_overhead.py`) and for testing them without TVM.

It keeps the paged KV cache's books of `FakeExecutor` (the scheduler reads
`free_pages` and forks share pages), but its logits depend on the last token
alone: row `t` favours `successor(t)`, from a precomputed table. A forward
pass is one dict lookup per sequence and a zeroed `[rows, vocab]` array
with two entries a row, so what a benchmark measures is the server's own
host work.

The successor of every token is a "word" token (its text is printable, it
is not special), and the words follow each other in a fixed cycle, so a
greedy output is known in advance (`expected_tokens`) and reads as text
the detokenizer has real work on. It is never shipped as a product
executor: a benchmark or a test registers it through
`lockgate_register_executors` (`ZeroCostExecutors`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fake_executor import FakeExecutor, sizes_for
from lockgate import hookimpl


class ZeroCostExecutor(FakeExecutor):
    """Forward passes that cost a table lookup.

    :param word_tokens: the token ids outputs cycle through, in order; every
        token's successor is one of them.
    """

    def __init__(self, *, vocab_size: int, word_tokens: Sequence[int], **sizes) -> None:
        super().__init__(vocab_size=vocab_size, **sizes)
        words = [int(t) for t in word_tokens]
        if not words:
            raise ValueError("word_tokens is empty")
        successor = np.empty(vocab_size, dtype=np.int64)
        successor[:] = [words[t % len(words)] for t in range(vocab_size)]
        for position, token in enumerate(words):
            successor[token] = words[(position + 1) % len(words)]
        self.successor = successor

    def _logits(self, last_tokens: np.ndarray) -> np.ndarray:
        """A row per token: 10 at its successor and, a runner-up so that
        sampling at a temperature has a choice to make, 9 at the
        successor's successor. Built per call rather than gathered from a
        `[vocab, vocab]` table, which would not fit at a real model's
        vocabulary."""
        first = self.successor[last_tokens]
        logits = np.zeros((last_tokens.size, self.vocab_size), dtype=np.float32)
        rows = np.arange(last_tokens.size)
        logits[rows, first] = 10.0
        logits[rows, self.successor[first]] = 9.0
        return logits

    def _append_cheaply(self, seq_id: int, token_ids: Sequence[int]) -> None:
        tokens = self.tokens[seq_id]
        pages = self.pages[seq_id]
        for token in token_ids:
            if len(tokens) % self.page_size == 0:
                pages.append(self._take_page())
            tokens.append(token)
        if len(tokens) > self.max_sequence_length:
            raise ValueError(f"sequence {seq_id} is longer than {self.max_sequence_length}")

    def prefill(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]],
                all_positions: Sequence[bool] | None = None) -> np.ndarray:
        if sum(len(t) for t in token_ids) > self.prefill_chunk_size or not all(token_ids):
            raise ValueError("a prefill call carries 1 .. prefill_chunk_size tokens per chunk")
        for seq_id, tokens in zip(seq_ids, token_ids):
            self._append_cheaply(seq_id, tokens)
        every = all_positions or [False] * len(token_ids)
        last = [list(t) if all_rows else [t[-1]] for t, all_rows in zip(token_ids, every)]
        return self._logits(np.array([int(token) for tokens in last for token in tokens], dtype=np.int64))

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        if len(seq_ids) > self.max_num_seqs:
            raise ValueError("more rows than max_num_seqs")
        for seq_id, token in zip(seq_ids, token_ids):
            self._append_cheaply(seq_id, (token,))
        return self._logits(np.asarray(token_ids, dtype=np.int64))

    def expected_tokens(self, last_prompt_token: int, count: int) -> list[int]:
        """The greedy output of `count` tokens after a prompt ending in `last_prompt_token`."""
        out, token = [], last_prompt_token
        for _ in range(count):
            token = int(self.successor[token])
            out.append(token)
        return out


def word_tokens(tokenizer) -> list[int]:
    """The tokens outputs cycle through: those that decode, alone, to
    printable ASCII of two characters or more (whole words and word pieces
    of the tiny model's vocabulary), in id order."""
    words = []
    for token in range(len(tokenizer)):
        if token in tokenizer.all_special_ids:
            continue
        text = tokenizer.decode([token])
        if len(text) >= 2 and text.isascii() and text.isprintable():
            words.append(token)
    return words


def create_zero_cost_executor(model_file, options) -> ZeroCostExecutor:
    """An executor factory (`lockgate.engine.executor.ExecutorFactory`):
    sized by the server's executor options, its words read from the
    model's own tokenizer."""
    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_file.metadata or GGUFMetadata(model_file.path))
    return ZeroCostExecutor(word_tokens=word_tokens(tokenizer), **sizes_for(model_file, options))


class ZeroCostExecutors:
    """Plugin: registers the `zero-cost` executor."""

    @hookimpl
    def lockgate_register_executors(self, register):
        register("zero-cost", create_zero_cost_executor)
