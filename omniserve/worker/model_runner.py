"""ModelRunner: one scheduler step -> flattened inputs -> forward -> logits -> sampled tokens.

Tokens of all scheduled requests are laid end to end with no padding; attention finds each
request's history through its block table. Logits are computed only where a token is sampled
(the last position of a request whose known tokens are all in the KV cache after this step, and
each position of the draft tokens fed after them, with speculative decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from omniserve.attention.layer import (
    allocate_kv_caches,
    copy_kv_blocks,
    get_attention_layers,
    kv_cache_bytes_per_block,
    release_kv_caches,
)
from omniserve.attention.metadata import AttentionMetadata
from omniserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig, blocks_for
from omniserve.core.sched_output import SchedulerOutput
from omniserve.forward_context import set_forward_context
from omniserve.layers.fused_moe import FusedMoE
from omniserve.layers.sampler import (
    LogprobsTensors,
    Sampler,
    compute_logprobs,
)
from omniserve.messages import ModelRunnerOutput, PendingOutput, ReadyOutput
from omniserve.multimodal.inputs import MultiModalFeatureSpec
from omniserve.spec_decode.ngram_proposer import NgramProposer
from omniserve.structured_output import allowed_by_bitmask
from omniserve.transfers import host_to_device, upload
from omniserve.worker.cuda_graph import PAD_SLOT, DecodeGraphs, graph_batch_sizes
from omniserve.worker.encoder_runner import (
    EncoderRunner,
    mrope_positions,
    prompt_embeds_rows,
    to_device,
)
from omniserve.worker.input_batch import CachedRequestState, InputBatch
from omniserve.worker.logits_processors import LogitsProcessorBatch
from omniserve.worker.lora_manager import LoRAManager
from omniserve.worker.pooler import Projector, pool_prompts
from omniserve.worker.sampled_step import SampledStep
from omniserve.worker.sampling_inputs import batch_sampling_metadata
from omniserve.worker.step_timing import StepTimer
from omniserve.worker.talker_families import create_talker_runner


@dataclass
class StepInputs:
    """The flattened batch of one step."""

    req_ids: list[str]
    rows: np.ndarray  # [num_reqs] batch row of each scheduled request
    query_lens: np.ndarray  # [num_reqs]
    positions: np.ndarray  # [num_tokens]
    input_ids: torch.Tensor  # [num_tokens]
    model_positions: torch.Tensor  # the model's: [num_tokens], or [3, num_tokens] for M-RoPE
    attn_metadata: AttentionMetadata
    sample_mask: np.ndarray  # [num_reqs] bool: this step samples a token for the request
    logits_indices: torch.Tensor  # [num_sampled] flattened-token index of each sampling position
    num_drafts: np.ndarray  # [num_reqs] draft tokens fed after the request's last token
    drafts: dict[str, list[int]]  # req id -> those drafts (speculative decoding)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        vocab_size: int,
        device: torch.device,
        lora_manager: LoRAManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        projector: Projector | None = None,
        logprobs_mode: str = "raw_logprobs",
        logits_processors: LogitsProcessorBatch | None = None,
        split_encoder_items: bool = False,
    ) -> None:
        """``split_encoder_items``: ``--mm-encoder-tp-mode data`` (``EncoderRunner``)."""
        self.model = model
        self.projector = projector  # the checkpoint's Dense modules after embedding pooling
        self.lora_manager = lora_manager
        self.device = device
        self.block_size = cache_config.block_size
        self.vocab_size = vocab_size
        max_len = scheduler_config.max_model_len
        self.max_num_blocks_per_req = cache_config.blocks_for(max_len)
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.input_batch = InputBatch(
            scheduler_config.max_num_seqs, max_len, self.max_num_blocks_per_req
        )
        self.sampler = Sampler(logprobs_mode)
        self.logits_processors = logits_processors
        self.proposer = (
            NgramProposer(speculative_config, max_len) if speculative_config is not None else None
        )
        self.kv_caches: list[torch.Tensor] = []
        self.encoder_runner = (
            EncoderRunner(model, device, split_encoder_items)
            if getattr(model, "supports_multimodal", False)
            else None
        )
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.talker_runner = (
            create_talker_runner(model, self.block_size, device)
            if getattr(model, "speaks", False)
            else None
        )
        self.decode_graphs: DecodeGraphs | None = None
        self._launched: tuple[StepInputs, torch.Tensor, torch.Tensor] | None = None
        """The step ``launch`` started and ``sample`` completes: inputs, hidden states, logits."""
        self._last_step: SampledStep | None = None
        """The last launched step: its sampled tokens (on the device) are the inputs of next
        steps launched before they are read back, and the tokens any row has in flight."""
        self.step_timer = StepTimer(device)

    # ---- KV cache -------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, dtype: torch.dtype) -> int:
        return kv_cache_bytes_per_block(self.model, self.block_size, dtype)

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        """Allocate one paged cache per attention layer and hand it to the layer."""
        self.kv_caches = allocate_kv_caches(
            self.model, num_blocks, self.block_size, dtype, self.device
        )

    def release_caches(self) -> None:
        """Drop the KV caches (the talker's too) and the encoder outputs (sleep mode): the
        layers and the captured decode graphs hold the caches as well."""
        release_kv_caches(self.model)
        self.kv_caches, self.decode_graphs = [], None
        if self.talker_runner is not None:
            self.talker_runner.release_kv_cache()
        if self.encoder_runner is not None:
            self.encoder_runner.clear()

    @torch.inference_mode()
    def profile_run(self, media: list[MultiModalFeatureSpec]) -> None:
        """The start-up memory profile's work: each media item through its encoder, then the
        largest step (``max_num_batched_tokens`` tokens as one causal sequence, no cache) and
        the logits and sampling probabilities of a full batch (with its drafts)."""
        for feature in media:
            self.model.get_multimodal_embeddings(
                feature.modality, to_device([feature.data], self.device)
            )
        num_tokens = self.max_num_batched_tokens
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        if self.uses_mrope:
            positions = positions.expand(3, num_tokens)
        with set_forward_context(None):
            hidden_states = self.model(input_ids, positions)
        # A full batch samples a row per request, and with drafts one per draft too.
        per_request = 1 + (self.proposer.k if self.proposer is not None else 0)
        logits = self.model.compute_logits(hidden_states[: self.max_num_seqs * per_request])
        torch.softmax(logits, dim=-1)

    @torch.inference_mode()
    def warm_up_kernels(self) -> bool:
        """Compile the JIT (Triton) kernels before serving, so that no request waits for the
        compiler (about a second per variant): the MoE layers' block heights, then eager steps
        whose rows write no cache slot: a 16-token prefill chunk with one decode (the split
        decode kernel), and on CUDA a full batch of decodes (the unsplit one, where a batch
        that large fills the GPU). Attention is warmed only on backends that take such padding
        rows (those that replay in graphs). Returns whether anything was warmed."""
        moe = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        for layer in moe:
            layer.warm_up()
        if not all(layer.backend.supports_cuda_graphs
                   for layer in get_attention_layers(self.model)):  # fmt: skip
            return bool(moe) and self.device.type == "cuda"
        self._padding_step([16, 1])
        if self.device.type == "cuda" and self.max_num_seqs > 1:
            self._padding_step([1] * self.max_num_seqs)
        return True

    def _padding_step(self, query_lens: list[int]) -> None:
        """One eager forward of new requests with these query lengths whose rows write no cache
        slot (each row's keys are its own)."""
        dev = self.device
        num_tokens = sum(query_lens)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(
                np.cumsum([0, *query_lens]), dtype=torch.int32, device=dev
            ),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
            block_table=torch.zeros(
                len(query_lens),
                blocks_for(max(query_lens), self.block_size),
                dtype=torch.int32,
                device=dev,
            ),
            slot_mapping=torch.full((num_tokens,), PAD_SLOT, dtype=torch.long, device=dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=query_lens,
        )
        positions = torch.cat([torch.arange(n, device=dev) for n in query_lens])
        positions = positions.expand(3, -1) if self.uses_mrope else positions
        with set_forward_context(metadata):
            self.model(torch.zeros(num_tokens, dtype=torch.long, device=dev), positions)

    @torch.inference_mode()
    def capture_decode_graphs(
        self, requested: Sequence[int] = (), max_size: int | None = None
    ) -> list[int]:
        """Capture the decode forward at each size of the ladder (after the KV cache exists);
        returns the sizes, none where a layer's attention backend plans on the host or LoRA is
        on (its token groups change with every step)."""
        if self.lora_manager is not None or not all(
            layer.backend.supports_cuda_graphs for layer in get_attention_layers(self.model)
        ):
            return []
        sizes = graph_batch_sizes(self.max_num_seqs, requested, max_size)
        self.decode_graphs = DecodeGraphs(self.model, sizes,
                                          self.max_num_blocks_per_req, self.device,
                                          self.uses_mrope)  # fmt: skip
        self.decode_graphs.capture()
        return self.decode_graphs.sizes

    # ---- one step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.dispatch(scheduler_output).result()

    @torch.inference_mode()
    def dispatch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Launch the thinker's step; its sampled tokens are read back by ``result()``, so the
        next step can be prepared and launched meanwhile. The speech stage (which reads what
        the thinker tapped and sampled) runs after the read-back, in this call."""
        self.launch(scheduler_output)
        pending = self.sample(scheduler_output.grammar_bitmask)
        if self.talker_runner is None or scheduler_output.talker is None:
            return pending
        output = pending.result()
        with self.step_timer.part("speech stage"):
            output.speech = self.talker_runner.execute(scheduler_output.talker)
        return ReadyOutput(output)

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> None:
        """The thinker's step up to its logits; ``sample`` completes it. Apart, the grammar
        bitmask of a request whose last token is still in flight can be made once that token
        is back, while this forward runs (async scheduling)."""
        self._update_states(scheduler_output)
        copy_kv_blocks(self.kv_caches, scheduler_output.kv_block_copies.values())
        self._launched = None
        if scheduler_output.total_num_scheduled_tokens == 0:
            return
        timer = self.step_timer
        if self.encoder_runner is not None and scheduler_output.scheduled_encoder_inputs:
            with timer.part("encoders"):  # (before the positions: pruned videos' need them)
                self._run_encoders(scheduler_output)
        step = self._prepare_inputs(scheduler_output)
        forward = "decode steps: forward + logits"
        if timer.enabled:
            computed = self.input_batch.num_computed_tokens[step.rows]
            prefill = bool((computed < self.input_batch.num_prompt_tokens[step.rows]).any())
            timer.count_step(prefill)
            forward = "prefill steps: forward + logits" if prefill else forward
        with timer.part(forward):
            hidden_states = self._replay_decode(scheduler_output, step)  # [num_tokens, hidden]
        if hidden_states is None:
            input_ids, inputs_embeds = step.input_ids, None
            starts = self.input_batch.num_computed_tokens[step.rows]  # each window's first
            if self.encoder_runner is not None:
                with timer.part("encoders"):
                    inputs_embeds = self._embed_with_mm(step, starts)
                input_ids = None
            if (starts < self.input_batch.prompt_embeds_end[step.rows]).any():
                inputs_embeds = self._with_prompt_embeds(step, starts, inputs_embeds)
                input_ids = None
            lora_mapping = None
            if self.lora_manager is not None:
                states = self.input_batch.states
                loras = [states[row].lora_request for row in step.rows]
                lora_mapping = self.lora_manager.prepare(loras, step.query_lens)
            with timer.part(forward), set_forward_context(step.attn_metadata, lora_mapping):
                hidden_states = self.model(
                    input_ids, step.model_positions, inputs_embeds=inputs_embeds
                )
        if self.talker_runner is not None:
            self._keep_talker_hidden(step, hidden_states)
        with timer.part(forward):
            logits = self.model.compute_logits(hidden_states[step.logits_indices])  # [S, vocab]
        self._launched = (step, hidden_states, logits)

    @torch.inference_mode()
    def sample(self, grammar_bitmask: dict[str, bytes]) -> PendingOutput:
        """Sample the launched step (``grammar_bitmask``: req id -> its allowed-token bitmask
        row) and launch its read-back."""
        if self._launched is None:
            return ReadyOutput(ModelRunnerOutput([], []))
        step, hidden_states, logits = self._launched
        self._launched = None
        sampling = np.flatnonzero(step.sample_mask)
        counts = 1 + step.num_drafts[sampling]  # positions each sampling request samples
        firsts = np.cumsum(counts) - counts  # each one's first row of the logits
        grammar = None
        if grammar_bitmask:  # (a request under a grammar takes no drafts: one position)
            sampling_ids = [step.req_ids[i] for i in sampling]
            rows = [j for j, req_id in enumerate(sampling_ids) if req_id in grammar_bitmask]
            masks = [grammar_bitmask[sampling_ids[j]] for j in rows]
            grammar = (firsts[rows], allowed_by_bitmask(masks, logits.shape[1]))
        with self.step_timer.part("sampler"):
            metadata = batch_sampling_metadata(
                self.input_batch, np.repeat(step.rows[sampling], counts), self.device,
                self.vocab_size, self._read_back, grammar, _ranges(np.zeros_like(counts), counts),
                self.logits_processors,
            )  # fmt: skip
            sampler_output = self.sampler(logits, metadata)
        pooled = pool_prompts(hidden_states, step.logits_indices, self.input_batch, step.req_ids,
                              step.rows, step.query_lens, step.positions, sampling, firsts,
                              self.model.compute_logits, self.projector)  # fmt: skip
        self.input_batch.num_in_flight[step.rows[sampling]] += 1
        self._last_step = SampledStep(
            self.input_batch,
            self.step_timer,
            ModelRunnerOutput(step.req_ids, [[] for _ in step.req_ids]),
            sampling.tolist(),
            [step.drafts.get(step.req_ids[i], []) for i in sampling],
            sampler_output.sampled_token_ids,
            sampler_output.reported_ids(),
            sampler_output.logprobs,
            self._prompt_logprobs(step, hidden_states),
            pooled,
            self.proposer,
        )
        return self._last_step

    def _replay_decode(self, so: SchedulerOutput, step: StepInputs) -> torch.Tensor | None:
        """The step's hidden states from a captured graph when every request feeds back one
        generated token (a one-token prefill chunk may be a media placeholder, so it does not
        count); None: run eagerly."""
        if (
            self.decode_graphs is None
            or so.scheduled_encoder_inputs
            or (step.query_lens != 1).any()
            or (step.positions < self.input_batch.num_prompt_tokens[step.rows]).any()
        ):
            return None
        return self.decode_graphs.run(step.input_ids, step.model_positions, step.attn_metadata)

    def _keep_talker_hidden(self, step: StepInputs, hidden_states: torch.Tensor) -> None:
        """Hand the talker the thinker's hidden states (its output, or the layer the model
        tapped) at the positions of this step's speaking requests."""
        talker = self.talker_runner
        assert talker is not None
        tapped = hidden_states if talker.taps_output else self.model.tapped
        start = 0
        for i, req_id in enumerate(step.req_ids):
            count = int(step.query_lens[i])
            state = self.input_batch.states[int(step.rows[i])]
            assert state is not None
            if state.sampling_params.wants_audio and talker.wants_hidden(bool(state.mm_features)):
                positions = step.positions[start : start + count]
                talker.keep_hidden(req_id, positions, tapped[start : start + count])
            start += count

    def _run_encoders(self, so: SchedulerOutput) -> None:
        """Encode this step's scheduled encoder inputs into the encoder cache."""
        assert self.encoder_runner is not None
        batch = self.input_batch
        features = {}
        for req_id in so.scheduled_encoder_inputs:
            state = batch.states[batch.req_id_to_row[req_id]]
            assert state is not None
            features[req_id] = state.mm_features
        self.encoder_runner.execute(so, features)

    def _embed_with_mm(self, step: StepInputs, starts: np.ndarray) -> torch.Tensor:
        """The step's input embeddings with the encoder outputs' slices each window (from
        ``starts``) needs merged in (this step's encoder inputs ran at its launch)."""
        assert self.encoder_runner is not None
        states = [self.input_batch.states[int(r)] for r in step.rows]
        features = [s.mm_features for s in states]  # type: ignore[union-attr]
        windows = list(zip(starts.tolist(), (starts + step.query_lens).tolist(), strict=True))
        mm_embeds, is_mm = self.encoder_runner.gather(windows, features, len(step.positions))
        return self.model.get_input_embeddings(step.input_ids, mm_embeds, is_mm)

    def _with_prompt_embeds(
        self, step: StepInputs, starts: np.ndarray, embeds: torch.Tensor | None
    ) -> torch.Tensor:
        """The step's input embeddings (``embeds``, or its tokens') with the rows of prompts
        given as embeddings in their positions (``starts``: each window's first position)."""
        if embeds is None:
            embeds = self.model.get_input_embeddings(step.input_ids)
        states = [self.input_batch.states[int(r)] for r in step.rows]
        given = [s.prompt_embeds if s is not None else [] for s in states]
        rows, indices = prompt_embeds_rows(starts, step.query_lens, given)
        if rows is None:  # no window reaches a run
            return embeds
        moved, where = upload(self.device, [rows, indices])
        return embeds.index_copy(0, where, moved.to(embeds.dtype))

    def _model_positions(
        self, rows: np.ndarray, positions: np.ndarray, query_lens: np.ndarray
    ) -> np.ndarray | torch.Tensor:
        """The positions the model rotates by: the token positions, or M-RoPE's three rows."""
        if not self.uses_mrope:
            return positions  # [num_tokens]
        states = [self.input_batch.states[row] for row in rows.tolist()]
        if self.encoder_runner is not None and self.encoder_runner.prunes_video:
            firsts = positions[np.cumsum(query_lens) - query_lens]
            for state, first, count in zip(states, firsts.tolist(), query_lens.tolist(),
                                           strict=True):  # fmt: skip
                if state.mrope_stand_ins:  # a pruned video not yet encoded when it was added
                    self.encoder_runner.place_window(state, first, first + count)
        deltas = np.fromiter((int(s.mrope_delta) for s in states),
                             np.int64, len(states))  # fmt: skip
        return mrope_positions(
            positions,
            query_lens,
            deltas,
            self.input_batch.num_prompt_tokens[rows],
            [s.mrope_positions for s in states],
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        if self.encoder_runner is not None:
            self.encoder_runner.free(so.free_encoder_mm_hashes)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # a resumed request is rebuilt from scratch
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            state = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                params,
                generator,
                new.eos_token_id,
                list(new.mm_features),
                lora_request=new.lora_request,
                prompt_embeds=[
                    (run.offset, run.embeds.to(next(self.model.parameters()).dtype))
                    for run in new.prompt_embeds
                ],
            )
            if self.uses_mrope and self.encoder_runner is not None:
                self.encoder_runner.lay_out_positions(state)
            elif self.uses_mrope:  # (a text model's own M-RoPE)
                state.mrope_positions, state.mrope_delta = self.model.get_mrope_input_positions(
                    state.prompt_token_ids, state.mm_features
                )
            if self.talker_runner is not None and params.wants_audio:
                self.talker_runner.register(new.req_id, new.prompt_token_ids, new.mm_features)
            batch.add_request(state, new.block_ids, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = batch.req_id_to_row[req_id]
            batch.append_block_ids(row, block_ids)
            batch.num_computed_tokens[row] = num_computed

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), np.int64, len(req_ids))
        query_lens = np.fromiter(so.num_scheduled_tokens.values(), np.int64, len(req_ids))
        num_computed = batch.num_computed_tokens[rows]
        cu_query = np.cumsum(query_lens)
        token_req = np.repeat(np.arange(len(req_ids)), query_lens)  # [num_tokens] request index
        positions = _ranges(num_computed, query_lens)  # [num_tokens]
        token_rows = rows[token_req]
        num_drafts = np.zeros(len(req_ids), np.int64)
        index_of = {r: i for i, r in enumerate(req_ids)} if so.scheduled_spec_decode_tokens else {}
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            i = index_of[req_id]
            end = batch.num_tokens[rows[i]]  # inputs past the row's tokens, not its tokens
            batch.token_ids[rows[i], end : end + len(drafts)] = drafts
            num_drafts[i] = len(drafts)
        input_ids = batch.token_ids[token_rows, positions]
        # A token past the known ones (and drafts) was sampled by the last launched step and is
        # not read back yet (async scheduling): it is taken from that step's output on the
        # device.
        known = batch.num_tokens[rows] + num_drafts
        from_device = np.flatnonzero(positions >= known[token_req])
        block_ids = batch.block_table[token_rows, positions // self.block_size]
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        seq_lens = num_computed + query_lens
        # A request samples when this step reaches the end of its tokens (those read back and
        # those in flight); a partial prefill does not (and must not advance its seeded
        # generator).
        sample_mask = seq_lens == known + batch.num_in_flight[rows]
        counts = 1 + num_drafts[sample_mask]  # a sampled position per draft, and the last one
        max_blocks = blocks_for(int(seq_lens.max()), self.block_size)
        arrays = [
            np.concatenate(([0], cu_query)).astype(np.int32),
            seq_lens.astype(np.int32),
            batch.block_table[rows, :max_blocks].astype(np.int32),
            slot_mapping,
            input_ids,
            _ranges(cu_query[sample_mask] - counts, counts),
            self._model_positions(rows, positions, query_lens),
        ]
        if from_device.size:
            last = self._last_step
            assert last is not None
            last_tokens = last.sampled
            index = last.last_position()
            arrays += [from_device, np.fromiter((index[req_ids[i]] for i in token_req[from_device]),
                                                np.int64, from_device.size)]  # fmt: skip
        (query_start_loc, seq_lens_dev, block_table, slot_mapping_dev, input_ids_dev,
         logits_indices, model_positions, *fed) = upload(self.device, arrays)  # fmt: skip
        if fed:
            input_ids_dev[fed[0]] = last_tokens[fed[1]]
        attn_metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_dev,
            block_table=block_table,
            slot_mapping=slot_mapping_dev,
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            query_lens=query_lens,
            positions=positions,
            input_ids=input_ids_dev,
            model_positions=model_positions,
            attn_metadata=attn_metadata,
            sample_mask=sample_mask,
            logits_indices=logits_indices,
            num_drafts=num_drafts,
            drafts=so.scheduled_spec_decode_tokens,
        )

    def _read_back(self) -> None:
        """Read the last step's sampled tokens back (every token in flight is that step's)."""
        assert self._last_step is not None
        self._last_step.read_back()

    def _prompt_logprobs(
        self, step: StepInputs, hidden_states: torch.Tensor
    ) -> dict[str, tuple[LogprobsTensors, int]]:
        """Logprobs of each prompt token given its prefix, for the prompt positions of this step
        (and how many each request asked for)."""
        batch = self.input_batch
        result: dict[str, tuple[LogprobsTensors, int]] = {}
        start = 0
        for i, req_id in enumerate(step.req_ids):
            row, q = int(step.rows[i]), int(step.query_lens[i])
            state = batch.states[row]
            assert state is not None
            k = state.sampling_params.prompt_logprobs
            first = int(step.positions[start]) if q else 0
            if k is not None and first + 1 < state.num_prompt_tokens:
                # Position p predicts prompt token p + 1; stop before the sampling position.
                count = min(q, state.num_prompt_tokens - 1 - first)
                targets = host_to_device(
                    batch.token_ids[row, first + 1 : first + 1 + count], self.device
                )
                logits = self.model.compute_logits(hidden_states[start : start + count])
                result[req_id] = (compute_logprobs(logits, targets, k), k)
            start += q
        return result


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[start, start + length)`` of each pair, end to end."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))
