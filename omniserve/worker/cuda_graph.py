"""Decode steps replayed from captured CUDA graphs.

A decode step's work depends on its batch size alone (one token per request; where each one's
keys live is data in the block table), so the model forward is captured once per size of a
ladder at start-up and replayed with each step's inputs copied into static buffers. A batch
pads to the next captured size with rows that write no cache slot (``PAD_SLOT``) and attend a
single key; their outputs are dropped. Prefill chunks, mixed steps, steps with encoder inputs,
batches beyond the ladder and attention backends that plan on the host per step (torch, CPU)
run eagerly; logits and sampling always do (their shapes follow what each request asks for).

Per-step plans a backend derives from the metadata (the Triton backend's tiles) are made by a
warm-up forward before each capture and live on that size's static metadata, which is kept with
its graph: the graph reads those tensors by address, so they must live as long as it does. Where
CUDA is absent (the Triton interpreter on CPU, in tests), the "graph" replays the recorded call
on the same static buffers, which checks everything but the capture itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from omniserve.attention.metadata import AttentionMetadata
from omniserve.forward_context import set_forward_context

PAD_SLOT = -1
"""Cache slot of a padding row: the store kernel skips it."""
MAX_GRAPH_BATCH = 512
"""Largest batch captured; bigger decode batches are rare and gain little (launches are
amortised over many rows)."""


def graph_batch_sizes(
    max_num_seqs: int, requested: Sequence[int] = (), max_size: int | None = None
) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8 up to the batch limit (or
    ``max_size``); ``requested``: the sizes instead (those a batch can reach)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    if requested:
        return sorted({size for size in requested if size <= top})
    if max_size is not None:
        top = min(top, max_size)
    sizes = [size for size in (1, 2, 4) if size <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_batch_size(sizes: list[int], num_reqs: int) -> int | None:
    """The captured size a batch of ``num_reqs`` decodes runs at (None: beyond the ladder)."""
    index = bisect.bisect_left(sizes, num_reqs)
    return sizes[index] if index < len(sizes) else None


class _Replay:
    """Stand-in for ``torch.cuda.CUDAGraph`` where there is no CUDA: runs the recorded call."""

    def __init__(self, fn: Callable[[], torch.Tensor], metadata: AttentionMetadata) -> None:
        self.fn, self.metadata = fn, metadata
        self.output = self.replay()

    def replay(self) -> torch.Tensor:
        with set_forward_context(self.metadata):
            self.output = self.fn()
        return self.output


class DecodeGraphs:
    """Captured decode forwards, one per batch size, over shared static input buffers."""

    def __init__(self, model: nn.Module, sizes: list[int], max_blocks_per_req: int,
                 device: torch.device, uses_mrope: bool) -> None:  # fmt: skip
        self.model = model
        self.sizes = sizes
        self.device = device
        top = sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, top) if uses_mrope else (top,), dtype=torch.long,
                                     device=device)  # fmt: skip
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(top, max_blocks_per_req, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((top,), PAD_SLOT, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | _Replay, torch.Tensor]] = {}
        self.metadata: dict[int, AttentionMetadata] = {}
        """Each size's static metadata: its plans are the graph's inputs."""
        self.num_replays = 0

    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool)."""
        pool = None
        for size in reversed(self.sizes):
            metadata = AttentionMetadata(
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
                block_table=self.block_table[:size],
                slot_mapping=self.slot_mapping[:size],
                query_lens_cpu=[1] * size,
                seq_lens_cpu=[1] * size,
            )
            self.metadata[size] = metadata

            def forward(size: int = size) -> torch.Tensor:
                return self.model(self.input_ids[:size], self.positions[..., :size])

            if self.device.type != "cuda":
                replay = _Replay(forward, metadata)
                self._graphs[size] = (replay, replay.output)
                continue
            with set_forward_context(metadata):
                forward()  # compiles kernels and leaves the backends' plans on ``metadata``
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = forward()
            pool = graph.pool() if pool is None else pool
            self._graphs[size] = (graph, output)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor | None:  # fmt: skip
        """Hidden states ``[num_reqs, hidden]`` of a decode-only step, or None when no captured
        size holds it. ``metadata`` is the step's own (one query token per request)."""
        num_reqs = metadata.num_reqs
        size = padded_batch_size(self.sizes, num_reqs)
        if size is None:
            return None
        graph, output = self._graphs[size]
        self.input_ids[:num_reqs].copy_(input_ids)
        self.input_ids[num_reqs:size].zero_()
        self.positions[..., :num_reqs].copy_(positions)
        self.positions[..., num_reqs:size].zero_()
        self.seq_lens[:num_reqs].copy_(metadata.seq_lens)
        self.seq_lens[num_reqs:size].fill_(1)
        width = metadata.block_table.shape[1]
        self.block_table[:num_reqs, :width].copy_(metadata.block_table)
        self.block_table[num_reqs:size].zero_()
        self.slot_mapping[:num_reqs].copy_(metadata.slot_mapping)
        self.slot_mapping[num_reqs:size].fill_(PAD_SLOT)
        graph.replay()
        self.num_replays += 1
        if isinstance(graph, _Replay):
            output = graph.output
        return output[:num_reqs]
