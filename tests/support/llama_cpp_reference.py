"""llama.cpp's own reference data for tests: vocabularies and chat templates.

llama.cpp keeps real tokenizer vocabularies (`models/ggml-vocab-*.gguf`, the
tokenizer metadata of real models without their weights) next to test
vectors (`.gguf.inp`: texts, `.gguf.out`: the ids llama.cpp makes of them),
and real chat templates (`models/templates/*.jinja`). The llama-cpp-python
sdist on PyPI vendors that tree, so a clean clone that reaches PyPI can get
them with pip alone.

`reference_models_dir()` returns a cached copy of just those files (about
90 MB), under `$LOCKGATE_REFERENCE_DIR` or `~/.cache/lockgate/reference/`,
fetching the sdist with ``pip download`` and extracting them the first time.
The extraction goes to a temporary directory that is renamed into place, so
two test processes racing to fill the cache both end up reading a whole copy.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

__all__ = [
    "LLAMA_CPP_PYTHON_VERSION",
    "VocabTest",
    "cache_root",
    "read_vocab_tests",
    "reference_models_dir",
    "write_gemma3_style_vocab",
]

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The llama-cpp-python sdist whose vendored llama.cpp the data comes from."""

_MEMBER_PREFIX = "vendor/llama.cpp/models/"
# What is kept of the sdist: the vocabularies with their vectors, and the
# templates. Paths are relative to the sdist's top directory.
_KEPT = ("ggml-vocab-", "templates/")

# Separator between the texts of a `.inp` file (test-tokenizer-0.cpp's).
_INPUT_SEPARATOR = "\n__ggml_vocab_test__\n"


def cache_root() -> pathlib.Path:
    """Where reference data is cached: `$LOCKGATE_REFERENCE_DIR`, else
    `~/.cache/lockgate/reference`."""
    configured = os.environ.get("LOCKGATE_REFERENCE_DIR")
    if configured:
        return pathlib.Path(configured).expanduser()
    return pathlib.Path.home() / ".cache" / "lockgate" / "reference"


def reference_models_dir() -> pathlib.Path:
    """The cached `models/` directory of llama.cpp as vendored by
    llama-cpp-python `LLAMA_CPP_PYTHON_VERSION`: `ggml-vocab-*` files and
    `templates/`. Fetches and extracts it on first use.

    :raises RuntimeError: the sdist could not be downloaded or lacks the files.
    """
    target = cache_root() / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}" / "models"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as scratch:
        scratch = pathlib.Path(scratch)
        sdist = _download_sdist(scratch / "download")
        extracted = scratch / "models"
        _extract_models(sdist, extracted)
        try:
            # Atomic: a concurrent process either finds no directory (and
            # renames its own) or a whole one.
            os.rename(extracted, target)
        except OSError:
            if not target.is_dir():
                raise
    return target


def _download_sdist(into: pathlib.Path) -> pathlib.Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(into),
        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not download the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist "
            f"(llama.cpp's reference vocabularies): {' '.join(command)} said:\n{result.stderr}"
        )
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no llama_cpp_python sdist in {into}")
    return found[0]


def _extract_models(sdist: pathlib.Path, into: pathlib.Path) -> None:
    into.mkdir()
    count = 0
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive:
            top, _, inside = member.name.partition("/")
            if not member.isfile() or not inside.startswith(_MEMBER_PREFIX):
                continue
            relative = inside[len(_MEMBER_PREFIX):]
            if not relative.startswith(_KEPT) or ".." in pathlib.PurePosixPath(relative).parts:
                continue
            destination = into / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            source = archive.extractfile(member)
            assert source is not None
            with source, open(destination, "wb") as file:
                shutil.copyfileobj(source, file)
            count += 1
    if not any(into.glob("ggml-vocab-*.gguf")):
        raise RuntimeError(f"{sdist.name} holds no {_MEMBER_PREFIX}ggml-vocab-*.gguf ({count} files kept)")


class VocabTest:
    """One text of a vocabulary's test vectors and the ids llama.cpp makes of it."""

    __slots__ = ("text", "ids")

    def __init__(self, text: str, ids: list[int]) -> None:
        self.text = text
        self.ids = ids

    def __repr__(self) -> str:
        return f"VocabTest({self.text!r}, {self.ids!r})"


def read_vocab_tests(vocab: pathlib.Path) -> list[VocabTest]:
    """The test vectors of `vocab` (a `ggml-vocab-*.gguf`), read as
    llama.cpp's `tests/test-tokenizer-0.cpp` reads them.

    The `.inp` file holds the texts separated by `_INPUT_SEPARATOR`; the
    `.out` file one line of space-separated ids per text, stripped. That
    program keeps the pairs in a map keyed by text, so a repeated text counts
    once (the last pair wins).
    """
    raw = pathlib.Path(f"{vocab}.inp").read_bytes().decode("utf-8")
    lines = pathlib.Path(f"{vocab}.out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # std::getline yields no line after the final newline
    texts = []
    pos = 0
    while pos < len(raw):  # as the C++ loop: no empty text after a final separator
        end = raw.find(_INPUT_SEPARATOR, pos)
        if end < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:end])
        pos = end + len(_INPUT_SEPARATOR)
    if len(texts) != len(lines):
        raise ValueError(f"{vocab.name}: {len(texts)} texts but {len(lines)} lines of ids")
    tests: dict[str, list[int]] = {}
    for text, line in zip(texts, lines):
        tests[text] = [int(i) for i in line.strip(" \t\n\r\f\v").split()]
    return [VocabTest(text, ids) for text, ids in tests.items()]


# What `write_gemma3_style_vocab` adds to Llama 2's vocabulary: Gemma's
# user-defined whitespace runs (stored with real spaces, as llama.cpp's
# converter writes them) and an HTML tag, and its turn markers as control.
_GEMMA3_STYLE_TOKENS = (
    ("  ", 4), ("   ", 4), ("\n\n", 4), ("\t\t", 4), ("<b>", 4),
    ("<start_of_turn>", 3), ("<end_of_turn>", 3),
)


def write_gemma3_style_vocab(path: pathlib.Path) -> pathlib.Path:
    """A SentencePiece vocabulary set up as Gemma 3's GGUF files are.

    llama.cpp ships no Gemma 3 vocabulary. This is Llama 2's
    (`ggml-vocab-llama-spm.gguf`) with Gemma 3's settings: architecture
    "gemma3", no space prefix (`tokenizer.ggml.add_space_prefix` false), and
    the tokens of `_GEMMA3_STYLE_TOKENS` appended. The file is the same
    whoever writes it, so ids recorded from llama.cpp stay valid.
    """
    import gguf

    source = gguf.GGUFReader(reference_models_dir() / "ggml-vocab-llama-spm.gguf")

    def array(key: str) -> list:
        return list(source.fields[key].contents())

    tokens, scores, types = (
        array("tokenizer.ggml.tokens"), array("tokenizer.ggml.scores"), array("tokenizer.ggml.token_type")
    )
    for text, kind in _GEMMA3_STYLE_TOKENS:
        tokens.append(text)
        scores.append(-1000.0)
        types.append(kind)
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    print(reference_models_dir())
