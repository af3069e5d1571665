"""Hugging Face model directories: `config.json`, `*.safetensors`,
`tokenizer.json` and `tokenizer_config.json` (and `generation_config.json`),
read without torch.

The directory is presented to the rest of lockgate as a GGUF file would be:
a `ModelConfig` (`read_hf_config`), tensors under llama.cpp's names
(`HFTensors`, the interface of the TVM plugin's `GGUFTensors`) in Hugging
Face's own row order (so no Q/K rows need un-permuting), and a
`TextTokenizer` with the directory's chat template and stop tokens.
safetensors are parsed here (an 8-byte header length, a JSON header, raw
little-endian data), memory-mapped; bfloat16 is widened bit-exactly to
float32 and handed on as float16, the executor's own format.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import gguf
import numpy as np

from lockgate.errors import ModelLoadError
from lockgate.models.config import ModelConfig
from lockgate.models.families import ModelFamilies, ModelFamily
from lockgate.models.text_tokenizer import SPECIAL_TOKEN_NAMES, TextTokenizer

#: safetensors dtypes lockgate reads, with their item sizes
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}


def is_hf_directory(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory holding a `config.json`."""
    path = pathlib.Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def _read_json(path: pathlib.Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return value


def llama3_rope_factors(scaling: dict, theta: float, rotary_dim: int) -> tuple[float, ...]:
    """Llama 3.1's per-frequency RoPE divisors from its `rope_scaling`, as
    llama.cpp's converter computes `rope_freqs.weight`: wavelengths shorter
    than `original / high_freq_factor` keep their frequency, longer than
    `original / low_freq_factor` are divided by `factor`, and those between
    are blended smoothly."""
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelength, high_wavelength = original / low, original / high
    factors = []
    for i in range(0, rotary_dim, 2):
        frequency = 1.0 / theta ** (i / rotary_dim)
        wavelength = 2 * math.pi / frequency
        if wavelength < high_wavelength:
            factors.append(1.0)
        elif wavelength > low_wavelength:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    # the tensor llama.cpp reads is float32
    return tuple(float(v) for v in np.asarray(factors, dtype=np.float32))


def read_hf_config(directory: pathlib.Path, families: ModelFamilies) -> tuple[ModelConfig, ModelFamily]:
    """The `ModelConfig` of a Hugging Face directory and the family that
    runs it (from `config.json`'s `architectures`).

    :raises ModelLoadError: no family runs it, a required key is missing,
        or it asks for a RoPE scaling lockgate does not implement.
    """
    raw = _read_json(directory / "config.json")
    family = families.for_hf_architectures(raw.get("architectures") or [raw.get("model_type", "?")])
    # what the family's files have without saying (Qwen2's Q/K/V biases)
    raw = {**family.hf_config, **raw}

    def get(key: str, default: Any = None) -> Any:
        if key in raw and raw[key] is not None:
            return raw[key]
        if default is None:
            raise ModelLoadError(f"{directory / 'config.json'} lacks {key!r}")
        return default

    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    head_dim = int(get("head_dim", hidden // heads))
    theta = float(get("rope_theta", 10000.0))
    rotary_dim = int(head_dim * float(get("partial_rotary_factor", 1.0)))
    window = int(raw.get("sliding_window") or 0)
    pattern = None
    if window and isinstance(raw.get("layer_types"), list):
        pattern = tuple(kind == "sliding_attention" for kind in raw["layer_types"])
    elif window and raw.get("sliding_window_pattern"):
        pattern = int(raw["sliding_window_pattern"])
    scaling = raw.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factors, scale = None, 1.0
    if kind == "llama3":
        factors = llama3_rope_factors(scaling, theta, rotary_dim)
    elif kind == "linear":
        scale = 1.0 / float(scaling.get("factor", 1.0))
    elif kind != "default":
        raise ModelLoadError(
            f"RoPE scaling {kind!r} (config.json rope_scaling) is not supported; "
            "supported: none, linear, llama3"
        )
    config = ModelConfig(
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=int(get("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        context_length=int(get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        architecture=family.architectures[0],
        rotary_dim=rotary_dim,
        attention_bias=bool(get("attention_bias", False)),
        qk_norm=bool(get("qk_norm", False)),
        rope_scale=scale,
        rope_freq_factors=factors,
        sliding_window=window if family.name == "gemma3" else 0,
        sliding_window_pattern=pattern,
        rope_local_theta=raw.get("rope_local_base_freq"),
        final_logit_softcap=float(raw.get("final_logit_softcapping") or 0.0),
    )
    return config, family


class _Safetensors:
    """The tensors of one or more safetensors files, memory-mapped."""

    def __init__(self, files: Iterable[pathlib.Path]) -> None:
        self._entries: dict[str, tuple[np.memmap, str, tuple[int, ...], int, int]] = {}
        for path in files:
            try:
                with open(path, "rb") as file:
                    size = int.from_bytes(file.read(8), "little")
                    header = json.loads(file.read(size))
                data = np.memmap(path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"cannot read {path} as safetensors: {exc}") from exc
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
                start, end = (8 + size + int(o) for o in info["data_offsets"])
                if end > data.size or end - start != math.prod(shape) * _DTYPES.get(dtype, 0):
                    if dtype not in _DTYPES:
                        raise ModelLoadError(
                            f"{path}: tensor {name} is {dtype}; lockgate reads F32, F16 and BF16 safetensors"
                        )
                    raise ModelLoadError(f"malformed safetensors file {path}: tensor {name} does not fit")
                self._entries[name] = (data, dtype, shape, start, end)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        return self._entries[name][1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def float32(self, name: str) -> np.ndarray:
        data, dtype, shape, start, end = self._entries[name]
        raw = data[start:end]
        if dtype == "F32":
            return raw.view(np.float32).reshape(shape)
        if dtype == "F16":
            return raw.view(np.float16).astype(np.float32).reshape(shape)
        # bfloat16 is the top half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)


def _hf_name(name: str, overrides: Mapping[str, str] | None = None) -> str:
    """The Hugging Face name of a llama.cpp tensor name (a family's own
    names of a layer's tensors in `overrides`)."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)
    parts = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    if overrides and rest in overrides:
        return f"model.layers.{layer}.{overrides[rest]}"
    return f"model.layers.{layer}.{parts.get(rest, rest)}"


class HFTensors:
    """A Hugging Face directory's weights under llama.cpp's tensor names,
    with the interface of the TVM plugin's `GGUFTensors` (`tensor_type`,
    `matrix`, `vector`; nothing is block-quantized in safetensors).

    Rows are in Hugging Face's order: Q/K need no un-permuting. Every float
    type reports as F32 or F16; BF16 reports as F16, its values rounded to
    float16 (what the executor runs in), never widened to f32 silently.
    """

    def __init__(self, directory: str | os.PathLike, family: ModelFamily | None = None) -> None:
        directory = pathlib.Path(directory)
        self._names = dict(family.hf_tensor_names) if family is not None else {}
        self._norm_shift = family.hf_norm_shift if family is not None else 0.0
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{directory} holds no *.safetensors weights")
        self._files = _Safetensors(files)

    def __contains__(self, name: str) -> bool:
        return _hf_name(name, self._names) in self._files

    def tensor_type(self, name: str) -> gguf.GGMLQuantizationType | None:
        hf = _hf_name(name, self._names)
        if hf not in self._files:
            return None
        if self._files.dtype(hf) == "F32":
            return gguf.GGMLQuantizationType.F32
        return gguf.GGMLQuantizationType.F16

    def matrix(self, name: str, rows: int, cols: int, dtype=np.float32) -> np.ndarray:
        return self._read(name, (rows, cols)).astype(dtype, copy=False)

    def vector(self, name: str, size: int) -> np.ndarray:
        return self._read(name, (size,))

    def quantized(self, name: str, rows: int, cols: int, fmt: str) -> dict[str, np.ndarray]:
        raise ModelLoadError(f"tensor {name!r} of a safetensors directory is not block-quantized")

    def _read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        hf = _hf_name(name, self._names)
        if hf not in self._files:
            raise ModelLoadError(f"the model directory lacks tensor {hf!r}")
        if self._files.shape(hf) != shape:
            raise ModelLoadError(f"tensor {hf!r} has shape {list(self._files.shape(hf))}, expected {list(shape)}")
        values = self._files.float32(hf)
        if self._files.dtype(hf) == "BF16":
            values = values.astype(np.float16).astype(np.float32)
        if self._norm_shift and name.endswith("norm.weight"):
            values = values + np.float32(self._norm_shift)
        return values


def load_hf_tokenizer(directory: pathlib.Path, *, chat_template: str | None = None) -> TextTokenizer:
    """The directory's tokenizer, as transformers' `from_pretrained` reads it
    offline: `tokenizer.json`; the named special tokens, the added tokens,
    `add_bos_token` and `add_eos_token` from `tokenizer_config.json` (the
    special tokens from a legacy `special_tokens_map.json` where the config
    has no added tokens); the chat template from `chat_template.jinja`, else
    the config's (a text or a list of named ones), with named ones from
    `additional_chat_templates/*.jinja`. `chat_template` overrides the
    default. Clean-up of spaces is off (see tokenizer.py)."""
    from tokenizers import AddedToken, Tokenizer

    if not (directory / "tokenizer.json").is_file():
        raise ModelLoadError(f"{directory} has no tokenizer.json")
    try:
        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - the Rust parser raises its own exception type
        raise ModelLoadError(f"cannot load the tokenizer of {directory}: {exc}") from exc
    config_path = directory / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    named = config
    legacy_path = directory / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy_path.is_file():
        named = {**config, **_read_json(legacy_path)}
    special = {name: _token_text(named.get(name)) for name in SPECIAL_TOKEN_NAMES}
    have = {token.content for token in backend.get_added_tokens_decoder().values()}
    extra = []
    for token in (config.get("added_tokens_decoder") or {}).values():
        if isinstance(token, Mapping) and isinstance(token.get("content"), str) and token["content"] not in have:
            fields = ("special", "single_word", "lstrip", "rstrip", "normalized")
            extra.append(AddedToken(token["content"], **{k: bool(token[k]) for k in fields if k in token}))
    for token in named.get("extra_special_tokens") or named.get("additional_special_tokens") or []:
        text = _token_text(token)
        if text is not None and text not in have:
            extra.append(AddedToken(text, special=True, normalized=False))
    backend.add_special_tokens([token for token in extra if token.special])
    backend.add_tokens([token for token in extra if not token.special])
    templates = _hf_chat_templates(directory, config)
    if chat_template is not None:
        templates["default"] = chat_template
    default = templates.pop("default", None)
    return TextTokenizer(
        backend,
        special_tokens=special,
        add_bos_token=bool(config.get("add_bos_token", False)),
        add_eos_token=bool(config.get("add_eos_token", False)),
        # the file's own post-processor (Llama 3 adds BOS there) unless the config says
        post_processor="add_bos_token" in config or "add_eos_token" in config,
        chat_template=default,
        named_chat_templates=templates,
        # clean-up would break round trips and streaming (see tokenizer.py)
        clean_up_tokenization_spaces=False,
    )


def _token_text(value) -> str | None:
    """A special token as a config writes it: its text, or `{"content": text, ...}`."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_templates(directory: pathlib.Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The directory's chat templates by name, the default as "default"."""
    templates: dict[str, str] = {}
    found = config.get("chat_template")
    if isinstance(found, str):
        templates["default"] = found
    elif isinstance(found, list):
        for entry in found:
            if isinstance(entry, Mapping) and isinstance(entry.get("name"), str) and isinstance(
                    entry.get("template"), str):
                templates[entry["name"]] = entry["template"]
    more = directory / "additional_chat_templates"
    if more.is_dir():
        for path in sorted(more.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if (directory / "chat_template.jinja").is_file():
        templates["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return templates


def hf_eos_token_ids(directory: pathlib.Path, tokenizer) -> list[int]:
    """Where generation stops: `generation_config.json`'s `eos_token_id`
    (a number or a list), the tokenizer's EOS, and the end-of-turn texts
    llama.cpp also stops at when the vocabulary has them."""
    from lockgate.models.tokenizer import END_OF_GENERATION_TEXTS

    ids: list[int] = []

    def add(token_id) -> None:
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer) and token_id not in ids:
            ids.append(token_id)

    path = directory / "generation_config.json"
    found = _read_json(path).get("eos_token_id") if path.is_file() else None
    for token_id in found if isinstance(found, list) else [found]:
        add(token_id)
    add(tokenizer.eos_token_id)
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for text in sorted(END_OF_GENERATION_TEXTS):
        add(special.get(text))
    return ids
