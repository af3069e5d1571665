"""The fast GGUF metadata reader agrees with gguf's own reader."""

from __future__ import annotations

import gguf
import pytest

from lockgate.errors import ModelLoadError
from lockgate.models.gguf_metadata import GGUFMetadata
from lockgate.models.config import ModelConfig
from lockgate.models.tokenizer import eos_token_ids, load_tokenizer
from tiny_model import write_tiny_gguf


def assert_same(path):
    ours, theirs = GGUFMetadata(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own header fields
    assert sorted(ours.fields) == sorted(keys)
    for key in keys:
        assert ours.fields[key].contents() == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(int(d) for d in reference.shape)
        assert mine.ggml_type == int(reference.tensor_type)
        assert ours.data_offset + mine.offset == reference.data_offset
    assert ModelConfig.from_gguf(ours) == ModelConfig.from_gguf(theirs)
    mine, reference = load_tokenizer(ours), load_tokenizer(theirs)
    text = "Hello, world!  naïve café 日本語 🙂 <|im_start|>user\n"
    assert mine.encode(text) == reference.encode(text)
    assert eos_token_ids(ours, mine) == eos_token_ids(theirs, reference)


@pytest.mark.parametrize("tensor_type", ["F32", "Q4_1"])
def test_agrees_with_gguf_on_the_tiny_model(tmp_path, tensor_type):
    assert_same(write_tiny_gguf(tmp_path / "tiny.gguf", tensor_type=tensor_type))


@pytest.mark.default_model
def test_agrees_with_gguf_on_the_default_model(smollm2_path):
    assert_same(smollm2_path)


def test_bad_files_are_a_model_load_error(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="bad magic"):
        GGUFMetadata(bogus)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()[:2000])
    with pytest.raises(ModelLoadError, match="cannot read"):
        GGUFMetadata(truncated)
    with pytest.raises(ModelLoadError):
        GGUFMetadata(tmp_path / "missing.gguf")
