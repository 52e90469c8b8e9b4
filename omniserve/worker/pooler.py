"""Embeddings of embedding requests (``SamplingParams.pooling``) from the prompt's final hidden
states, or a sequence classifier's label scores of them (task "classify"), or either of every
prompt position (the token tasks, pooling "ALL"). LAST reads the prompt's last position, which
the step that samples a request's first token computes (so chunked prefill and prefix-cache
hits need nothing more); MEAN, CLS and ALL read earlier positions too, so each prefill chunk
folds its own into the request's state (such requests take no prefix-cache hit:
``SamplingParams.reads_prompt_states``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from omniserve.config.pooler import DenseModule
from omniserve.sampling_params import PoolingParams
from omniserve.worker.input_batch import InputBatch

Projector = Callable[[torch.Tensor], torch.Tensor]


def load_projector(
    modules: tuple[DenseModule, ...], hidden_size: int, device: torch.device
) -> Projector | None:
    """The checkpoint's sentence-transformers Dense modules as one function of a pooled fp32
    vector (None without any), their weights read from their folders (``model.safetensors``,
    else ``pytorch_model.bin``) and kept in fp32 on ``device``, checked against the model."""
    if not modules:
        return None
    if modules[0].in_features != hidden_size:
        raise ValueError(
            f"{modules[0].path} takes {modules[0].in_features} features but the model's "
            f"hidden states have {hidden_size}."
        )
    layers = []
    for module in modules:
        state = _dense_state(module)
        want: dict[str, tuple[int, ...]] = {
            "linear.weight": (module.out_features, module.in_features)
        }
        if module.bias:
            want["linear.bias"] = (module.out_features,)
        got = {name: tuple(state[name].shape) for name in want if name in state}
        if got != want:
            raise ValueError(f"{module.path}: the weights hold {got}, its config asks {want}.")
        weight = state["linear.weight"].to(device, torch.float32)
        bias = state["linear.bias"].to(device, torch.float32) if module.bias else None
        activation = getattr(torch.nn, module.activation)()
        layers.append((weight, bias, activation))

    def project(vector: torch.Tensor) -> torch.Tensor:
        for weight, bias, activation in layers:
            vector = activation(F.linear(vector, weight, bias))
        return vector

    return project


def _dense_state(module: DenseModule) -> dict[str, torch.Tensor]:
    folder = Path(module.path)
    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{folder} holds no model.safetensors or pytorch_model.bin for its weights.")


def pool_prompts(
    hidden_states: torch.Tensor,
    logits_indices: torch.Tensor,
    batch: InputBatch,
    req_ids: list[str],
    rows: np.ndarray,
    query_lens: np.ndarray,
    positions: np.ndarray,
    sampling: np.ndarray,
    firsts: np.ndarray,
    head: Callable[[torch.Tensor], torch.Tensor],
    project: Projector | None = None,
) -> dict[str, torch.Tensor]:
    """req id -> fp32 embedding (or label scores by the model's ``head``: its
    ``compute_logits``; a row of either per prompt position for the token tasks), on the
    device, for each embedding request among the step's ``sampling`` requests (indices into
    ``req_ids``), whose first sampled position is at ``firsts`` in ``logits_indices``; before
    that, every embedding request's chunk of prompt positions in this step is folded into its
    state. Embeddings go through ``project`` (the checkpoint's Dense modules) before they are
    cut to ``dimensions`` and normalised."""
    if not batch.pools[rows].any():
        return {}
    _fold_chunks(hidden_states, batch, rows, query_lens, positions)
    pooled = {}
    for j in np.flatnonzero(batch.pools[rows[sampling]]).tolist():
        i = int(sampling[j])
        state = batch.states[int(rows[i])]
        assert state is not None and state.sampling_params.pooling is not None
        params = state.sampling_params.pooling
        if params.pooling_type == "MEAN":
            assert state.pool_state is not None
            vector = state.pool_state / state.num_prompt_tokens
        elif params.pooling_type in ("CLS", "ALL"):
            assert state.pool_state is not None
            vector = state.pool_state
        else:
            index = logits_indices[int(firsts[j]) : int(firsts[j]) + 1]
            vector = hidden_states.index_select(0, index)[0].float()
        state.pool_state = None
        block = vector if params.per_token else vector[None]
        if params.task in ("classify", "token_classify"):
            result = _classify(head, block.to(hidden_states.dtype), params)
        else:
            if project is not None:
                block = project(block)
            if params.dimensions is not None:
                block = block[:, : params.dimensions]
            result = F.normalize(block, dim=1) if params.normalize else block
        pooled[req_ids[i]] = result if params.per_token else result[0]
    return pooled


def _classify(
    head: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor, params: PoolingParams
) -> torch.Tensor:
    """The labels' scores of each pooled state (a row each): probabilities (softmax; sigmoid
    for one label, as transformers' pipelines and vLLM take them) unless ``use_activation`` is
    False."""
    scores = head(states).float()
    if not params.use_activation:
        return scores
    return scores.sigmoid() if scores.shape[1] == 1 else scores.softmax(1)


def _fold_chunks(
    hidden_states: torch.Tensor,
    batch: InputBatch,
    rows: np.ndarray,
    query_lens: np.ndarray,
    positions: np.ndarray,
) -> None:
    """Fold each MEAN, CLS or ALL request's prompt positions of this step into its
    ``pool_state`` (a chunk from position 0 starts afresh, as a preempted request's
    recomputation does)."""
    starts = np.cumsum(query_lens) - query_lens
    for i in np.flatnonzero(batch.pools[rows]).tolist():
        state = batch.states[int(rows[i])]
        assert state is not None and state.sampling_params.pooling is not None
        kind = state.sampling_params.pooling.pooling_type
        start = int(starts[i])
        first = int(positions[start]) if query_lens[i] else state.num_prompt_tokens
        count = min(int(query_lens[i]), state.num_prompt_tokens - first)
        if kind == "LAST" or count <= 0:
            continue
        if kind == "CLS":
            if first == 0:
                state.pool_state = hidden_states[start].float()
            continue
        if kind == "ALL":  # a copy: the step's buffers are reused
            states = hidden_states[start : start + count].to(torch.float32, copy=True)
            if first == 0:
                state.pool_state = states
            else:
                assert state.pool_state is not None, "an ALL request's chunk without its first"
                state.pool_state = torch.cat((state.pool_state, states))
            continue
        chunk = hidden_states[start : start + count].sum(0, dtype=torch.float32)
        if first == 0:
            state.pool_state = chunk
        else:
            assert state.pool_state is not None, "a MEAN request's chunk without its first"
            state.pool_state = state.pool_state + chunk
