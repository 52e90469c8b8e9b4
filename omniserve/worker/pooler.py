"""Embeddings of embedding requests (``SamplingParams.pooling``): the final hidden state at the
prompt's last position, which the step that samples a request's first token computes (so
chunked prefill and prefix-cache hits need nothing more: that position is always computed)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from omniserve.worker.input_batch import InputBatch


def pool_prompts(
    hidden_states: torch.Tensor,
    logits_indices: torch.Tensor,
    batch: InputBatch,
    req_ids: list[str],
    rows: np.ndarray,
    sampling: np.ndarray,
    firsts: np.ndarray,
) -> dict[str, torch.Tensor]:
    """req id -> fp32 embedding (on the device), for each embedding request among the step's
    ``sampling`` requests (indices into ``req_ids``), whose first sampled position is at
    ``firsts`` in ``logits_indices``."""
    pooling = batch.pools[rows[sampling]]
    if not pooling.any():
        return {}
    pooled = {}
    for j in np.flatnonzero(pooling).tolist():
        i = int(sampling[j])
        state = batch.states[int(rows[i])]
        assert state is not None and state.sampling_params.pooling is not None
        params = state.sampling_params.pooling
        index = logits_indices[int(firsts[j]) : int(firsts[j]) + 1]
        vector = hidden_states.index_select(0, index)[0].float()
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        pooled[req_ids[i]] = F.normalize(vector, dim=0) if params.normalize else vector
    return pooled
