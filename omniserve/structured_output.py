"""Structured outputs: a grammar per request, compiled with xgrammar, masking the logits.

The front end only checks a constraint (``validate_structured_outputs``: parsing, no compiling),
so a bad schema or regex is a 400. The engine core compiles it on a thread of its own
(``StructuredOutputManager``; xgrammar caches compiled grammars by their text) while the request
waits outside the scheduler, so no step waits for a compile. Each step the core fills one bitmask
row per constrained request that samples, the runner masks those rows' logits, and the core
advances each request's matcher with the token it got. Constrained and free requests share the
batch; ``n > 1`` children each have their own matcher.

Under ``--reasoning-parser`` a grammar constrains the answer after the thinking
(``StructuredOutputsParams.after_thinking``, vLLM's structured outputs outside reasoning): a
request whose prompt leaves the thinking open samples freely until the end tag; any other may
open it with its first token (the grammar's tokens or the start tag), as the server's reasoning
parser reads answers.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from omniserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from omniserve.config import ModelConfig


def _grammar_source(params: StructuredOutputsParams) -> tuple[str, Any]:
    """(what kind of xgrammar input, the input)."""
    kind = params.kind
    if kind == "choice":  # an alternation of JSON-escaped literals, as EBNF
        assert params.choice is not None
        return "ebnf", "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
    if kind == "json_object":
        return "json_object", None
    return kind, getattr(params, kind)


MAX_SCHEMA_DEPTH = 64
"""The most nested levels (objects and arrays) a JSON schema or structural tag may have: the
grammar's compile time grows with about the cube of the nesting (0.04 s at 64 levels, 14 s at
500, on one core), and compiles queue one after another, so an unbounded one would hold up every
other constrained request. Real schemas nest a few levels (OpenAI's structured outputs allow 10
levels of objects)."""


def _nesting(document: Any) -> int:
    """How deep a parsed JSON document's objects and arrays nest (iteratively: no recursion
    limit to hit)."""
    deepest, pending = 0, [(document, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, depth)
            children = value.values() if isinstance(value, dict) else value
            pending.extend((child, depth + 1) for child in children)
    return deepest


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Parse the constraint (cheap, no tokenizer needed; a schema's nesting bounded by
    ``MAX_SCHEMA_DEPTH``); ValueError naming where the request gave it (``params.where``)."""
    import xgrammar as xgr

    kind, source = _grammar_source(params)
    if kind in ("json", "structural_tag"):
        try:
            depth = _nesting(json.loads(source))
            levels = str(depth)
        except ValueError:
            depth, levels = 0, ""  # not JSON: xgrammar's own error below says so
        except RecursionError:  # deeper than Python's parser goes
            depth, levels = sys.maxsize, f"over {sys.getrecursionlimit()}"
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"{params.where} nests {levels} levels of objects and arrays; at most "
                f"{MAX_SCHEMA_DEPTH} are accepted (compiling deeper ones takes seconds to "
                "minutes)."
            )
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(source)
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind in ("ebnf", "grammar"):
            xgr.Grammar.from_ebnf(source)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(source)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = _XGRAMMAR_LOCATION.sub("", message)  # its log time and C++ source line
        raise ValueError(f"{params.where} is not valid: {message}") from None


_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")


@dataclass
class _Thinking:
    """A request's thinking ahead of its grammar: ``inside`` it, or before its first token (which
    may open it). Dropped once the answer begins."""

    start: int
    end: int
    inside: bool

    @classmethod
    def of_prompt(cls, tags: tuple[int, int], prompt_token_ids: list[int]) -> _Thinking:
        """Inside when the prompt's last thinking tag is the start tag (a thinking template)."""
        start, end = tags
        last = next((t for t in reversed(prompt_token_ids) if t in tags), None)
        return cls(start, end, inside=last == start)


class StructuredOutputManager:
    """The engine core's grammars: compiles them off the busy loop, keeps one matcher per
    request, fills bitmask rows and advances matchers with sampled tokens."""

    def __init__(self, model_config: ModelConfig) -> None:
        """Cheap: the tokenizer, vocabulary and compiler load with the first grammar."""
        self.model_config = model_config
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="omniserve-grammar")
        self.matchers: dict[str, Any] = {}  # req_id -> xgr.GrammarMatcher
        self._thinking: dict[str, _Thinking] = {}  # requests whose answer has not begun

    @functools.cached_property
    def vocab_size(self) -> int:
        """The logits' width (the model's vocabulary, padding included)."""
        return self.model_config.hf_config.get_text_config().vocab_size

    @functools.cached_property
    def _compiler(self) -> Any:
        import xgrammar as xgr

        from omniserve.tokenizer import get_tokenizer

        info = xgr.TokenizerInfo.from_huggingface(
            get_tokenizer(self.model_config.tokenizer), vocab_size=self.vocab_size
        )
        return xgr.GrammarCompiler(info, max_threads=1)

    def compile_async(self, params: StructuredOutputsParams) -> Future[Any]:
        return self._pool.submit(self._compile, params)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError naming ``params.where`` when not one token of the
        vocabulary can start it (it matches no text, as a rule recursing on its left never
        does: the request could only fail at its first token)."""
        import xgrammar as xgr

        compiler = self._compiler
        kind, source = _grammar_source(params)
        any_whitespace = not params.disable_any_whitespace
        if kind == "json":
            compiled = compiler.compile_json_schema(source, any_whitespace=any_whitespace)
        elif kind == "json_object":
            compiled = compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=any_whitespace)  # fmt: skip
        elif kind == "regex":
            compiled = compiler.compile_regex(source)
        elif kind == "structural_tag":
            compiled = compiler.compile_structural_tag(source)
        else:  # EBNF: grammar, choice
            compiled = compiler.compile_grammar(source)
        first = xgr.allocate_token_bitmask(1, self.vocab_size)  # this thread's own
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first, 0)
        if not first.any():
            raise ValueError(
                f"{params.where} matches no text this model can write: no token can start it "
                '(a rule that recurses on its left, such as root ::= root "a", never ends).'
            )
        return compiled

    def start(
        self,
        req_id: str,
        compiled: Any,
        after_thinking: tuple[int, int] | None = None,
        prompt_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        import xgrammar as xgr

        self.matchers[req_id] = xgr.GrammarMatcher(compiled)
        if after_thinking is not None:
            self._thinking[req_id] = _Thinking.of_prompt(after_thinking, list(prompt_token_ids))

    @functools.cached_property
    def _bitmask(self) -> Any:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, words] int32, reused

    def bitmask_row(self, req_id: str) -> bytes | None:
        """The allowed next tokens of ``req_id``, as packed int32 bit words (bit i of word j:
        token 32 j + i); None once its grammar ended with a stop token and the request goes on
        (``ignore_eos``): what follows is free, as in vLLM."""
        matcher = self.matchers[req_id]
        thinking = self._thinking.get(req_id)
        if matcher.is_terminated() or (thinking is not None and thinking.inside):
            return None
        matcher.fill_next_token_bitmask(self._bitmask, 0)
        row = self._bitmask[0].numpy().view(np.uint32)
        if thinking is not None:  # the first token: the grammar's, or the one opening thinking
            row = row.copy()
            row[thinking.start // 32] |= np.uint32(1 << thinking.start % 32)
        return row.tobytes()

    def accept(self, req_id: str, token_ids: list[int]) -> None:
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return
        for token in token_ids:
            if (thinking := self._thinking.get(req_id)) is not None:
                if thinking.inside:
                    if token == thinking.end:
                        del self._thinking[req_id]  # the answer, under the grammar, follows
                    continue
                if token == thinking.start:
                    thinking.inside = True
                    continue
                del self._thinking[req_id]  # the answer began without thinking
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token):
                raise RuntimeError(f"request {req_id} sampled token {token} its grammar forbids")

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self._thinking.pop(req_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def wait_any(futures: list[Future[Any]], timeout: float) -> None:
    """Block until one compile finishes (or ``timeout``): an engine with nothing else to run."""
    concurrent.futures.wait(
        futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
    )


def allowed_by_bitmask(rows: list[bytes], vocab_size: int) -> np.ndarray:
    """Bitmask rows (packed int32 words: bit i of word j is token 32 j + i) -> [len(rows),
    vocab_size] bool, False past the bitmask's vocabulary too."""
    bits = np.unpackbits(np.frombuffer(b"".join(rows), np.uint8), bitorder="little")
    allowed = np.zeros((len(rows), vocab_size), bool)
    known = bits.reshape(len(rows), -1)[:, :vocab_size]
    allowed[:, : known.shape[1]] = known
    return allowed
