"""A launched step's sampled tokens: read back from the device, kept (drafts verified), appended
to their requests' rows, and (with speculative decoding) the next step's drafts proposed."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from omniserve.layers.sampler import LogprobsTensors
from omniserve.messages import ModelRunnerOutput
from omniserve.spec_decode.ngram_proposer import NgramProposer, accept_drafts, takes_drafts
from omniserve.transfers import HostCopy
from omniserve.worker.input_batch import InputBatch
from omniserve.worker.step_timing import StepTimer


@dataclass
class SampledStep:
    """A launched step (a ``PendingOutput``): ``read_back()`` waits for its sampled tokens and
    appends them to their requests' rows (once: the next step's sampling may need them first);
    ``result()`` also attaches the logprobs and proposes drafts. A request that left the batch
    meanwhile is skipped (its output is not used)."""

    batch: InputBatch
    timer: StepTimer
    output: ModelRunnerOutput
    sampling: list[int]
    """Index in ``output.req_ids`` of each request that sampled, in the tokens' order."""
    drafts: list[list[int]]
    """Per sampling request, the draft tokens it was fed: it sampled ``1 + len`` positions."""
    sampled: torch.Tensor
    """[num_positions] ids on the device (the next step may feed a request's last one)."""
    reported: torch.Tensor
    """The same, -1 where the sampler had no token (``SamplerOutput.reported_ids``): read back."""
    logprobs: LogprobsTensors | None
    prompt_logprobs: dict[str, tuple[LogprobsTensors, int]]
    """req id -> logprobs of its prompt positions in this step, and how many it asked for."""
    pooled: dict[str, torch.Tensor]
    """req id -> its embedding (embedding requests whose prompt this step completed)."""
    proposer: NgramProposer | None = None

    def __post_init__(self) -> None:
        tensors = [self.reported]
        for logprobs in (self.logprobs, *(lp for lp, _ in self.prompt_logprobs.values())):
            if logprobs is not None:
                tensors += logprobs.tensors()
        tensors += self.pooled.values()
        self._copy: HostCopy | None = HostCopy(tensors)
        self._host: list[torch.Tensor] = []
        self.starts = np.cumsum([0, *(1 + len(d) for d in self.drafts)])[:-1].tolist()
        """Each sampling request's first position in ``sampled``."""

    def last_position(self) -> dict[str, int]:
        """req id -> the position in ``sampled`` of its last token (a step without drafts)."""
        return {self.output.req_ids[i]: self.starts[j] + len(self.drafts[j])
                for j, i in enumerate(self.sampling)}  # fmt: skip

    def done(self) -> bool:
        return self._copy is None or self._copy.ready()

    def read_back(self) -> None:
        if self._copy is None:
            return
        batch, output = self.batch, self.output
        self._host, self._copy = self._copy.get(), None
        sampled = self._host[0].tolist()
        for j, i in enumerate(self.sampling):
            start, drafts = self.starts[j], self.drafts[j]
            tokens = accept_drafts(sampled[start : start + 1 + len(drafts)], drafts)
            output.sampled_token_ids[i] = tokens
            row = batch.req_id_to_row.get(output.req_ids[i])
            if row is not None:
                batch.num_in_flight[row] -= 1
                for token in tokens:
                    if token < 0:  # no token; the scheduler ends the request
                        break
                    batch.append_token(row, token)

    def result(self) -> ModelRunnerOutput:
        with self.timer.part("sampler"):
            self.read_back()
        output, host = self.output, iter(self._host[1:])
        if self.logprobs is not None:
            logprobs = LogprobsTensors(*itertools.islice(host, 3))
            for j, i in enumerate(self.sampling):
                req_id = output.req_ids[i]
                row = self.batch.req_id_to_row.get(req_id)
                state = self.batch.states[row] if row is not None else None
                if state is not None and state.sampling_params.logprobs is not None:
                    positions = range(
                        self.starts[j], self.starts[j] + len(output.sampled_token_ids[i])
                    )
                    output.logprobs[req_id] = logprobs.to_lists(
                        positions, state.sampling_params.logprobs
                    )
        for req_id, (_, k) in self.prompt_logprobs.items():
            output.prompt_logprobs[req_id] = LogprobsTensors(
                *itertools.islice(host, 3)
            ).to_lists_all(k)
        for req_id in self.pooled:
            output.pooled[req_id] = next(host).numpy()
        if self.proposer is not None:
            with self.timer.part("drafts"):
                self._propose(self.proposer)
        return output

    def _propose(self, proposer: NgramProposer) -> None:
        """Drafts for the next step of each request that sampled and takes them."""
        batch, output = self.batch, self.output
        for i in self.sampling:
            req_id = output.req_ids[i]
            row = batch.req_id_to_row.get(req_id)
            if (
                row is None
                or not output.sampled_token_ids[i]
                or output.sampled_token_ids[i][-1] < 0
            ):
                continue
            state = batch.states[row]
            assert state is not None
            if takes_drafts(state.sampling_params):
                drafts = proposer.propose(batch.token_ids[row, : batch.num_tokens[row]])
                if drafts:
                    output.spec_token_ids[req_id] = drafts
