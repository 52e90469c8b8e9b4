"""What the offline and async APIs return, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Self, TypeVar

import numpy as np
import torch

PooledT = TypeVar("PooledT")


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled/actual token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """"stop", "length", "abort", or "error" (the engine failed on this request, or its rules
    left no token to sample; only offline: the server answers such a request with a 500, or a
    400 when its rules caused it); None while running."""
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    audio: np.ndarray | None = None
    """Spoken answer of an audio-output request: float32 mono samples in [-1, 1] at the model's
    ``SpeechConfig.sample_rate``; shaped by ``output_kind`` like the text (DELTA: the samples
    new since the last output, which may be none). None for text-only requests."""
    num_audio_tokens: int = 0
    """Codec frames spoken so far (what usage counts as audio tokens)."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its (partial or final) outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    """None when the prompt was given as embeddings (``num_prompt_embeds`` rows)."""
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    num_mm_tokens: dict[str, int] = field(default_factory=dict)
    """Prompt tokens that stand for each modality's items (image, audio, video)."""
    num_prompt_embeds: int = 0
    """Rows of a prompt given as embeddings (0 for a prompt of tokens)."""
    pooled: np.ndarray | None = None
    """A pooling request's result (float32; ``SamplingParams.pooling``), once finished: one
    vector, or a row per prompt position for the token tasks."""

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length in positions, however it was given."""
        ids = self.prompt_token_ids
        return len(ids) if ids is not None else self.num_prompt_embeds


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (``LLM.embed``)."""

    embedding: list[float]

    @classmethod
    def of(cls, pooled: np.ndarray) -> EmbeddingOutput:
        return cls(pooled.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """One prompt's label scores (``LLM.classify``): probabilities unless the request asked for
    raw scores."""

    probs: list[float]

    @classmethod
    def of(cls, pooled: np.ndarray) -> ClassificationOutput:
        return cls(pooled.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class PoolingOutput:
    """One prompt's raw pooling result (``LLM.encode``): a vector for the embed and classify
    tasks, ``[positions, width]`` for the token tasks (vLLM's ``PoolingOutput``)."""

    data: torch.Tensor

    @classmethod
    def of(cls, pooled: np.ndarray) -> PoolingOutput:
        return cls(torch.from_numpy(pooled))


@dataclass
class PoolingRequestOutput(Generic[PooledT]):
    """What ``LLM.encode``, ``LLM.embed`` and ``LLM.classify`` return per prompt, shaped like
    vLLM's; a subclass names the type of its ``outputs`` (``result_type``), made of the pooled
    values by its ``of``."""

    request_id: str
    outputs: PooledT
    prompt_token_ids: list[int] | None
    finished: bool = True
    num_cached_tokens: int = 0
    num_prompt_embeds: int = 0
    result_type: ClassVar[Any]

    @classmethod
    def from_output(cls, output: RequestOutput) -> Self:
        """The pooling request's finished output; an engine failure on it raises."""
        if output.pooled is None:
            reason = output.outputs[0].finish_reason if output.outputs else None
            raise RuntimeError(f"Request {output.request_id} ended without its result ({reason}).")
        return cls(
            output.request_id,
            cls.result_type.of(output.pooled),
            output.prompt_token_ids,
            output.finished,
            output.num_cached_tokens,
            output.num_prompt_embeds,
        )


class EncodingRequestOutput(PoolingRequestOutput[PoolingOutput]):
    result_type = PoolingOutput


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    result_type = EmbeddingOutput


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    result_type = ClassificationOutput


@dataclass
class ScoringOutput:
    """A pair's score (``LLM.score``): the cosine similarity of the two prompts' embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair, shaped like vLLM's: the two prompts' token ids end
    to end, and a request id joining the two embedding requests'."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int] | None
    finished: bool = True

    @classmethod
    def from_embeddings(
        cls, first: EmbeddingRequestOutput, second: EmbeddingRequestOutput
    ) -> ScoringRequestOutput:
        a = np.asarray(first.outputs.embedding, dtype=np.float64)
        b = np.asarray(second.outputs.embedding, dtype=np.float64)
        score = float(a @ b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-8)
        ids = (
            first.prompt_token_ids + second.prompt_token_ids
            if first.prompt_token_ids is not None and second.prompt_token_ids is not None
            else None
        )
        return cls(f"{first.request_id}_{second.request_id}", ScoringOutput(score), ids)
