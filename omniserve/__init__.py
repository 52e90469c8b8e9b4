"""omniserve: serve multimodal ("omni") models behind an OpenAI-compatible API.

The public names are resolved lazily (PEP 562) so that importing a torch-free submodule such as
``omniserve.core.scheduler`` does not pull in torch through this package's ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from omniserve.logger import configure_logging

__version__ = "0.1.0"

configure_logging()

_LAZY = {
    "LLM": "omniserve.entrypoints.llm",
    "SamplingParams": "omniserve.sampling_params",
    "PoolingParams": "omniserve.sampling_params",
    "BeamSearchParams": "omniserve.entrypoints.beam_search",
    "RequestOutput": "omniserve.outputs",
    "CompletionOutput": "omniserve.outputs",
    "EmbeddingRequestOutput": "omniserve.outputs",
    "PoolingRequestOutput": "omniserve.outputs",
    "ScoringRequestOutput": "omniserve.outputs",
    "EngineArgs": "omniserve.engine.arg_utils",
    "LLMEngine": "omniserve.engine.llm_engine",
}

__all__ = [
    "__version__",
    "LLM",
    "SamplingParams",
    "PoolingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "PoolingRequestOutput",
    "ScoringRequestOutput",
    "EngineArgs",
    "LLMEngine",
]

if TYPE_CHECKING:
    from omniserve.engine.arg_utils import EngineArgs
    from omniserve.engine.llm_engine import LLMEngine
    from omniserve.entrypoints.beam_search import BeamSearchParams
    from omniserve.entrypoints.llm import LLM
    from omniserve.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from omniserve.sampling_params import PoolingParams, SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omniserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
