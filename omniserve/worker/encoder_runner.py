"""The multimodal half of a step: run scheduled encoder inputs, keep their outputs, and hand the
decoder the embedding slices its tokens need.

Encoder outputs live in ``encoder_cache`` keyed by item identifier, shared by every request that
holds the same item; the scheduler's EncoderCacheManager decides what is computed and what is
dropped (``free_encoder_mm_hashes``), so this cache and its bookkeeping agree exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from omniserve.core.sched_output import SchedulerOutput
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.transfers import host_to_device


def to_device(data: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    if data is None:
        raise RuntimeError("A scheduled encoder input carries no data.")
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data.items()}


class EncoderRunner:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.encoder_cache: dict[str, torch.Tensor] = {}  # identifier -> [num_embeds, hidden]

    def free(self, identifiers: Iterable[str]) -> None:
        for identifier in identifiers:
            self.encoder_cache.pop(identifier, None)

    def execute(
        self, so: SchedulerOutput, features_of: dict[str, list[MultiModalFeatureSpec]]
    ) -> None:
        """Encode this step's scheduled items, batched per modality, into the encoder cache."""
        by_modality: dict[str, list[MultiModalFeatureSpec]] = {}
        queued: set[str] = set()
        for req_id, indices in so.scheduled_encoder_inputs.items():
            for index in indices:
                feature = features_of[req_id][index]
                if feature.identifier in self.encoder_cache or feature.identifier in queued:
                    continue
                queued.add(feature.identifier)
                by_modality.setdefault(feature.modality, []).append(feature)
        for modality, all_features in by_modality.items():
            key = f"{modality}_embeds"  # precomputed (--enable-mm-embeds): no encoder to run
            given = [f for f in all_features if f.data is not None and key in f.data]
            features = [f for f in all_features if f.data is None or key not in f.data]
            outputs = (
                self.model.get_multimodal_embeddings(
                    modality, [to_device(f.data, self.device) for f in features]
                )
                if features
                else []
            )
            if len(outputs) != len(features):
                raise RuntimeError(
                    f"The {modality} encoder returned {len(outputs)} outputs for "
                    f"{len(features)} items."
                )
            dtype = next(self.model.parameters()).dtype
            outputs = [*outputs, *((f.data or {})[key].to(self.device, dtype) for f in given)]
            for feature, output in zip([*features, *given], outputs, strict=True):
                if output.shape[0] != feature.mm_position.num_embeds:
                    raise RuntimeError(
                        f"The {modality} encoder produced {output.shape[0]} embeddings for an item "
                        f"with {feature.mm_position.num_embeds} placeholder embeddings."
                    )
                self.encoder_cache[feature.identifier] = output

    def gather(
        self,
        windows: list[tuple[int, int]],
        features: list[list[MultiModalFeatureSpec]],
        num_tokens: int,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The embeddings each request's window ``[start, end)`` consumes, in flattened-token
        order, and the mask of the flattened positions they replace."""
        is_mm = np.zeros(num_tokens, dtype=bool)
        pieces: list[torch.Tensor] = []
        flat_start = 0
        for (start, end), request_features in zip(windows, features, strict=True):
            for feature in request_features:
                pos = feature.mm_position
                if pos.offset >= end or pos.end <= start:
                    continue
                lo, hi = pos.embeds_in(start, end)
                a, b = max(start, pos.offset), min(end, pos.end)
                if pos.is_embed is None:
                    is_mm[flat_start + a - start : flat_start + b - start] = True
                else:
                    mask = np.asarray(pos.is_embed[a - pos.offset : b - pos.offset], dtype=bool)
                    is_mm[flat_start + a - start : flat_start + b - start] |= mask
                if hi > lo:
                    cached = self.encoder_cache.get(feature.identifier)
                    if cached is None:
                        raise RuntimeError(
                            f"Encoder output {feature.identifier} is missing: the "
                            "scheduler and the worker disagree."
                        )
                    pieces.append(cached[lo:hi])
            flat_start += end - start
        if not pieces:
            return None, None
        return torch.cat(pieces), host_to_device(is_mm, self.device)


def mrope_positions(
    positions: np.ndarray,
    query_lens: np.ndarray,
    deltas: np.ndarray,
    num_prompt: np.ndarray,
    prompt_positions: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """M-RoPE positions ``[3, num_tokens]`` of a step's tokens (``positions``, grouped per request
    by ``query_lens``): a generated token sits at ``p + delta`` on all three axes; only tokens of
    a prompt window (below the request's ``num_prompt``) read its precomputed, media-shaped
    ``prompt_positions [3, prompt_len]``."""
    shifted = positions + np.repeat(deltas, query_lens)
    out = np.repeat(shifted[None], 3, axis=0)
    starts = np.cumsum(query_lens) - query_lens
    for i in np.flatnonzero(positions[starts] < num_prompt).tolist():
        first = int(positions[starts[i]])
        end = min(first + int(query_lens[i]), int(num_prompt[i]))
        prompt = prompt_positions[i]
        assert prompt is not None  # a request with prompt tokens to compute has its positions
        out[:, starts[i] : starts[i] + end - first] = prompt[:, first:end].numpy()
    return torch.from_numpy(out)
