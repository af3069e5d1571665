"""Random-weight GGUF files of real models' shapes (Llama, Qwen2.5, Qwen3, Gemma 3), for measuring
lockgate where no real model is at hand (the offline GPU host: see
benchmarks/gpu_check.sh).

The files go through the tests' writer (`tests/support/tiny_model.py`'s
`write_model_gguf`: llama.cpp's layout and RoPE permutation, the tiny GPT-2
tokenizer padded with placeholder tokens to the shape's vocabulary, a ChatML
template), so `lockgate serve` loads them like any GGUF. Only the source of
the weights differs: with torch and a CUDA device the weights are drawn and
quantized on the GPU (numpy takes minutes for a 1B shape), else by numpy.

    python benchmarks/random_gguf.py OUTDIR llama-3.2-1b:F16 llama-3.2-1b:Q4_0 smollm2-135m:F16

prints one line per file (its path, size and seconds) as it is written; a
file already there is kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import sys
import time

import gguf
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

from tiny_model import TINY_CONFIG, NumpyWeights, tiny_vocab, write_model_gguf  # noqa: E402

from lockgate.models.hf import llama3_rope_factors  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's architecture: `config` holds every key of `TINY_CONFIG`
    and those of `tiny_model.FAMILY_DEFAULTS` it sets."""

    name: str
    config: dict
    vocab_size: int

    def parameters(self) -> int:
        c = self.config
        attn = c["hidden_size"] * c["head_dim"] * (2 * c["num_heads"] + 2 * c["num_kv_heads"])
        mlp = 3 * c["hidden_size"] * c["intermediate_size"]
        norms = (2 * c["num_layers"] + 1) * c["hidden_size"]
        head = 0 if c["tie_word_embeddings"] else self.vocab_size * c["hidden_size"]
        return self.vocab_size * c["hidden_size"] + c["num_layers"] * (attn + mlp) + norms + head


#: Llama 3.2's RoPE scaling, as llama.cpp's converter writes it (`rope_freqs.weight`)
LLAMA_3_2_FACTORS = list(
    llama3_rope_factors(
        {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        500000.0,
        64,
    )
)

SHAPES = {
    # meta-llama/Llama-3.2-1B, with its llama3 RoPE scaling
    "llama-3.2-1b": Shape(
        "llama-3.2-1b",
        {
            "num_layers": 16,
            "hidden_size": 2048,
            "num_heads": 32,
            "num_kv_heads": 8,
            "head_dim": 64,
            "intermediate_size": 8192,
            "context_length": 131072,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_freq_factors": LLAMA_3_2_FACTORS,
        },
        128256,
    ),
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2.5-0.5b": Shape(
        "qwen2.5-0.5b",
        {
            "architecture": "qwen2",
            "attention_bias": True,
            "num_layers": 24,
            "hidden_size": 896,
            "num_heads": 14,
            "num_kv_heads": 2,
            "head_dim": 64,
            "intermediate_size": 4864,
            "context_length": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        151936,
    ),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": Shape(
        "qwen3-0.6b",
        {
            "architecture": "qwen3",
            "qk_norm": True,
            "num_layers": 28,
            "hidden_size": 1024,
            "num_heads": 16,
            "num_kv_heads": 8,
            "head_dim": 128,
            "intermediate_size": 3072,
            "context_length": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        151936,
    ),
    # google/gemma-3-270m-it: local layers of a 512-token window, every sixth global
    "gemma3-270m": Shape(
        "gemma3-270m",
        {
            "architecture": "gemma3",
            "qk_norm": True,
            "num_layers": 18,
            "hidden_size": 640,
            "num_heads": 4,
            "num_kv_heads": 1,
            "head_dim": 256,
            "intermediate_size": 2048,
            "context_length": 32768,
            "rope_theta": 1000000.0,
            "rope_local_theta": 10000.0,
            "sliding_window": 512,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        262144,
    ),
    # HuggingFaceTB/SmolLM2-135M, the default model's architecture
    "smollm2-135m": Shape(
        "smollm2-135m",
        {
            "num_layers": 30,
            "hidden_size": 576,
            "num_heads": 9,
            "num_kv_heads": 3,
            "head_dim": 64,
            "intermediate_size": 1536,
            "context_length": 8192,
            "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
        49152,
    ),
    # the tests' tiny model, for smoke runs (its compiled library is likely cached already)
    "tiny": Shape("tiny", dict(TINY_CONFIG), len(tiny_vocab())),
}

#: types `TorchWeights` encodes on its device; others are quantized by gguf-py on the host
TORCH_TYPES = ("F32", "F16", "Q4_0", "Q8_0")


# ---------------------------------------------------------------- torch


def quantize_q4_0(w):
    """GGUF Q4_0 of a float32 torch tensor (rows, cols), on its device.

    Each block of 32 values along a row is `d` (float16) and 16 bytes: value
    j is the low nibble of byte j and value j + 16 its high nibble, and
    decodes to d * (q - 8). The arithmetic is gguf-py's
    (`gguf.quants.Q4_0`), step by step, so the bytes are the same. Returns
    uint8 (rows, cols / 32 * 18).
    """
    import torch

    rows, cols = w.shape
    blocks = w.reshape(-1, 32)
    imax = blocks.abs().argmax(dim=-1, keepdim=True)
    d = blocks.gather(-1, imax) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8).reshape(-1, 2, 16)
    qs = q[:, 0, :] | (q[:, 1, :] << 4)
    scale = d.to(torch.float16).view(torch.uint8)
    return torch.cat([scale, qs], dim=-1).reshape(rows, cols // 32 * 18)


def quantize_q8_0(w):
    """GGUF Q8_0 (d float16, then 32 int8 codes; value = d * q) of a float32
    torch tensor, on its device, with gguf-py's arithmetic (round half away
    from zero). Returns uint8 (rows, cols / 32 * 34)."""
    import torch

    rows, cols = w.shape
    blocks = w.reshape(-1, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inv
    magnitude = scaled.abs()
    floored = torch.floor(magnitude)
    q = (torch.sign(scaled) * (floored + torch.floor(2 * (magnitude - floored)))).to(torch.int8)
    scale = d.to(torch.float16).view(torch.uint8)
    return torch.cat([scale, q.view(torch.uint8)], dim=-1).reshape(rows, cols // 32 * 34)


class TorchWeights:
    """`NumpyWeights`' methods with torch: weights drawn (and F16, Q4_0 and
    Q8_0 encoded) on `device`, copied to the host only as file data."""

    def __init__(self, seed: int = 0, device: str = "cuda") -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def _normal(self, shape):
        return self.torch.randn(shape, generator=self.generator, device=self.device, dtype=self.torch.float32)

    def linear(self, out_features: int, in_features: int):
        return self._normal((out_features, in_features)) * (0.5 / math.sqrt(in_features))

    def norm(self, size: int):
        return 1.0 + 0.1 * self._normal((size,))

    def bias(self, size: int):
        return 0.1 * self._normal((size,))

    def embedding(self, rows: int, cols: int):
        return self._normal((rows, cols)) * 0.2

    def permute(self, w, n_head: int):
        """`tiny_model.permute_for_llama_cpp` on a torch tensor."""
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    def encode(self, w, tensor_type: str):
        torch = self.torch
        if tensor_type == "F32":
            return w.to(torch.float32).cpu().numpy(), None
        if tensor_type == "F16":
            return w.to(torch.float16).cpu().numpy(), None
        qtype = gguf.GGMLQuantizationType[tensor_type]
        if tensor_type == "Q4_0":
            return quantize_q4_0(w).cpu().numpy(), qtype
        if tensor_type == "Q8_0":
            return quantize_q8_0(w).cpu().numpy(), qtype
        return gguf.quants.quantize(w.cpu().numpy(), qtype), qtype

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)


def pick_backend(backend: str = "auto") -> tuple[str, str]:
    """("torch", device) or ("numpy", "cpu"). "auto" takes torch when torch
    and a CUDA device are present: on the CPU numpy is as fast."""
    if backend == "numpy":
        return "numpy", "cpu"
    try:
        import torch
    except ImportError:
        if backend.startswith("torch"):
            raise SystemExit("error: --backend torch asked for, but torch is not importable") from None
        return "numpy", "cpu"
    if backend == "torch-cpu":
        return "torch", "cpu"
    if torch.cuda.is_available():
        return "torch", "cuda"
    if backend == "torch":
        raise SystemExit("error: --backend torch asked for, but torch sees no CUDA device (try torch-cpu)")
    return "numpy", "cpu"


def write_random_gguf(
    path, shape: Shape | str, tensor_type: str, *, seed: int = 0, backend: str = "auto"
) -> pathlib.Path:
    """Write a random-weight GGUF of `shape` with 2-D weights of
    `tensor_type` (F32, F16, Q4_0, Q8_0; other gguf-py types go through its
    numpy quantizer) and return its path. Written under a temporary name and
    renamed, so a cut-off write leaves no file that looks whole."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    gguf.GGMLQuantizationType[tensor_type]  # an unknown type fails here, before any work
    kind, device = pick_backend(backend)
    weights = TorchWeights(seed, device) if kind == "torch" else NumpyWeights(seed)
    path = pathlib.Path(path)
    partial = path.with_name(path.name + ".partial")
    write_model_gguf(
        partial,
        shape.config,
        weights=weights,
        tensor_type=tensor_type,
        vocab_size=shape.vocab_size,
        name=f"random-weight {shape.name} shape ({tensor_type})",
    )
    os.replace(partial, path)
    return path


def size(path: pathlib.Path) -> str:
    n = path.stat().st_size
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=pathlib.Path)
    parser.add_argument("files", nargs="+", metavar="SHAPE:TYPE",
                        help=f"shape ({', '.join(SHAPES)}) and GGML type of the 2-D weights, e.g. llama-3.2-1b:Q4_0")
    parser.add_argument("--backend", choices=["auto", "numpy", "torch", "torch-cpu"], default="auto",
                        help="who draws the weights (default: torch on CUDA when present, else numpy)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    wanted = []
    for spec in args.files:
        shape, _, tensor_type = spec.partition(":")
        if shape not in SHAPES or tensor_type not in gguf.GGMLQuantizationType.__members__:
            parser.error(f"{spec!r}: expected SHAPE:TYPE with SHAPE one of {', '.join(SHAPES)} and a GGML type")
        if (SHAPES[shape], tensor_type) not in wanted:
            wanted.append((SHAPES[shape], tensor_type))
    args.outdir.mkdir(parents=True, exist_ok=True)
    kind, device = pick_backend(args.backend)
    print(f"random GGUF writer: {kind} on {device}", flush=True)
    for shape, tensor_type in wanted:
        path = args.outdir / f"random-{shape.name}-{tensor_type}.gguf"
        if path.exists():
            print(f"model {shape.name} {tensor_type}: kept {path} ({size(path)})", flush=True)
            continue
        started = time.perf_counter()
        write_random_gguf(path, shape, tensor_type, seed=args.seed, backend=args.backend)
        print(
            f"model {shape.name} {tensor_type}: wrote {path} ({shape.parameters() / 1e6:.1f} M parameters, "
            f"{size(path)}) in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
