"""A worker's custom logits processors (``omniserve.logits_processor``): built once, and told
before each sampling step which requests the step's logits rows are, as vLLM's ``BatchUpdate``.

The processors' batch is the step's sampling requests in the logits' row order, so the sampler
hands them the logits as they are (no gather into another order and back): a request that
samples again keeps its index unless the rows before it changed, and then moves (vLLM's moves
and swaps). A request that does not sample in a step (its prompt still in chunks, or left out of
the step) is out of the batch for it, as vLLM's model runner drops unscheduled requests; a
request rebuilt after preemption comes back as a new one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omniserve.config import OmniConfig
from omniserve.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from omniserve.worker.input_batch import CachedRequestState


class LogitsProcessorBatch:
    def __init__(self, classes: Sequence[type[LogitsProcessor]], config: OmniConfig,
                 device: torch.device) -> None:  # fmt: skip
        built = [cls(config, device, device.type == "cuda") for cls in classes]
        self.argmax_invariant = tuple(p for p in built if p.is_argmax_invariant())
        """Run after temperature, unless every row is greedy (a greedy row's argmax is taken
        either way)."""
        self.others = tuple(p for p in built if not p.is_argmax_invariant())
        """Run on every row, after the token rules, before the penalties."""
        self._at: list[CachedRequestState | None] = []
        """Index -> the request there (None: an empty slot)."""

    def update(self, states: Sequence[CachedRequestState]) -> None:
        """The batch is now ``states`` (index i: the step's logits row i): each processor's
        ``update_state`` gets the changes."""
        update = self._changes(list(states))
        for processor in (*self.others, *self.argmax_invariant):
            processor.update_state(update)

    def _changes(self, states: list[CachedRequestState]) -> BatchUpdate | None:
        at, wanted = self._at, set(states)
        removed = [i for i, state in enumerate(at) if state is not None and state not in wanted]
        for i in removed:
            at[i] = None
        at.extend([None] * (len(states) - len(at)))
        present = {state: i for i, state in enumerate(at) if state is not None}
        added = []
        for i, state in enumerate(states):
            if state in present:
                continue
            index = i if at[i] is None else at.index(None)  # (fewer requests than slots)
            at[index], present[state] = state, index
            added.append((index, state.sampling_params, state.prompt_token_ids,
                          state.output_token_ids))  # fmt: skip
        moved = []
        for i, state in enumerate(states):
            source = present[state]
            if source == i:
                continue
            other = at[i]
            moved.append((source, i, MoveDirectionality.UNIDIRECTIONAL if other is None
                          else MoveDirectionality.SWAP))  # fmt: skip
            at[i], at[source] = state, other
            present[state] = i
            if other is not None:
                present[other] = source
        del at[len(states) :]  # every request now sits below len(states)
        if not (removed or added or moved):
            return None
        return BatchUpdate(len(states), removed, added, moved)
