"""The TVM executor's own settings, which it adds to `lockgate serve`
through `lockgate_add_settings`, and `TVMOptions`: their values for one
executor, read from `ExecutorOptions.plugin_settings` (a setting not given
has its default here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lockgate.engine.executor import ExecutorOptions
from lockgate.settings import Setting

SETTINGS = (
    Setting("target", str, "auto", "compile target: `llvm`, `cuda`, or `auto` (CUDA when a GPU is present)",
            choices=("auto", "llvm", "cuda")),
    Setting("quantize", str, None,
            "pack float weights at load, a Hugging Face directory's or a GGUF file's F32/F16/BF16 "
            "matrices: `q8_0` or `q4_0`", choices=("q8_0", "q4_0")),
    Setting("num_threads", int, None, "CPU threads for the executor", default_text="all cores"),
    Setting("exact_matmul", bool, False,
            "multiply quantized weights exactly on the CPU, each dequantized to float32 (2-7x slower); by "
            "default activations are rounded to 8 bits per block of 32, as llama.cpp does, and integer dot "
            "products (AVX2, AVX-512 VNNI) do the work"),
    Setting("device_sampling", bool, None,
            "choose tokens where the logits are, so only token ids (and requested logprobs) cross to the "
            "host; `--no-device-sampling` samples on the host with numpy",
            default_text="on for CUDA, off for llvm (numpy is faster on the CPU)"),
    Setting("cache_dir", Path, None, "where compiled models are cached",
            default_text="`~/.cache/lockgate`", metavar="DIR"),
)


@dataclasses.dataclass(frozen=True)
class TVMOptions:
    """What the TVM executor is told beyond its sizes."""

    #: "auto" (cuda when a GPU is present, else llvm), "llvm" or "cuda"
    target: str = "auto"
    #: pack float matrices at load: "q8_0", "q4_0", or None to keep them
    quantize: str | None = None
    #: CPU threads for the llvm target; None lets the runtime decide
    num_threads: int | None = None
    #: on the CPU, dequantize packed weights to float32 rather than round
    #: activations to 8 bits for integer dot products
    exact_matmul: bool = False
    #: choose tokens where the logits are (`Executor.sample`), so only token
    #: ids and requested logprobs cross to the host; None: on for cuda, off
    #: for llvm (numpy samples faster on the CPU)
    device_sampling: bool | None = None
    #: where compiled libraries are cached; None means the default cache dir
    cache_dir: Path | None = None

    @classmethod
    def of(cls, options: ExecutorOptions) -> "TVMOptions":
        given = options.plugin_settings
        return cls(**{s.name: given.get(s.name, s.default) for s in SETTINGS})


# the dataclass's defaults are the settings' (one source for the docs' table)
assert {f.name: f.default for f in dataclasses.fields(TVMOptions)} == {s.name: s.default for s in SETTINGS}
