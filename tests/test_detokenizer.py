"""Incremental detokenization (split UTF-8 characters, special tokens) and stop strings."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from omniserve.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from omniserve.sampling_params import SamplingParams

TEXTS = [
    "Hello world, the cache holds 42 blocks.",
    "你好世界，这是一个测试。",
    "Emoji time 😀🎉 and café naïve résumé — done",
    "def f(x):\n    return x * 2  # ü",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Callable[..., Path]) -> Any:
    return AutoTokenizer.from_pretrained(tiny_checkpoint("Qwen2ForCausalLM"))


def byte_token_ids(tokenizer: Any, text: str) -> list[int]:
    """One byte-level token per UTF-8 byte, so every multi-byte character is split."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    byte_to_char, extra = {}, 0
    for b in range(256):
        if b in printable:
            byte_to_char[b] = chr(b)
        else:
            byte_to_char[b] = chr(256 + extra)
            extra += 1
    return tokenizer.convert_tokens_to_ids([byte_to_char[b] for b in text.encode()])


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ``ids`` in chunks (finishing with the last); return the text after each step."""
    texts = []
    for start in range(0, len(ids), chunk):
        finished = start + chunk >= len(ids)
        detok.update(ids[start : start + chunk], stop_terminated=False, finished=finished)
        texts.append(detok.output_text)
    return texts


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer: Any, text: str, chunk: int) -> None:
    prompt = tokenizer.encode("Question: ")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    texts = feed(detok, ids, chunk)
    assert texts[-1] == tokenizer.decode(ids) == text
    assert all("\ufffd" not in t and text.startswith(t) for t in texts)


def test_split_characters_appear_only_when_complete(tokenizer: Any) -> None:
    text = "é😀你a"
    ids = byte_token_ids(tokenizer, text)
    assert len(ids) == len(text.encode()) == 2 + 4 + 3 + 1
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    texts = feed(detok, ids)
    assert texts == ["", "é", "é", "é", "é", "é😀", "é😀", "é😀", "é😀你", "é😀你a"]


def test_random_ids_stream_is_a_prefix_and_flushes_to_full_decode(tokenizer: Any) -> None:
    """Arbitrary ids (invalid UTF-8 included): streamed text is always a prefix of the full
    decode, never ends in an unfinished character, and the finished text equals it."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            params = SamplingParams(skip_special_tokens=skip)
            texts = feed(IncrementalDetokenizer(tokenizer, [], params), ids)
            full = tokenizer.decode(ids, skip_special_tokens=skip)
            assert texts[-1] == full
            assert all(full.startswith(t) and not t.endswith("\ufffd") for t in texts[:-1])


def test_special_tokens_skipped_or_kept(tokenizer: Any) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hi there") + [im_end] + tokenizer.encode(" more")
    kept = feed(
        IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False)), ids
    )[-1]
    skipped = feed(IncrementalDetokenizer(tokenizer, [], SamplingParams()), ids)[-1]
    assert kept == "Hi there<|im_end|> more"
    assert skipped == "Hi there more" == tokenizer.decode(ids, skip_special_tokens=True)
    no_spaces = feed(
        IncrementalDetokenizer(
            tokenizer,
            [],
            SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False),
        ),
        ids,
    )[-1]
    assert no_spaces == kept  # byte-level BPE puts no spaces around special tokens anyway


def test_spaces_between_special_tokens_with_a_spacing_decoder() -> None:
    """A WordPiece decoder joins tokens with spaces; False keeps them off special tokens."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]"
    )
    ids = [1, 3, 4, 2, 2]

    def text(**kwargs: bool) -> str:
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(**kwargs))
        return feed(detok, ids)[-1]

    assert text(skip_special_tokens=False) == "[CLS] hello world [SEP] [SEP]"
    assert (
        text(skip_special_tokens=False, spaces_between_special_tokens=False)
        == "[CLS]hello world[SEP][SEP]"
    )
    assert text() == "hello world"


def test_prompt_context_keeps_leading_space(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Say")
    ids = tokenizer.encode(" hello world")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert feed(detok, ids)[-1] == " hello world"


def stop_run(tokenizer: Any, pieces: list[str], **params: Any) -> tuple[str | None, str, int]:
    """Feed one token per piece until a stop string matches: (stop, text, tokens fed)."""
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(**params))
    for fed, piece in enumerate(pieces, 1):
        stop = detok.update(tokenizer.encode(piece), stop_terminated=False)
        if stop is not None:
            return stop, detok.output_text, fed
    return None, detok.output_text, len(pieces)


def test_stop_string_inside_one_token(tokenizer: Any) -> None:
    assert stop_run(tokenizer, ["The", " answer", " is", " done"], stop=["sw"]) == (
        "sw",
        "The an",
        2,
    )
    assert stop_run(
        tokenizer, ["The", " answer", " is"], stop=["sw"], include_stop_str_in_output=True
    ) == ("sw", "The answ", 2)


def test_stop_string_across_tokens(tokenizer: Any) -> None:
    pieces = ["Hello", " wor", "ld", " again"]
    assert stop_run(tokenizer, pieces, stop=["o world"]) == ("o world", "Hell", 3)
    assert stop_run(tokenizer, pieces, stop=["o world"], include_stop_str_in_output=True) == (
        "o world",
        "Hello world",
        3,
    )


def test_earliest_stop_string_wins(tokenizer: Any) -> None:
    assert stop_run(tokenizer, ["abc", "def"], stop=["ef", "cd"]) == ("cd", "ab", 2)


def test_stop_strings_wait_for_min_tokens(tokenizer: Any) -> None:
    pieces = ["x", "y", "x", "y"]
    assert stop_run(tokenizer, pieces, stop=["x"], min_tokens=2) == ("x", "xy", 3)


def test_stop_buffer_holds_back_possible_stop_prefix(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP", "x"]))
    detok.update(tokenizer.encode("Hello"), stop_terminated=False)
    assert detok.visible_text_length(finished=False) == len("Hello") - 3
    assert detok.visible_text_length(finished=True) == len("Hello")
    with_stop = IncrementalDetokenizer(
        tokenizer, [], SamplingParams(stop=["STOP"], include_stop_str_in_output=True)
    )
    with_stop.update(tokenizer.encode("Hello"), stop_terminated=False)
    assert with_stop.visible_text_length(finished=False) == len("Hello")


def test_stop_token_text_is_excluded_unless_asked(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two")
    for include, expected in ((False, tokenizer.decode(ids[:-1])), (True, "one two")):
        detok = IncrementalDetokenizer(
            tokenizer, [], SamplingParams(include_stop_str_in_output=include)
        )
        detok.update(ids, stop_terminated=True, finished=True)
        assert detok.output_text == expected


def test_token_texts_match_single_token_decode(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    ids = [*tokenizer.encode("café 你好"), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert texts(ids) == [tokenizer.decode([i]) for i in ids]
    assert texts(ids[:2]) == texts(ids)[:2]  # served from the cache
