"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

The vocabulary is padded up to a multiple of the TP size; rank r owns rows
``[r * per_rank, (r + 1) * per_rank)``. Padding rows are zero and their logits are cut off after
the gather, so with one rank the weight has exactly the checkpoint's shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniserve.layers.linear import LinearBase
from omniserve.layers.tp import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from omniserve.layers.weight_utils import LoadedWeight, copy_weight, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    """``embed_tokens``: each rank looks up its own rows; other ranks contribute zeros."""

    output_dtype: torch.dtype | None = None
    """The activations' dtype where the weight is kept in another (a bf16 checkpoint computed
    in fp32 keeps its bf16 weights: ``cpu.backend.keep_bf16_weights``): rows are cast to it."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim))
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"Shape mismatch: expected ({self.num_embeddings}, "
                f"{self.embedding_dim}), got {tuple(loaded.shape)}."
            )
        num_rows = self.vocab_end - self.vocab_start
        copy_weight(param.data[:num_rows], loaded, 0, self.vocab_start)
        param.data[num_rows:].zero_()

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the rows it returns."""
        return self.weight.dtype if self.output_dtype is None else self.output_dtype

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        embeds = F.embedding(ids, self.weight)
        return embeds if self.output_dtype is None else embeds.to(self.output_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)  # [num_tokens, embedding_dim]
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        embeds = self._lookup(local_ids)
        return tp_all_reduce(embeds * owned.unsqueeze(-1).to(embeds.dtype))


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """``lm_head``: hidden states -> logits over the full vocabulary (may share the embedding)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.apply_linear(hidden_states, None)  # [num_tokens, vocab_per_partition]
        if self.tp_size == 1:
            return logits
        return tp_all_gather(logits, dim=-1)[..., : self.num_embeddings]
