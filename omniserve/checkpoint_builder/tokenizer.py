"""Train a family's byte-level BPE tokenizer locally; wrap it the way real checkpoints ship it."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from omniserve.checkpoint_builder.corpus import build_corpus
from omniserve.checkpoint_builder.specs import TokenizerFamily

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BPE_VOCAB_SIZE = 2000
"""Learned vocabulary (256 byte symbols + merges); special tokens are added after it."""


def _empty_tokenizer(family: TokenizerFamily) -> Tokenizer:
    """The family's pipeline (normalizer, pre-tokenizer, decoder) around an untrained BPE."""
    tokenizer = Tokenizer(models.BPE())
    if family.nfc_normalize:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(family.pretokenize_regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    if family.add_bos_token and family.bos_token is not None:
        bos = family.bos_token
        bos_id = BPE_VOCAB_SIZE + family.special_tokens.index(bos)
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    else:
        tokenizer.post_processor = byte_level
    return tokenizer


def train_tokenizer(family: TokenizerFamily) -> Tokenizer:
    """Train the BPE on the built-in corpus and append the family's special tokens.

    Deterministic: the initial alphabet is all 256 byte symbols (so symbol ids never depend on hash
    order) and the trainer breaks count ties by pair id.
    """
    tokenizer = _empty_tokenizer(family)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(build_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(
            f"corpus too small: learned {tokenizer.get_vocab_size()} < {BPE_VOCAB_SIZE} tokens"
        )
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in family.special_tokens]
    )
    return tokenizer


def _trained_json(family: TokenizerFamily) -> str:
    # Families that differ only in their chat template (Qwen, Qwen2-Audio) share one training run.
    return _trained_json_cached(dataclasses.replace(family, chat_template="", named_tokens=()))


@functools.cache
def _trained_json_cached(family: TokenizerFamily) -> str:
    # NOTE: trained once per process and family; checkpoints copy it, never share the object.
    return train_tokenizer(family).to_str()


def build_hf_tokenizer(family: TokenizerFamily, model_max_length: int) -> PreTrainedTokenizerBase:
    """The trained tokenizer as the family's transformers class, with chat template and specials."""
    import transformers

    tokenizer_cls = getattr(transformers, family.tokenizer_class)
    special = set(family.special_tokens)
    named = {family.bos_token, family.eos_token, family.pad_token}
    tokenizer = tokenizer_cls(
        tokenizer_object=Tokenizer.from_str(_trained_json(family)),
        bos_token=family.bos_token,
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        unk_token=None,
        extra_special_tokens=[token for token in family.special_tokens if token not in named],
        model_specific_special_tokens=dict(family.named_tokens),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = family.chat_template
    missing = special - set(tokenizer.get_vocab())
    if missing:
        raise RuntimeError(f"special tokens lost while wrapping the tokenizer: {sorted(missing)}")
    return tokenizer
