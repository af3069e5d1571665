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

import kquants

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

#: overrides of `TINY_CONFIG` for a tiny shape whose rows are whole
#: K-quant super-blocks (256 inputs)
KQUANT_CONFIG = {
    "hidden_size": 256,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
}

#: llama.cpp's Q4_K_M mix as it falls on a small model: Q4_K, with Q6_K for
#: the V projections, the MLP down projections (in the layers it gives more
#: bits; all of them in a model this short) and the output head
Q4_K_M = {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}

#: Q5_K_M likewise: Q5_K, with Q6_K where Q4_K_M has it
Q5_K_M = Q4_K_M


#: Llama 3.1's factors at the tiny head size: low frequencies divided by 8,
#: the highest kept, a smooth band between (the shape llama.cpp's converter writes)
LLAMA3_FACTORS = [1.0, 1.0, 1.0, 1.6, 3.2, 8.0, 8.0, 8.0]

#: one tiny file per family and variant besides the plain llama: overrides
#: of `TINY_CONFIG`
FAMILY_VARIANTS = {
    "llama3-rope-scaling": {"rope_freq_factors": LLAMA3_FACTORS},
    "qwen2": {"architecture": "qwen2", "attention_bias": True, "tie_word_embeddings": False},
    "qwen3": {"architecture": "qwen3", "qk_norm": True, "head_dim": 32, "rope_theta": 1000000.0},
    # local layers of a 16-token window (prompts longer than it), every
    # second layer global, soft-capped logits
    "gemma3": {
        "architecture": "gemma3", "qk_norm": True, "head_dim": 32, "num_layers": 4,
        "sliding_window": 16, "sliding_window_pattern": 2, "rope_local_theta": 10000.0,
        "rope_theta": 1000000.0, "final_logit_softcap": 30.0,
    },
}


#: optional keys of a config, with what they default to
FAMILY_DEFAULTS = {
    "architecture": "llama",
    "attention_bias": False,
    "qk_norm": False,
    "rope_freq_factors": None,
    "sliding_window": 0,
    "sliding_window_pattern": None,
    "rope_local_theta": None,
    "final_logit_softcap": 0.0,
    #: a classification head's labels: `cls.output.weight` (a row each) and
    #: rank pooling, as llama.cpp's converter writes a reranker (Qwen3-Reranker)
    "classifier_labels": None,
    #: `tokenizer.chat_template.rerank`: a reranker's pair prompt, `{query}` and `{document}` in it
    "rerank_template": None,
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
        if qtype in kquants.K_TYPES:
            return kquants.quantize(w, qtype), qtype
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_model_gguf(
    path,
    config: dict,
    *,
    weights,
    tensor_type: str = "F32",
    tensor_types: dict[str, str] | None = None,
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
    :param tensor_types: types of particular 2-D weights, by tensor name
        ("blk.0.attn_v.weight") or by its last two parts ("attn_v.weight"),
        over `tensor_type`: a mix like `Q4_K_M`.
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
    if head_dim * n_head != hidden or arch in ("qwen3", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if cfg["sliding_window"]:
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg["sliding_window"])
    pattern = cfg["sliding_window_pattern"]
    if isinstance(pattern, int):
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", pattern)
    elif pattern is not None:
        writer.add_array(f"{arch}.attention.sliding_window_pattern", [bool(flag) for flag in pattern])
    if cfg["rope_local_theta"] is not None:
        writer.add_float32(f"{arch}.rope.freq_base_swa", cfg["rope_local_theta"])
    if cfg["final_logit_softcap"]:
        writer.add_float32(f"{arch}.final_logit_softcapping", cfg["final_logit_softcap"])
    if cfg["classifier_labels"]:
        writer.add_array(f"{arch}.classifier.output_labels", list(cfg["classifier_labels"]))
        writer.add_uint32(f"{arch}.pooling_type", 4)  # llama.cpp's LLAMA_POOLING_TYPE_RANK
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
    if cfg["rerank_template"]:
        writer.add_string("tokenizer.chat_template.rerank", cfg["rerank_template"])

    types = tensor_types or {}

    def add(tensor_name: str, w) -> None:
        short = ".".join(tensor_name.split(".")[-2:])
        data, raw_dtype = weights.encode(w, types.get(tensor_name, types.get(short, tensor_type)))
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
        if arch == "gemma3":
            add_norm(p + "post_attention_norm.weight")
        add_norm(p + "ffn_norm.weight")
        add(p + "ffn_gate.weight", weights.linear(ffn, hidden))
        add(p + "ffn_up.weight", weights.linear(ffn, hidden))
        add(p + "ffn_down.weight", weights.linear(hidden, ffn))
        if arch == "gemma3":
            add_norm(p + "post_ffw_norm.weight")
    add_norm("output_norm.weight")
    if not cfg["tie_word_embeddings"]:
        add("output.weight", weights.embedding(vocab, hidden))
    if cfg["classifier_labels"]:
        add("cls.output.weight", weights.embedding(len(cfg["classifier_labels"]), hidden))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(
    path,
    *,
    tensor_type: str = "F32",
    tensor_types: dict[str, str] | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    **config_overrides,
) -> pathlib.Path:
    """Write a tiny GGUF with random weights and return its path (a llama
    unless `architecture` says otherwise).

    With `config_overrides` and `vocab_size` the same writer makes a
    random-weight model of any llama shape (benchmarks/random_gguf.py writes
    real shapes through `write_model_gguf`, drawing on the GPU when it can).

    :param tensor_type: GGML type of the 2-D weights: F32, F16, BF16, Q8_0,
        Q4_0, Q4_1, Q5_0, Q5_1, or a K-quant (Q4_K, Q5_K, Q6_K: rows of
        multiples of 256, as in `KQUANT_CONFIG`); norms stay F32, as in real
        files.
    :param tensor_types: per-tensor types over `tensor_type`
        (`write_model_gguf`), e.g. `Q4_K_M`.
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
        tensor_types=tensor_types,
        vocab_size=vocab_size,
    )


#: Hugging Face `architectures` of each GGUF architecture the writer knows
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def _to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def write_safetensors(path, tensors: dict[str, np.ndarray], dtype: str = "F16") -> None:
    """A safetensors file (8-byte header length, JSON header, data) of
    float matrices stored as `dtype` (F32, F16 or BF16) and vectors as F32,
    as the GGUF files of `write_model_gguf` keep norms and biases."""
    import json

    header, chunks, offset = {}, [], 0
    for name, array in tensors.items():
        dtype_of = dtype if array.ndim > 1 else "F32"
        if dtype_of == "BF16":
            data = _to_bf16_bits(array).tobytes()
        else:
            data = np.ascontiguousarray(array, dtype={"F32": np.float32, "F16": np.float16}[dtype_of]).tobytes()
        header[name] = {"dtype": dtype_of, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as file:
        file.write(len(raw).to_bytes(8, "little"))
        file.write(raw)
        for chunk in chunks:
            file.write(chunk)


def write_hf_directory(gguf_path, directory, dtype: str = "F16") -> pathlib.Path:
    """The model of a GGUF file written by `write_model_gguf`, as a Hugging
    Face directory: config.json, model.safetensors (`dtype`), the tokenizer
    as `tokenizer.json` with its config and chat template, and
    generation_config.json. Q/K rows are put back in Hugging Face's order.
    """
    import json

    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.models.tokenizer import load_tokenizer

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()

    def meta(key, default=None):
        field = reader.fields.get(f"{arch}.{key}")
        return default if field is None else field.contents()

    names = {t.name: t for t in reader.tensors}

    def read(name):
        t = names[name]
        values = np.asarray(t.data, dtype=np.float32)
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        return values.reshape(tuple(reversed([int(d) for d in t.shape])))

    heads, kv_heads = int(meta("attention.head_count")), int(meta("attention.head_count_kv"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", 0)) or hidden // heads

    def unpermute(w, n_head):
        if arch not in PERMUTED_QK:
            return w
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    hf_names = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    }
    if arch == "gemma3":
        hf_names.update({
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        })

    def stored(name, values):
        # Gemma's directories keep w where llama.cpp's files keep 1 + w
        return values - np.float32(1) if arch == "gemma3" and name.endswith("norm.weight") else values
    tensors = {}
    for name in names:
        if name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = read(name)
        elif name == "output_norm.weight":
            tensors["model.norm.weight"] = stored(name, read(name))
        elif name == "output.weight":
            tensors["lm_head.weight"] = read(name)
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            values = read(name)
            if rest.startswith("attn_q."):
                values = unpermute(values, heads)
            elif rest.startswith("attn_k."):
                values = unpermute(values, kv_heads)
            tensors[f"model.layers.{layer}.{hf_names[rest]}"] = stored(rest, values)
    write_safetensors(directory / "model.safetensors", tensors, dtype)
    config = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].contents()),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": float(meta("rope.freq_base")),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}[dtype],
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "gemma3":
        config["sliding_window"] = int(meta("attention.sliding_window", 0))
        pattern = meta("attention.sliding_window_pattern", 6)
        config["layer_types"] = [
            "full_attention" if (i % pattern == pattern - 1) else "sliding_attention"
            for i in range(config["num_hidden_layers"])
        ]
        config["rope_local_base_freq"] = float(meta("rope.freq_base_swa", 10000.0))
        config["final_logit_softcapping"] = meta("final_logit_softcapping")
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    save_hf_tokenizer(load_tokenizer(GGUFMetadata(gguf_path)), directory)
    return directory


def save_hf_tokenizer(tokenizer, directory) -> None:
    """`tokenizer` (a `TextTokenizer`) as a Hugging Face directory keeps it:
    `tokenizer.json`, `tokenizer_config.json` (the named special tokens,
    `add_bos_token`, `add_eos_token`, the added tokens) and
    `chat_template.jinja`, as transformers' `save_pretrained` writes them."""
    import json

    directory = pathlib.Path(directory)
    tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    added = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in tokenizer.added_tokens_decoder.items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "backend": "tokenizers",
        "add_bos_token": tokenizer.add_bos_token, "add_eos_token": tokenizer.add_eos_token,
        "clean_up_tokenization_spaces": False, "added_tokens_decoder": added, **tokenizer.special_tokens_map,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    if tokenizer.chat_template:
        (directory / "chat_template.jinja").write_text(tokenizer.chat_template)
