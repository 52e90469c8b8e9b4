"""The worker's persistent batch: per-request state kept across steps, updated by deltas.

Consecutive steps share most requests, so token ids, block tables and sampling knobs live in
preallocated numpy rows (one row per request) that each step indexes, instead of being rebuilt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from omniserve.lora.request import LoRARequest
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.sampling_params import SamplingParams


@dataclass
class ThinkingSpan:
    """A thinking budget's account (``SamplingParams.thinking_token_budget``): whether the
    request is inside ``<think>…</think>`` and how many tokens it has generated there."""

    start: int
    end: int
    budget: int
    inside: bool = False
    spent: int = 0

    def advance(self, token: int, generated: bool = True) -> None:
        if self.inside and token == self.end:
            self.inside = False
        elif token == self.start:
            self.inside, self.spent = True, 0
        elif self.inside and generated:
            self.spent += 1

    def must_close(self, ahead: list[int]) -> bool:
        """Whether the next token, after ``ahead`` (drafts not yet kept), must be the end tag."""
        span = dataclasses.replace(self)
        for token in ahead:
            span.advance(token)
        return span.inside and span.spent >= span.budget


@dataclass(eq=False)
class CachedRequestState:
    """The worker's copy of one running request."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None  # [3, num_prompt_tokens] for M-RoPE models
    mrope_delta: int = 0  # a generated token at position p sits at p + delta on all axes
    mrope_stand_ins: set[str] = field(default_factory=set)
    """Pruned videos (by identifier) whose tokens' positions stand in until they are encoded."""
    lora_request: LoRARequest | None = None
    prompt_embeds: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(first position, ``[n, hidden]`` rows) of each run of the prompt given as embeddings,
    fed in place of its placeholder ids' embeddings; the rows in the model's dtype, on the
    host."""
    pool_state: torch.Tensor | None = None
    """An embedding request's pooling so far (``worker/pooler.py``), fp32 on the device: MEAN's
    sum of the final states of the prompt positions computed, CLS's first position's."""
    thinking: ThinkingSpan | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        params = self.sampling_params
        if params.thinking_token_budget is None or params.think_token_ids is None:
            return
        self.thinking = ThinkingSpan(*params.think_token_ids, params.thinking_token_budget)
        for token in self.prompt_token_ids:  # a thinking template leaves the span open
            self.thinking.advance(token, generated=False)
        for token in self.output_token_ids:  # a resumed request's
            self.thinking.advance(token)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputBatch:
    """Rows of request state. Rows are reused after a request leaves; no condensing needed
    because every step addresses its requests by an explicit row index array."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # The end of the last prompt run given as embeddings (the state's prompt_embeds; 0: none).
        self.prompt_embeds_end = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Embedding requests: their step that samples also returns the prompt's pooled state.
        self.pools = np.zeros(max_num_reqs, dtype=bool)
        # Tokens sampled by launched steps and not yet read back (appended): at most one, the
        # input of the row's next step, which then comes from the device (async scheduling).
        self.num_in_flight = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Sampling knobs, one value per row.
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() gives the lowest

    def add_request(
        self, state: CachedRequestState, block_ids: list[int], num_computed_tokens: int
    ) -> int:
        if not self._free_rows:
            raise RuntimeError("InputBatch is full; the scheduler exceeded max_num_seqs.")
        row = self._free_rows.pop()
        self.req_id_to_row[state.req_id] = row
        self.states[row] = state
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        runs = state.prompt_embeds
        self.prompt_embeds_end[row] = max((at + len(rows) for at, rows in runs), default=0)
        self.num_computed_tokens[row] = num_computed_tokens
        self.pools[row] = state.sampling_params.pooling is not None
        self.num_in_flight[row] = 0
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)
        params = state.sampling_params
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.states[row] = None
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[row])
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        state = self.states[row]
        assert state is not None
        if self.num_tokens[row] == self.token_ids.shape[1]:
            return  # an embedding request's one token past max_model_len: it finishes on it
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1
        state.output_token_ids.append(token_id)
        if state.thinking is not None:
            state.thinking.advance(token_id)

    def seen_tokens(
        self, rows: np.ndarray, drafts_before: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The prompt and output token ids of ``rows`` (with the drafts before each row's
        position, which follow the row's tokens in ``token_ids``), each padded with -1: what
        penalties count. Positions given as embeddings count as padding: they hold no token."""
        num_prompt = self.num_prompt_tokens[rows]
        num_tokens = self.num_tokens[rows] + drafts_before

        def window(start: np.ndarray, end: np.ndarray) -> np.ndarray:
            index = start[:, None] + np.arange(int((end - start).max(initial=0)))
            inside = index < end[:, None]
            ids = self.token_ids[rows[:, None], np.where(inside, index, 0)]
            return np.where(inside, ids, -1)

        prompt = window(np.zeros_like(num_prompt), num_prompt)
        for i in np.flatnonzero(self.prompt_embeds_end[rows]).tolist():
            state = self.states[int(rows[i])]
            assert state is not None
            for at, given in state.prompt_embeds:
                prompt[i, at : at + len(given)] = -1
        return prompt, window(num_prompt, num_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)
