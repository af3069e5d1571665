"""Tiny random-weight GGUF models, written the way llama.cpp's converter
writes each family.

A file is a complete model: architecture metadata, GPT-2 byte-level BPE
tokenizer fields in the same format as the real SmolLM2 GGUF, a ChatML chat
template, and weights laid out as the converter lays out that architecture:
for `llama`, Q/K rows carry llama.cpp's RoPE permutation so a loader has to
undo it exactly as for a real file; `qwen2` adds Q/K/V biases, `qwen3`
per-head Q/K norms and a head size of its own; `rope_freq_factors` writes
Llama 3.1's `rope_freqs.weight`.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np

TINY_CONFIG = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "context_length": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}

#: optional keys of a config, with what they default to
FAMILY_DEFAULTS = {
    "architecture": "llama",
    "attention_bias": False,
    "qk_norm": False,
    "rope_freq_factors": None,
}

#: the architectures whose Q/K rows llama.cpp's converter permutes
PERMUTED_QK = {"llama"}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

MERGES = [
    "Ġ t", "Ġ a", "i n", "h e", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t",
    "Ġ w", "Ġ o", "e n", "Ġ c", "i s", "o r", "e s", "a n", "Ġ b", "Ġ f",
    "Ġ m", "Ġ p", "i t", "a r", "a l", "o u", "l e", "Ġ d", "Ġ h", "Ġa n",
    "Ġo f", "Ġt o", "in g", "Ġ in", "Ġan d", "Ġ i", "Ġ l", "Ġ n", "e d", "l l",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in its order."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tiny_vocab() -> list[str]:
    """Specials, the byte alphabet, then one token per merge."""
    return SPECIAL_TOKENS + bytes_to_unicode() + [m.replace(" ", "") for m in MERGES]


def permute_for_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF (out, in) Q/K rows -> llama.cpp's interleaved-pair RoPE order."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


class NumpyWeights:
    """Random weights drawn with numpy, in the order the writer asks for
    them, and their encoding into GGUF tensor data.

    `write_model_gguf` takes any object with these six methods, so a
    faster source (benchmarks/random_gguf.py draws on the GPU with torch)
    writes through the same writer.
    """

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def linear(self, out_features: int, in_features: int) -> np.ndarray:
        return (self.rng.standard_normal((out_features, in_features)) * (0.5 / np.sqrt(in_features))).astype(
            np.float32
        )

    def norm(self, size: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.standard_normal(size)).astype(np.float32)

    def bias(self, size: int) -> np.ndarray:
        return (0.1 * self.rng.standard_normal(size)).astype(np.float32)

    def embedding(self, rows: int, cols: int) -> np.ndarray:
        return (self.rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    def permute(self, w: np.ndarray, n_head: int) -> np.ndarray:
        return permute_for_llama_cpp(w, n_head)

    def encode(self, w: np.ndarray, tensor_type: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
        """The tensor's data for `GGUFWriter.add_tensor` and its raw type
        (None for float arrays, whose dtype says it)."""
        qtype = gguf.GGMLQuantizationType[tensor_type]
        if qtype == gguf.GGMLQuantizationType.F32:
            return w.astype(np.float32), None
        if qtype == gguf.GGMLQuantizationType.F16:
            return w.astype(np.float16), None
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_model_gguf(
    path,
    config: dict,
    *,
    weights,
    tensor_type: str = "F32",
    vocab_size: int | None = None,
    name: str = "lockgate tiny test model",
) -> pathlib.Path:
    """Write a GGUF of shape `config` (every key of `TINY_CONFIG`, and any
    of `FAMILY_DEFAULTS`) with the tiny tokenizer and `weights`' tensors;
    returns its path.

    :param weights: the source of the tensors (`NumpyWeights` or one with
        the same methods); asked for them in file order.
    :param tensor_type: GGML type of the 2-D weights; norms stay F32, as in
        real files.
    :param vocab_size: pad the tiny vocabulary with placeholder tokens up to
        this size; None keeps it as it is.
    """
    missing = set(TINY_CONFIG) - set(config)
    unknown = set(config) - set(TINY_CONFIG) - set(FAMILY_DEFAULTS)
    if missing or unknown:
        raise TypeError(f"config keys missing: {sorted(missing)}, unknown: {sorted(unknown)}")
    cfg = {**FAMILY_DEFAULTS, **config}
    arch = cfg["architecture"]
    path = pathlib.Path(path)
    tokens = tiny_vocab()
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size must be at least {len(tokens)}, the tiny vocabulary's size")
        tokens += [f"<|placeholder_{i}|>" for i in range(vocab_size - len(tokens))]
    vocab = len(tokens)
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    n_head, n_kv, head_dim = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_context_length(cfg["context_length"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(cfg["num_layers"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    if head_dim * n_head != hidden or arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(False)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (vocab - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(tensor_name: str, w) -> None:
        data, raw_dtype = weights.encode(w, tensor_type)
        writer.add_tensor(tensor_name, data, raw_dtype=raw_dtype)

    def add_norm(tensor_name: str) -> None:
        data, _ = weights.encode(weights.norm(hidden), "F32")
        writer.add_tensor(tensor_name, data)

    def permute(w, heads: int):
        return weights.permute(w, heads) if arch in PERMUTED_QK else w

    def add_vector(tensor_name: str, values) -> None:
        if not hasattr(values, "shape"):
            values = np.asarray(values, dtype=np.float32)
        data, _ = weights.encode(values, "F32")
        writer.add_tensor(tensor_name, data)

    add("token_embd.weight", weights.embedding(vocab, hidden))
    if cfg["rope_freq_factors"] is not None:
        add_vector("rope_freqs.weight", cfg["rope_freq_factors"])
    for i in range(cfg["num_layers"]):
        p = f"blk.{i}."
        add_norm(p + "attn_norm.weight")
        add(p + "attn_q.weight", permute(weights.linear(n_head * head_dim, hidden), n_head))
        add(p + "attn_k.weight", permute(weights.linear(n_kv * head_dim, hidden), n_kv))
        add(p + "attn_v.weight", weights.linear(n_kv * head_dim, hidden))
        if cfg["attention_bias"]:
            add_vector(p + "attn_q.bias", permute(weights.bias(n_head * head_dim), n_head))
            add_vector(p + "attn_k.bias", permute(weights.bias(n_kv * head_dim), n_kv))
            add_vector(p + "attn_v.bias", weights.bias(n_kv * head_dim))
        if cfg["qk_norm"]:
            add_vector(p + "attn_q_norm.weight", weights.norm(head_dim))
            add_vector(p + "attn_k_norm.weight", weights.norm(head_dim))
        add(p + "attn_output.weight", weights.linear(hidden, n_head * head_dim))
        add_norm(p + "ffn_norm.weight")
        add(p + "ffn_gate.weight", weights.linear(ffn, hidden))
        add(p + "ffn_up.weight", weights.linear(ffn, hidden))
        add(p + "ffn_down.weight", weights.linear(hidden, ffn))
    add_norm("output_norm.weight")
    if not cfg["tie_word_embeddings"]:
        add("output.weight", weights.embedding(vocab, hidden))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(
    path, *, tensor_type: str = "F32", seed: int = 0, vocab_size: int | None = None, **config_overrides
) -> pathlib.Path:
    """Write a tiny GGUF with random weights and return its path (a llama
    unless `architecture` says otherwise).

    With `config_overrides` and `vocab_size` the same writer makes a
    random-weight model of any llama shape (benchmarks/random_gguf.py writes
    real shapes through `write_model_gguf`, drawing on the GPU when it can).

    :param tensor_type: GGML type of the 2-D weights: F32, F16, Q8_0, Q4_0,
        Q4_1 (norms stay F32, as in real files).
    :param seed: seed of the weights.
    :param vocab_size: pad the tiny vocabulary with placeholder tokens up to
        this size; None keeps it as it is.
    :param config_overrides: any key of `TINY_CONFIG` or `FAMILY_DEFAULTS`.
    """
    unknown = set(config_overrides) - set(TINY_CONFIG) - set(FAMILY_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown config keys: {sorted(unknown)}")
    return write_model_gguf(
        path,
        {**TINY_CONFIG, **config_overrides},
        weights=NumpyWeights(seed),
        tensor_type=tensor_type,
        vocab_size=vocab_size,
    )
