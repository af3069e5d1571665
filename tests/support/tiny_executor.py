"""The TVM executor made straight from a tiny GGUF file (no engine), and the
prompt the executor's tests run, for tests in this process and the
processes they start."""

from __future__ import annotations

import pathlib

import gguf

from lockgate.engine.executor import ExecutorOptions
from lockgate.models.config import ModelConfig
from lockgate.models.model_file import ModelFile

#: a prompt of the tiny vocabulary's ids (BOS first)
PROMPT = [1, 70, 71, 72, 260, 261, 262, 30, 40, 50, 2, 198]


def make_executor(path: pathlib.Path, cache: pathlib.Path, **options):
    """The TVM executor of the file at `path`, compiled into `cache`, small
    (4 sequences, 1024 tokens, prefill chunks of 64) unless `options` say."""
    from lockgate.plugins.tvm.executor import create_executor

    config = ModelConfig.from_gguf(gguf.GGUFReader(path))
    opts = {"max_num_seqs": 4, "max_total_tokens": 1024, "prefill_chunk_size": 64}
    opts.update(options)
    return create_executor(ModelFile(path, config), ExecutorOptions.of(cache_dir=cache, **opts))
