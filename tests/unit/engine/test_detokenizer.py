"""Incremental detokenization with stop strings (lockgate.engine.detokenizer).

The central property: whatever the tokens and the stop strings, the text
streamed by `IncrementalDetokenizer` equals the whole-sequence decode cut
before the first stop string. It is checked over random token sequences of
the real SmolLM2 tokenizer, mixed with tokens that split emoji and CJK
characters (from llama.cpp's golden tokenizations).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lockgate.engine.detokenizer import DetokenizerStep, IncrementalDetokenizer

# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
PROMPT_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
# "The capital of France is Paris."
PARIS_IDS = [504, 3575, 282, 4649, 314, 7042, 30]
# SmolLM2 tokens from llama.cpp's tokenization of "日本語のテキストと中文字符" and
# "emoji 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷": most of them end inside a character.
CJK_IDS = [
    23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226,
    7365, 118, 28589, 29184, 36518, 40562, 116,
]
EMOJI_IDS = [
    391, 33777, 47526, 10813, 244, 218, 10813, 235, 119, 321, 231, 10813, 235, 119, 321,
    231, 10813, 235, 117, 321, 231, 10813, 235, 116, 284, 13198, 15107, 225, 121, 10813,
    225, 132,
]
HI, ROCKET, BANG = 26843, [10813, 244, 218], 17  # "Hi", "🚀" in three tokens, "!"

@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer):
    return smollm2_tokenizer


def stream(
    detokenizer: IncrementalDetokenizer, token_ids
) -> tuple[list[str], DetokenizerStep | None]:
    """Feed tokens until a stop; return the texts emitted and the stopping step."""
    texts = []
    for token_id in token_ids:
        step = detokenizer.add(token_id)
        texts.append(step.text)
        if step.stopped:
            return texts, step
    texts.append(detokenizer.finish())
    return texts, None


def cut_at_first_stop(text: str, stops) -> tuple[str, str | None]:
    """The reference: cut before the stop string that is complete first."""
    best = None
    for stop in stops:
        start = text.find(stop) if stop else -1
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return (text, None) if best is None else (text[: best[1]], best[2])


@pytest.mark.default_model
def test_streamed_text_equals_whole_decode_cut_at_first_stop(smollm2):
    rng = random.Random(20261129)
    vocab_size = len(smollm2)
    text_ids = smollm2.encode(
        "The quick brown fox jumps over the lazy dog. Paris is the capital of France!\n"
        "def f(x):\n    return x**2  # done",
        add_special_tokens=False,
    )
    pools = [CJK_IDS, EMOJI_IDS, text_ids, list(range(17))]
    hits = 0
    for case in range(400):
        length = rng.randint(1, 60)
        ids = []
        for _ in range(length):
            roll = rng.random()
            if roll < 0.3:
                ids.append(rng.randrange(vocab_size))
            else:
                ids.append(rng.choice(pools[int(roll * 10) % len(pools)]))
        skip = rng.random() < 0.7
        whole = smollm2.decode(ids, skip_special_tokens=skip)
        stops = []
        for _ in range(rng.randint(0, 3)):
            if whole and rng.random() < 0.7:
                start = rng.randrange(len(whole))
                stops.append(whole[start : start + rng.randint(1, 6)])
            else:
                chars = [rng.choice("ae \n.!🚀本") for _ in range(rng.randint(1, 3))]
                stops.append("".join(chars))
        expected, expected_stop = cut_at_first_stop(whole, stops)

        prompt = PROMPT_IDS if rng.random() < 0.8 else []
        detokenizer = IncrementalDetokenizer(smollm2, prompt, stop=stops, skip_special_tokens=skip)
        texts, stopped = stream(detokenizer, ids)

        context = f"case {case}: ids={ids} stops={stops!r} skip={skip}"
        assert "".join(texts) == expected, context
        if expected_stop is not None:
            stop_end = len(expected) + len(expected_stop)
            # A stop is reported by the token that completes it, unless it
            # ends in replacement characters that only the final flush
            # releases.
            if stop_end <= len(whole.rstrip("\ufffd")):
                assert stopped is not None, context
        if stopped is not None:
            hits += 1
            assert stopped.stop_string == expected_stop, context
            assert detokenizer.stopped
        for text in texts[:-1]:
            # Nothing but the final flush may carry a broken character.
            assert "\ufffd" not in text or "\ufffd" in whole, context
    assert hits > 100


@pytest.mark.default_model
def test_emoji_split_across_tokens_is_held_back_until_complete(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS)
    texts = [detokenizer.add(t).text for t in [HI, *ROCKET, BANG]]
    assert texts == ["Hi", "", "", "🚀", "!"]
    assert detokenizer.finish() == ""


@pytest.mark.default_model
def test_cjk_characters_split_across_tokens(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS)
    texts = [detokenizer.add(t).text for t in CJK_IDS]
    # Each character comes out whole with the token that completes it.
    assert texts == [
        "", "日", "本", "", "", "語", "の", "", "テ", "", "キ", "", "ス", "", "ト", "", "と",
        "中", "文", "字", "", "符",
    ]


@pytest.mark.default_model
def test_finish_flushes_an_incomplete_character(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS)
    texts = [detokenizer.add(t).text for t in [HI, *ROCKET[:2]]]
    assert texts == ["Hi", "", ""]
    tail = detokenizer.finish()
    assert "Hi" + tail == smollm2.decode([HI, *ROCKET[:2]])
    assert tail.startswith("\ufffd")


@pytest.mark.default_model
def test_finish_flushes_text_held_for_a_possible_stop(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS, stop=["Paris!"])
    texts = [detokenizer.add(t).text for t in PARIS_IDS[:-1]]
    # " Paris" could be the start of "Paris!": only the space goes out.
    assert "".join(texts) == "The capital of France is "
    assert texts[-1] == " "
    assert detokenizer.finish() == "Paris"
    assert detokenizer.finish() == ""


@pytest.mark.default_model
def test_stop_string_spanning_tokens(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS, stop=["of France"])
    texts, step = stream(detokenizer, PARIS_IDS)
    assert step == DetokenizerStep("", stopped=True, stop_string="of France")
    assert "".join(texts) == "The capital "
    assert len(texts) == 4  # stopped on " France", the token that completed it


@pytest.mark.default_model
def test_empty_stop_strings_are_ignored(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS, stop=["", "Paris"])
    texts, step = stream(detokenizer, PARIS_IDS)
    assert ("".join(texts), step.stop_string) == ("The capital of France is ", "Paris")


@pytest.mark.default_model
def test_stop_at_the_very_first_token(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS, stop=["The"])
    step = detokenizer.add(PARIS_IDS[0])
    assert step == DetokenizerStep("", stopped=True, stop_string="The")
    with pytest.raises(RuntimeError):
        detokenizer.add(PARIS_IDS[1])
    assert detokenizer.finish() == ""


@pytest.mark.default_model
def test_earliest_stop_wins(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS, stop=["Paris", "capital", "xyz"])
    texts, step = stream(detokenizer, PARIS_IDS)
    assert "".join(texts) == "The "
    assert step.stop_string == "capital"

    # Two stops completed by the same token: the one that ends first wins,
    # and for the same end the longer one.
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS, stop=["ap", "cap", "pi"])
    texts, step = stream(detokenizer, PARIS_IDS)
    assert ("".join(texts), step.stop_string) == ("The ", "cap")


@pytest.mark.default_model
def test_stop_string_inside_one_token_cuts_the_token(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS, stop=["pit"])
    texts, step = stream(detokenizer, PARIS_IDS)
    assert "".join(texts) == "The ca"
    assert step.text == " ca"


@pytest.mark.default_model
def test_special_tokens_skipped_or_kept(smollm2):
    ids = [504, 2, 198, 1, 9690]  # "The<|im_end|>\n<|im_start|>system"
    skipped = IncrementalDetokenizer(smollm2, PROMPT_IDS)
    assert "".join(stream(skipped, ids)[0]) == "The\nsystem"
    kept = IncrementalDetokenizer(
        smollm2, PROMPT_IDS, skip_special_tokens=False, stop=["<|im_end|>"]
    )
    texts, step = stream(kept, ids)
    assert ("".join(texts), step.stop_string) == ("The", "<|im_end|>")


@pytest.mark.default_model
def test_first_token_leading_space(smollm2):
    # "Hello" then " world": the space belongs to the generated token.
    detokenizer = IncrementalDetokenizer(smollm2, smollm2.encode("Hello"))
    assert detokenizer.add(905).text == " world"
    detokenizer = IncrementalDetokenizer(smollm2, PROMPT_IDS)
    assert [detokenizer.add(t).text for t in PARIS_IDS[:3]] == ["The", " capital", " of"]


def test_prompt_context_renders_the_leading_space_a_decoder_would_strip():
    # A SentencePiece-style decoder drops the space of the first token it
    # sees: decoding " world" alone gives "world". Seeded with the prompt's
    # last tokens, the stream gives what the whole decode gives.
    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False
    )
    assert tokenizer.decode([1]) == "world"

    detokenizer = IncrementalDetokenizer(tokenizer, [0])
    texts = [detokenizer.add(1).text, detokenizer.add(2).text, detokenizer.finish()]
    assert texts == [" world", "!", ""]
    whole = tokenizer.decode([0, 1, 2])
    assert whole[len(tokenizer.decode([0])) :] == " world!"

    # Without a prompt there is nothing to separate the first token from.
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert [detokenizer.add(1).text, detokenizer.add(1).text] == ["world", " world"]


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call saw."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids, **kwargs) -> str:
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)


@pytest.mark.default_model
@pytest.mark.parametrize("pool", ["any", "split"])
def test_cost_per_token_does_not_grow(smollm2, pool):
    rng = random.Random(7)
    if pool == "split":
        # Only tokens that are broken UTF-8 on their own: the worst case.
        candidates = [*CJK_IDS, *EMOJI_IDS, *ROCKET]
        candidates = [t for t in candidates if "\ufffd" in smollm2.decode([t])]
    else:
        candidates = range(len(smollm2))
    ids = [rng.choice(candidates) for _ in range(3000)]
    counting = CountingTokenizer(smollm2)
    detokenizer = IncrementalDetokenizer(counting, PROMPT_IDS, stop=["\x00never"])
    texts, _ = stream(detokenizer, ids)
    assert "".join(texts) == smollm2.decode(ids, skip_special_tokens=True)
    assert max(counting.lengths) <= 40
    assert len(counting.lengths) <= 2 * len(ids) + 2
