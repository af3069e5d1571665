"""Test double: an executor that writes a script. Whatever the prompt, the
greedy output is `script` (token ids a test sets on the executor), then
EOS: the next token favoured is the one that follows the longest start of
the script the sequence ends with. With a real tokenizer's ids this gives
a server whose output is known to the byte, for testing how that output is
read (thinking, answer, tool calls) rather than what a model would write.
It keeps `FakeExecutor`'s page books. Registered by a test through
`lockgate_register_executors` (`ScriptedExecutors`), never shipped.
"""

from __future__ import annotations

import numpy as np

from fake_executor import FakeExecutor, sizes_for
from lockgate import hookimpl


class ScriptedExecutor(FakeExecutor):
    def __init__(self, *, eos_token_id: int, **sizes) -> None:
        super().__init__(**sizes)
        self.eos_token_id = eos_token_id
        #: the output every sequence writes (token ids)
        self.script: list[int] = []

    def _logits(self, tokens: list[int]) -> np.ndarray:
        script = self.script
        written = 0
        for k in range(min(len(script), len(tokens)), 0, -1):
            if tokens[-k:] == script[:k]:
                written = k
                break
        following = script[written] if written < len(script) else self.eos_token_id
        # so far ahead that sampling at any temperature writes the script
        row = np.full(self.vocab_size, -100.0, dtype=np.float32)
        row[following] = 100.0
        return row


def create_scripted_executor(model_file, options) -> ScriptedExecutor:
    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.models.tokenizer import eos_token_ids, load_tokenizer

    metadata = model_file.metadata or GGUFMetadata(model_file.path)
    eos = eos_token_ids(metadata, load_tokenizer(metadata))[0]
    return ScriptedExecutor(eos_token_id=eos, **sizes_for(model_file, options))


class ScriptedExecutors:
    """Plugin: registers the `scripted` executor."""

    @hookimpl
    def lockgate_register_executors(self, register):
        register("scripted", create_scripted_executor)


def set_script(model, text: str) -> list[int]:
    """Make `model` (served by a scripted executor) write `text`; its ids."""
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    assert model.tokenizer.decode(ids) == text, "the script does not round-trip through the tokenizer"
    model.executor.script = ids
    return ids

