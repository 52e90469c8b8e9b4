"""Incremental detokenization and stop strings, in the front end.

Text is produced with the prefix/read-offset technique over the tokenizer's own decoder: each
step decodes a short window (the last emitted token(s) plus the new ones) and emits what the new
tokens added. A window whose text ends in U+FFFD is an unfinished UTF-8 character (byte-level BPE
splits characters across tokens), so nothing is emitted until it completes. When the request
finishes, whatever is still pending is flushed, so the final text equals
``tokenizer.decode(output_ids)`` (modulo prompt context, below).

We do not use ``tokenizers.decoders.DecodeStream``: it cannot flush pending bytes at the end and
has no way to drop spaces between special tokens.

The first output tokens are decoded together with the last prompt tokens, so that decoders that
strip a leading space at the start of a text (Metaspace) or merge across tokens behave as they
would in the full text. Like vLLM, ``clean_up_tokenization_spaces`` is not applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omniserve.sampling_params import SamplingParams

# Prompt tokens decoded along with the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _make_decode(
    tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    """ids -> text, the way ``tokenizer.decode`` would, through the Rust backend when possible.

    With ``spaces_between_special_tokens=False`` added tokens are cut out of the decoder's input and
    joined verbatim with the text around them, so the decoder cannot put spaces around them (HF's
    slow-tokenizer meaning; a byte-level BPE decoder adds none either way).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer

        def decode_slow(ids: list[int]) -> str:
            return tokenizer.decode(
                ids,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )

        return decode_slow
    added = {} if spaces_between_special_tokens else backend.get_added_tokens_decoder()
    if not added:

        def decode_fast(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        return decode_fast

    def decode_segmented(ids: list[int]) -> str:
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            token = added.get(token_id)
            if token is None:
                run.append(token_id)
                continue
            if run:
                parts.append(backend.decode(run, skip_special_tokens=False))
                run = []
            if not (token.special and skip_special_tokens):
                parts.append(token.content)
        if run:
            parts.append(backend.decode(run, skip_special_tokens=False))
        return "".join(parts)

    return decode_segmented


class IncrementalDetokenizer:
    """The output text of one sequence, grown token by token, and its stop-string check."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._decode = _make_decode(
            tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._token_ids = context  # prompt context + every output token fed so far
        self._prefix_offset = 0  # window start: text before it is already emitted
        self._read_offset = len(context)  # tokens before it are reflected in output_text
        self._prefix_text = self._decode(context)
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._max_stop_len = max(map(len, self.stop), default=0)
        # While streaming, hold back a possible stop-string prefix so it is never shown and
        # then taken back.
        self.stop_buffer_length = (
            self._max_stop_len - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self.stopped = False
        """A stop string matched: the text is final (a speaking request keeps receiving audio
        after it, and no more tokens)."""

    def update(
        self, new_token_ids: list[int], stop_terminated: bool, finished: bool = False
    ) -> str | None:
        """Add the step's tokens; return the stop string that matched, if any.

        ``stop_terminated``: the engine stopped on the last token (eos or a stop token id), whose
        text is left out unless ``include_stop_str_in_output``. ``finished``: no more tokens will
        come, so pending incomplete characters are flushed.
        """
        if self.stopped:
            return None
        self.num_output_tokens += len(new_token_ids)
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        old_len = len(self.output_text)
        self.output_text += self._decode_tokens(new_token_ids)
        stop_string = None
        # Like vLLM, stop strings count only once min_tokens tokens have been generated.
        if self.stop and self.num_output_tokens > self.min_tokens:
            stop_string = self._check_stop_strings(old_len)
            self.stopped = stop_string is not None
        if finished and stop_string is None:
            self.output_text += self._flush()
        return stop_string

    def visible_text_length(self, finished: bool) -> int:
        """How much of ``output_text`` may be shown now (all of it once final)."""
        if finished or self.stopped or not self.stop_buffer_length:
            return len(self.output_text)
        return max(len(self.output_text) - self.stop_buffer_length, 0)

    def _decode_tokens(self, new_token_ids: list[int]) -> str:
        pieces: list[str] = []
        for token_id in new_token_ids:
            self._token_ids.append(token_id)
            text = self._decode(self._token_ids[self._prefix_offset :])
            if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT_CHAR):
                pieces.append(text[len(self._prefix_text) :])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._token_ids)
                self._prefix_text = self._decode(self._token_ids[self._prefix_offset :])
        return "".join(pieces)

    def _flush(self) -> str:
        """Text of tokens held back as incomplete characters (they never completed)."""
        if self._read_offset == len(self._token_ids):
            return ""
        text = self._decode(self._token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return text[len(self._prefix_text) :]

    def _check_stop_strings(self, old_len: int) -> str | None:
        """Find the earliest stop string that ends in the new text; truncate the text there.

        Only a match ending after ``old_len`` is new, so each stop string is searched from
        ``old_len - len(stop) + 1`` on.
        """
        text = self.output_text
        if len(text) == old_len:
            return None
        best_start, best_stop = -1, None
        for stop in self.stop:
            start = text.find(stop, max(old_len - len(stop) + 1, 0))
            if start != -1 and (best_stop is None or start < best_start):
                best_start, best_stop = start, stop
        if best_stop is None:
            return None
        end = best_start + len(best_stop) if self.include_stop_str_in_output else best_start
        self.output_text = text[:end]
        return best_stop


class TokenTexts:
    """Token id -> its own decoded text (``Logprob.decoded_token``), cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._cache: dict[int, str] = {}

    def __call__(self, token_ids: list[int]) -> list[str]:
        cache = self._cache
        missing = list({t for t in token_ids if t not in cache})
        if missing:
            if self._backend is not None:
                texts = self._backend.decode_batch(
                    [[t] for t in missing], skip_special_tokens=False
                )
            else:
                texts = [self._tokenizer.decode([t]) for t in missing]
            cache.update(zip(missing, texts, strict=True))
        return [cache[t] for t in token_ids]
