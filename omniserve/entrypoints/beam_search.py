"""Beam search (vLLM's ``LLM.beam_search`` and ``use_beam_search``), run over the engine one
token at a time, as vLLM runs it.

Each step asks the engine for every live beam's next-token logprobs (a one-token request whose
prompt is the beam's whole text, so the prefix cache holds what beams share), extends each beam
by each of its ``2 x beam_width`` most likely tokens, and keeps the ``beam_width`` best by score;
a beam that writes an end-of-sequence token is set aside as finished. After ``max_tokens`` steps
(or when no beam is left) the best ``beam_width`` of the finished and live beams are the answer.
The score is vLLM's: the cumulative logprob divided by the length (prompt and answer, an end
token not counted) to the power ``length_penalty``. Logprobs are the model's own (before any
sampling setting), so beam search takes no sampling settings.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from omniserve.field_types import check_types
from omniserve.outputs import Logprob, RequestOutput
from omniserve.sampling_params import RequestOutputKind, SamplingParams

# Any length below 2**31 to this power (or its negative) is a finite, non-zero float: 2**±992.
MAX_LENGTH_PENALTY = 32


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    """Treat end-of-sequence tokens as any other (beams then always run max_tokens)."""
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        check_types(self)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
        if not abs(self.length_penalty) <= MAX_LENGTH_PENALTY:  # NaN too
            raise ValueError(
                f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, "
                f"{MAX_LENGTH_PENALTY}] (the score divides by length ** length_penalty), "
                f"got {self.length_penalty}."
            )

    def check_width(self, max_logprobs: int) -> None:
        """Each step asks for ``2 x beam_width`` logprobs, which ``max_logprobs`` bounds (-1:
        no cap but the vocabulary, which the engine checks)."""
        if 0 <= max_logprobs < 2 * self.beam_width:
            raise ValueError(
                f"A beam width of {self.beam_width} needs {2 * self.beam_width} logprobs a step; "
                f"this server gives at most {max_logprobs} (--max-logprobs), so at most "
                f"{max_logprobs // 2} beams."
            )

    def step_params(self) -> SamplingParams:
        """The one-token request of a step: its top ``2 x beam_width`` logprobs."""
        return SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width, ignore_eos=True,
            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip


@dataclass
class BeamSequence:
    tokens: list[int] = field(default_factory=list)
    """The answer's token ids (with the end token, for a beam that wrote one)."""
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    """"stop": it wrote an end-of-sequence token; "length": it reached max_tokens."""
    text: str = ""
    """The answer's text (special tokens skipped), set when the search ends."""


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSequence]
    """The best ``beam_width`` answers, best first."""


class BeamSearch:
    """One prompt's search; a driver runs the engine on ``live`` beams and ``advance``s."""

    def __init__(
        self, params: BeamSearchParams, eos_token_ids: Collection[int], max_model_len: int
    ) -> None:
        self.params = params
        self.max_model_len = max_model_len
        self.prompt_len = 0
        """The prompt's tokens as the model sees them (media placeholders expanded)."""
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.live: list[BeamSequence] = [BeamSequence()]
        self.finished: list[BeamSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return (
            not self.live
            or self.steps >= self.params.max_tokens
            or self.prompt_len + self.steps >= self.max_model_len
        )

    def score(self, beam: BeamSequence) -> float:
        length = self.prompt_len + len(beam.tokens) - (beam.finish_reason == "stop")
        return beam.cum_logprob / (length**self.params.length_penalty)

    def advance(self, next_logprobs: list[dict[int, Logprob]], prompt_len: int) -> None:
        """Extend the live beams (in order) by their next tokens' logprobs."""
        assert len(next_logprobs) == len(self.live), "one logprob dict per live beam"
        self.prompt_len = prompt_len
        grown = []
        for beam, candidates in zip(self.live, next_logprobs, strict=True):
            for token, logprob in candidates.items():
                child = BeamSequence(
                    [*beam.tokens, token],
                    [*beam.logprobs, logprob.logprob],
                    beam.cum_logprob + logprob.logprob,
                )
                if token in self.eos:
                    child.finish_reason = "stop"
                    self.finished.append(child)
                else:
                    grown.append(child)
        self.steps += 1
        self.live = sorted(grown, key=self.score, reverse=True)[: self.params.beam_width]

    def take_step(self, outputs: list[RequestOutput]) -> None:
        """``advance`` by the engine's outputs of a step's requests (one per live beam, in
        order; their prompts are the beams' whole texts)."""
        self.advance(
            [output.outputs[0].logprobs[0] for output in outputs],  # type: ignore[index]
            outputs[0].num_prompt_tokens - len(self.live[0].tokens),
        )

    def result(self, decode: Callable[[list[int]], str]) -> list[BeamSequence]:
        """The best ``beam_width`` of the finished and live beams, best first, their text
        ``decode``d."""
        for beam in self.live:
            beam.finish_reason = "length"
        beams = sorted([*self.finished, *self.live], key=self.score, reverse=True)
        for beam in beams[: self.params.beam_width]:
            beam.text = decode(beam.tokens)
        return beams[: self.params.beam_width]


class BeamSearchBatch:
    """Several prompts' searches stepping together: a step's live beams of every prompt are
    one batch of engine requests (``step_beams``, in order), whose outputs ``take_step`` hands
    back to each search."""

    def __init__(
        self,
        num_prompts: int,
        params: BeamSearchParams,
        eos_token_ids: Collection[int],
        max_model_len: int,
    ) -> None:
        self.searches = [
            BeamSearch(params, eos_token_ids, max_model_len) for _ in range(num_prompts)
        ]
        self.firsts: list[RequestOutput] = []
        """Each prompt's output of the first step (its prompt as the engine saw it)."""

    @property
    def done(self) -> bool:
        return all(search.done for search in self.searches)

    def step_beams(self) -> list[tuple[int, BeamSequence]]:
        """(prompt index, beam) of each request of the next step."""
        return [(i, beam) for i, search in enumerate(self.searches) if not search.done
                for beam in search.live]  # fmt: skip

    def take_step(self, outputs: list[RequestOutput]) -> None:
        """The step's outputs, one per ``step_beams`` entry, in order."""
        remaining = iter(outputs)
        for search in [search for search in self.searches if not search.done]:
            mine = [next(remaining) for _ in search.live]
            search.take_step(mine)
            if len(self.firsts) < len(self.searches):
                self.firsts.append(mine[0])

    def results(self, decode: Callable[[list[int]], str]) -> list[list[BeamSequence]]:
        return [search.result(decode) for search in self.searches]
