"""A request's sampling settings that need the tokenizer, resolved in the front end (the engine
core and the workers see token ids only): the checkpoint's other eos ids as stop ids, bad words
as token sequences, the thinking tags of a thinking budget and of a grammar, and the engine's
grammar options (``--structured-outputs-config``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from omniserve.config.structured_outputs import THINK_TAGS, StructuredOutputsConfig
from omniserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class TokenSettings:
    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: list[int],
        architecture: str,
        structured_outputs_config: StructuredOutputsConfig,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.architecture = architecture
        self.structured_outputs_config = structured_outputs_config

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its token-level settings filled in (ValueError naming the field)."""
        if not params.ignore_eos and len(self.eos_token_ids) > 1:
            # Checkpoints often list several eos ids (e.g. <|im_end|> and <|endoftext|>);
            # all of them end generation, as in transformers' generate.
            extra = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
            params = params.clone(stop_token_ids=params.stop_token_ids + extra)
        if params.bad_words:
            params = params.clone(bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        if params.thinking_token_budget is not None:
            params = params.clone(think_token_ids=self._think_token_ids)
        if params.structured_outputs is not None:
            params = self._grammar_settings(params)
        return params

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens alone and after a space (how it reads mid-sentence), as vLLM."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _tag_ids(self, tags: tuple[str, str]) -> tuple[int, int] | None:
        """The ids of the two tags, or None unless each is one token of the vocabulary."""
        ids = [self.tokenizer.encode(tag, add_special_tokens=False) for tag in tags]
        return (ids[0][0], ids[1][0]) if all(len(encoded) == 1 for encoded in ids) else None

    @functools.cached_property
    def _think_token_ids(self) -> tuple[int, int]:
        """The ids of the thinking tags a budget counts between, or ValueError."""
        ids = self._tag_ids(THINK_TAGS)
        if ids is None:
            raise ValueError(
                f"thinking_token_budget: {self.architecture}'s tokenizer has no "
                f"{' and '.join(THINK_TAGS)} tokens, so there is no thinking to bound; omit "
                "thinking_token_budget."
            )
        return ids

    def _grammar_settings(self, params: SamplingParams) -> SamplingParams:
        """The engine's structured-outputs settings on a request's constraint: no optional
        whitespace, and the thinking its grammar waits for."""
        constraint = params.structured_outputs
        assert constraint is not None
        changes: dict[str, Any] = {}
        if self.structured_outputs_config.disable_any_whitespace:
            changes["disable_any_whitespace"] = True
        if self._grammar_think_ids is not None:
            changes["after_thinking"] = self._grammar_think_ids
        elif params.thinking_token_budget is not None:
            raise ValueError(
                "thinking_token_budget does not combine with structured outputs here: the "
                "grammar constrains the whole answer, thinking included, and may not allow the "
                "end tag the budget forces (a --reasoning-parser engine applies grammars after "
                "the thinking)."
            )
        if not changes:
            return params
        return params.clone(structured_outputs=dataclasses.replace(constraint, **changes))

    @functools.cached_property
    def _grammar_think_ids(self) -> tuple[int, int] | None:
        """The ids of the thinking tags grammars wait for (``StructuredOutputsConfig``), or None:
        grammars apply from the first token (also where the tokenizer lacks the tags)."""
        tags = self.structured_outputs_config.thinking_tags
        if tags is None:
            return None
        ids = self._tag_ids(tags)
        if ids is None:
            logger.warning(
                "--reasoning-parser %s: %s's tokenizer has no %s tokens, so grammars apply "
                "from the first token, thinking included.",
                self.structured_outputs_config.reasoning_parser,
                self.architecture,
                " and ".join(tags),
            )
        return ids
