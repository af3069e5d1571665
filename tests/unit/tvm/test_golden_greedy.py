"""Greedy decoding of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)
against llama.cpp.

The reference: llama-cpp-python 0.3.36 on the same GGUF, prompt tokenized
with special tokens, 30 argmax steps with end-of-turn not treated as a stop.

`LOCKGATE_TARGET` ("auto", "llvm" or "cuda") picks the executor's target, so
benchmarks/gpu_check.sh can run the same check on a GPU.
"""

from __future__ import annotations

import os

import pytest

from golden import GREEDY_IDS, PROMPT_IDS
from lockgate.engine.executor import ExecutorOptions
from lockgate.models.model_file import ModelFile
from lockgate.models.config import ModelConfig

pytestmark = pytest.mark.default_model

OTHER_PROMPTS = [
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 7042, 47, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 57, 5248, 3946, 2, 198, 1, 520, 9531, 198],
]


@pytest.fixture(scope="module")
def executor(smollm2_path, smollm2_reader):
    from lockgate.plugins.tvm.executor import create_executor

    config = ModelConfig.from_gguf(smollm2_reader)
    options = ExecutorOptions.of(
        max_num_seqs=4,
        max_total_tokens=1024,
        prefill_chunk_size=64,
        target=os.environ.get("LOCKGATE_TARGET", "auto"),
    )
    ex = create_executor(ModelFile(smollm2_path, config), options)
    yield ex
    ex.close()


def greedy_alone(executor, seq_id: int, prompt: list[int], steps: int) -> list[int]:
    executor.add_sequence(seq_id)
    try:
        logits = executor.prefill([seq_id], [prompt])[0]
        out = []
        for _ in range(steps):
            out.append(int(logits.argmax()))
            logits = executor.decode([seq_id], [out[-1]])[0]
        return out
    finally:
        executor.remove_sequence(seq_id)


def test_greedy_matches_llama_cpp(executor):
    assert executor.vocab_size == 49152
    assert greedy_alone(executor, 0, PROMPT_IDS, len(GREEDY_IDS)) == GREEDY_IDS


def test_batched_decode_equals_each_alone(executor):
    prompts = [PROMPT_IDS, *OTHER_PROMPTS]
    steps = 12
    alone = [greedy_alone(executor, 10 + i, p, steps) for i, p in enumerate(prompts)]
    assert alone[0] == GREEDY_IDS[:steps]

    ids = [20, 21, 22]
    for seq_id in ids:
        executor.add_sequence(seq_id)
    try:
        logits = executor.prefill(ids, prompts)
        together = [[] for _ in ids]
        for _ in range(steps):
            tokens = [int(row.argmax()) for row in logits]
            for out, token in zip(together, tokens):
                out.append(token)
            logits = executor.decode(ids, tokens)
    finally:
        for seq_id in ids:
            executor.remove_sequence(seq_id)
    assert together == alone
    assert executor.free_pages() == executor.total_pages
