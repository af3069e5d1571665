"""A tiny random-weight llama GGUF, written the way llama.cpp's converter does.

The file is a complete model: architecture metadata, GPT-2 byte-level BPE
tokenizer fields in the same format as the real SmolLM2 GGUF, a ChatML chat
template, and weights whose Q/K rows carry llama.cpp's RoPE permutation so a
loader has to undo it exactly as for a real file.
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


def _add_weight(writer: gguf.GGUFWriter, name: str, w: np.ndarray, tensor_type: str) -> None:
    qtype = gguf.GGMLQuantizationType[tensor_type]
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)


def write_tiny_gguf(
    path, *, tensor_type: str = "F32", seed: int = 0, vocab_size: int | None = None, **config_overrides
) -> pathlib.Path:
    """Write a tiny llama GGUF with random weights and return its path.

    With `config_overrides` and `vocab_size` the same writer makes a
    random-weight model of any llama shape (benchmarks/gpu_check.sh writes
    one of Llama-3-8B's).

    :param tensor_type: GGML type of the 2-D weights: F32, F16, Q8_0, Q4_0,
        Q4_1 (norms stay F32, as in real files).
    :param seed: seed of the weights.
    :param vocab_size: pad the tiny vocabulary with placeholder tokens up to
        this size; None keeps it as it is.
    :param config_overrides: any key of `TINY_CONFIG`.
    """
    unknown = set(config_overrides) - set(TINY_CONFIG)
    if unknown:
        raise TypeError(f"unknown config keys: {sorted(unknown)}")
    cfg = {**TINY_CONFIG, **config_overrides}
    path = pathlib.Path(path)
    rng = np.random.default_rng(seed)
    tokens = tiny_vocab()
    if vocab_size is not None:
        tokens += [f"<|placeholder_{i}|>" for i in range(vocab_size - len(tokens))]
    vocab = len(tokens)
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    n_head, n_kv, head_dim = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return (rng.standard_normal((out_features, in_features)) * (0.5 / np.sqrt(in_features))).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("lockgate tiny test model")
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

    embed = (rng.standard_normal((vocab, hidden)) * 0.2).astype(np.float32)
    _add_weight(writer, "token_embd.weight", embed, tensor_type)
    for i in range(cfg["num_layers"]):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", norm())
        q = permute_for_llama_cpp(linear(n_head * head_dim, hidden), n_head)
        k = permute_for_llama_cpp(linear(n_kv * head_dim, hidden), n_kv)
        _add_weight(writer, p + "attn_q.weight", q, tensor_type)
        _add_weight(writer, p + "attn_k.weight", k, tensor_type)
        _add_weight(writer, p + "attn_v.weight", linear(n_kv * head_dim, hidden), tensor_type)
        _add_weight(writer, p + "attn_output.weight", linear(hidden, n_head * head_dim), tensor_type)
        writer.add_tensor(p + "ffn_norm.weight", norm())
        _add_weight(writer, p + "ffn_gate.weight", linear(ffn, hidden), tensor_type)
        _add_weight(writer, p + "ffn_up.weight", linear(ffn, hidden), tensor_type)
        _add_weight(writer, p + "ffn_down.weight", linear(hidden, ffn), tensor_type)
    writer.add_tensor("output_norm.weight", norm())
    if not cfg["tie_word_embeddings"]:
        head = (rng.standard_normal((vocab, hidden)) * 0.2).astype(np.float32)
        _add_weight(writer, "output.weight", head, tensor_type)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
