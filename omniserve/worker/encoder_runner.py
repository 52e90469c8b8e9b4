"""The multimodal half of a step: run scheduled encoder inputs, keep their outputs, and hand the
decoder the embedding slices its tokens need.

Encoder outputs live in ``encoder_cache`` keyed by item identifier, shared by every request that
holds the same item; the scheduler's EncoderCacheManager decides what is computed and what is
dropped (``free_encoder_mm_hashes``), so this cache and its bookkeeping agree exactly.

A video pruned by ``--video-pruning-rate`` is encoded whole, then cut to the rows it keeps
(``omniserve.multimodal.pruning``; a soundtrack interleaved with it keeps all of its own), which
are noted beside its output (``kept_rows``, freed with it): its tokens' M-RoPE positions are
those rows' (``lay_out_positions``), so choosing them reads the encoder's output back to the
host, one wait for the device per pruned video. Every rank chooses from the same output (encoded
alike, or gathered), so the ranks keep the same rows.

Under tensor parallelism every rank holds the whole towers. By default each rank encodes every
item; with vLLM's ``--mm-encoder-tp-mode data`` (``split_items``) the ranks split a step's items
of a modality between them, balanced by embeddings (the same split on every rank, which all see
the same scheduler output), and gather the outputs, so each holds all of them as if it had
encoded them itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from omniserve.core.sched_output import SchedulerOutput
from omniserve.layers.tp import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from omniserve.multimodal.inputs import EncoderItem, MultiModalFeatureSpec
from omniserve.multimodal.pruning import VideoPruning
from omniserve.transfers import host_to_device, upload
from omniserve.worker.input_batch import CachedRequestState


def to_device(items: list[dict[str, Any] | None], device: torch.device) -> list[EncoderItem]:
    """The items' tensors on ``device`` in one pinned copy (``upload``: a pageable copy would
    wait for the step in flight), each item keeping its host data for the encoder's metadata."""
    if any(data is None for data in items):
        raise RuntimeError("A scheduled encoder input carries no data.")
    hosts: list[dict[str, Any]] = items  # type: ignore[assignment]
    keys = [(i, k) for i, data in enumerate(hosts)
            for k, v in data.items() if isinstance(v, torch.Tensor)]  # fmt: skip
    moved = upload(device, [hosts[i][k] for i, k in keys])
    out = [EncoderItem(data, host=data) for data in hosts]
    for (i, k), tensor in zip(keys, moved, strict=True):
        out[i][k] = tensor
    return out


def balanced_owners(sizes: list[int], num_ranks: int) -> list[int]:
    """The rank that encodes each item: largest first, each to the least loaded rank (the
    lowest of equals), so every rank computes the same split."""
    loads = [0] * num_ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owners[i] = min(range(num_ranks), key=lambda r: loads[r])
        loads[owners[i]] += sizes[i]
    return owners


class EncoderRunner:
    def __init__(self, model: nn.Module, device: torch.device, split_items: bool = False) -> None:
        self.model = model
        self.device = device
        self.split_items = split_items and get_tp_size() > 1
        self.encoder_cache: dict[str, torch.Tensor] = {}  # identifier -> [num_embeds, hidden]
        self.kept_rows: dict[str, torch.Tensor] = {}  # a pruned video's identifier -> its rows
        self.prunes_video = bool(getattr(model, "video_pruning_rate", 0.0))

    def free(self, identifiers: Iterable[str]) -> None:
        for identifier in identifiers:
            self.encoder_cache.pop(identifier, None)
            self.kept_rows.pop(identifier, None)

    def clear(self) -> None:
        self.encoder_cache.clear()
        self.kept_rows.clear()

    def _pruning(self, feature: MultiModalFeatureSpec) -> VideoPruning | None:
        return self.model.video_pruning(feature) if self.prunes_video else None

    def _rows(self, feature: MultiModalFeatureSpec) -> int:
        """Rows the encoder outputs for the item (a pruned video's before pruning)."""
        pruning = self._pruning(feature)
        dropped = pruning.num_rows - pruning.num_kept if pruning is not None else 0
        return feature.mm_position.num_embeds + dropped

    def _prune(self, feature: MultiModalFeatureSpec, output: torch.Tensor) -> torch.Tensor:
        """A pruned video's output without the video rows it drops (the kept ones, as indices
        into the video's tokens, noted in ``kept_rows``; a soundtrack's rows all stay); any other
        item's as it is."""
        pruning = self._pruning(feature)
        if pruning is None:
            return output
        video_rows = self.model.pruned_video_rows(feature)  # None: every row is the video's
        if video_rows is None:
            kept = pruning.kept_rows(output)
            self.kept_rows[feature.identifier] = kept
            return output.index_select(0, kept.to(output.device))
        rows = torch.from_numpy(video_rows)
        kept = pruning.kept_rows(output.index_select(0, rows.to(output.device)))
        self.kept_rows[feature.identifier] = kept
        keep = torch.ones(output.shape[0], dtype=torch.bool)
        keep[rows] = False
        keep[rows[kept]] = True
        return output.index_select(0, keep.nonzero().squeeze(1).to(output.device))

    def lay_out_positions(self, state: CachedRequestState) -> None:
        """The request's M-RoPE prompt positions and delta; a pruned video's tokens at its kept
        rows' positions where they are known, else at stand-ins (``mrope_stand_ins``) until
        it is encoded (the runner then lays the prompt out again)."""
        if not self.prunes_video:
            state.mrope_positions, state.mrope_delta = self.model.get_mrope_input_positions(
                state.prompt_token_ids, state.mm_features
            )
            return
        state.mrope_positions, state.mrope_delta = self.model.get_mrope_input_positions(
            state.prompt_token_ids, state.mm_features, self.kept_rows
        )
        state.mrope_stand_ins = {
            f.identifier for f in state.mm_features
            if f.identifier not in self.kept_rows and self._pruning(f) is not None
        }  # fmt: skip

    def place_window(self, state: CachedRequestState, start: int, end: int) -> None:
        """Before the prompt window ``[start, end)`` runs: lay the prompt out again where a
        pruned video standing in has been encoded since; one whose embedding tokens the window
        reaches must have been (the scheduler encodes an item before they run)."""
        if state.mrope_stand_ins & self.kept_rows.keys():
            self.lay_out_positions(state)
        for feature in state.mm_features:
            lo, hi = feature.mm_position.embeds_in(start, end)  # (its markers need no rows)
            if feature.identifier in state.mrope_stand_ins and hi > lo:
                raise RuntimeError(
                    f"Pruned video {feature.identifier} runs before it is encoded: the "
                    "scheduler and the worker disagree."
                )

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
        dtype = next(self.model.parameters()).dtype
        for modality, all_features in by_modality.items():
            key = f"{modality}_embeds"  # precomputed (--enable-mm-embeds): no encoder to run
            features = [f for f in all_features if f.data is None or key not in f.data]
            given = [f for f in all_features if f.data is not None and key in f.data]
            items = to_device([f.data for f in [*features, *given]], self.device)
            if self.split_items and len(features) > 1:
                outputs = self._encode_split(modality, features, items[: len(features)], dtype)
            elif features:
                outputs = self.model.get_multimodal_embeddings(modality, items[: len(features)])
            else:
                outputs = []
            if len(outputs) != len(features):
                raise RuntimeError(
                    f"The {modality} encoder returned {len(outputs)} outputs for "
                    f"{len(features)} items."
                )
            outputs = [self._prune(f, out) for f, out in zip(features, outputs, strict=True)]
            outputs = [*outputs, *(item[key].to(dtype) for item in items[len(features) :])]
            for feature, output in zip([*features, *given], outputs, strict=True):
                if output.shape[0] != feature.mm_position.num_embeds:
                    raise RuntimeError(
                        f"The {modality} encoder produced {output.shape[0]} embeddings for an item "
                        f"with {feature.mm_position.num_embeds} placeholder embeddings."
                    )
                self.encoder_cache[feature.identifier] = output

    def _encode_split(
        self,
        modality: str,
        features: list[MultiModalFeatureSpec],
        items: list[EncoderItem],
        dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        """This rank's share of the items encoded, every rank's gathered: each rank's outputs
        padded to the largest share's rows, one all-gather; the width (the same for a modality's
        items) from the ranks that encoded any."""
        rank, num_ranks = get_tp_rank(), get_tp_size()
        sizes = [self._rows(f) for f in features]
        owners = balanced_owners(sizes, num_ranks)
        mine = [i for i, owner in enumerate(owners) if owner == rank]
        share = [items[i] for i in mine]  # (more ranks than items: some encode none)
        local = self.model.get_multimodal_embeddings(modality, share) if share else []
        if len(local) != len(mine):
            raise RuntimeError(f"The {modality} encoder returned {len(local)} outputs for "
                               f"{len(mine)} items.")  # fmt: skip
        shares = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r)
                  for r in range(num_ranks)]  # fmt: skip
        width = torch.tensor([local[0].shape[1] if local else 0], device=self.device)
        encoding = sum(share > 0 for share in shares)
        width_all = int(tp_all_reduce(width).item()) // encoding
        rows = max(shares)
        padded = torch.zeros(rows, width_all, dtype=dtype, device=self.device)
        if local:
            stacked = torch.cat([out.to(dtype) for out in local])
            padded[: stacked.shape[0]] = stacked
        gathered = tp_all_gather(padded, dim=0).view(num_ranks, rows, width_all)
        offsets = [0] * num_ranks
        outputs = []
        for size, owner in zip(sizes, owners, strict=True):
            # (a copy: the cache keeps it, not the whole padded buffer)
            outputs.append(gathered[owner, offsets[owner] : offsets[owner] + size].clone())
            offsets[owner] += size
        return outputs

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
        # Checked here, on the host: the merge takes the count as given (``nonzero_static``).
        num_rows = sum(piece.shape[0] for piece in pieces)
        if num_rows != int(is_mm.sum()):
            raise RuntimeError(
                f"{num_rows} multimodal embeddings for {int(is_mm.sum())} masked positions."
            )
        return torch.cat(pieces), host_to_device(is_mm, self.device)


def prompt_embeds_rows(
    starts: np.ndarray,
    query_lens: np.ndarray,
    given: Sequence[list[tuple[int, torch.Tensor]]],
) -> tuple[torch.Tensor | None, np.ndarray]:
    """The given embedding rows (``given``: each request's runs, as (first position, rows))
    that each request's window of ``query_lens`` positions from ``starts`` reads, and their
    indices in the step's flattened tokens; (None, empty) when no window reaches a run."""
    pieces: list[torch.Tensor] = []
    indices: list[np.ndarray] = []
    flat_starts = np.cumsum(query_lens) - query_lens
    for start, count, flat, runs in zip(starts.tolist(), query_lens.tolist(),
                                        flat_starts.tolist(), given, strict=True):  # fmt: skip
        for at, rows in runs:
            lo, hi = max(start, at), min(start + count, at + len(rows))
            if lo < hi:
                pieces.append(rows[lo - at : hi - at])
                indices.append(np.arange(flat + lo - start, flat + hi - start))
    if not pieces:
        return None, np.zeros(0, np.int64)
    return torch.cat(pieces), np.concatenate(indices)


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
