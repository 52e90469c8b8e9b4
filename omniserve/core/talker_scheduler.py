"""The speech stage's scheduler: talker steps run in the same engine step as the thinker's, with
their own KV block pool, seat limit and token budget. Pure Python (no torch).

The stage contract (plain data, so the talker could later move to its own process or device):
- ``SpeechRequest`` (from the front end): the voice, the talker's sampling settings and where its
  prompt comes from in the thinker's prompt (``plan_talker_prompt``).
- Each step, ``TalkerSchedulerOutput`` tells the workers which talker requests compute how many
  inputs, their blocks, and the reply text entries they may use (``new_text``): thinker token
  ids, then ``TEXT_END`` once the thinker has finished. The thinker's hidden states the talker
  reads (Qwen3-Omni: at the prompt's multimodal positions; Qwen2.5-Omni: at every position) stay
  in the worker that computed them (the talker runner keeps them per request); to have them, such
  a request never reads the prefix cache (``SpeechRequest.reads_prompt_hidden``: its prompt is
  computed, and tapped, in full; it still writes the cache for others), and where the talker
  reads reply tokens' hidden states too, a reply token is usable once the thinker was fed it.
- ``SpeechStepOutput`` comes back: frames spoken so far, whether the talker finished, and the
  waveform samples the vocoder finalised this step.

When a talker input is ready (what makes the talker trail the thinker by a step): the prompt needs
the first reply token; decode input ``j`` needs frame ``j`` (the talker's own previous output) and
reply entry ``j + 1``; the thinker's last token is never spoken (transformers feeds the talker
the thinker's inputs, and its final token is never an input), so while the thinker runs every
known token is usable, and once it finished all but its last, then ``TEXT_END``, then padding
for ever. A text-only request never enters this scheduler and costs nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from omniserve.core.kv_cache_manager import KVCacheManager
from omniserve.core.request import Request
from omniserve.core.sched_output import TEXT_END, NewTalkerRequestData, TalkerSchedulerOutput
from omniserve.core.stop_conditions import FINISH_REASONS
from omniserve.messages import EngineCoreOutput, FinishReason, SpeechRequest, SpeechStepOutput

logger = logging.getLogger(__name__)


def plan_talker_prompt(
    prompt_token_ids: list[int], im_start_id: int, user_id: int, assistant_id: int
) -> tuple[list[int], int]:
    """``(user positions, text start)`` of a ChatML prompt, with transformers' rules: a token's
    role is the token after the nearest ``<|im_start|>`` at or before it; the reply starts 3 tokens
    after the last ``<|im_start|>assistant``. ValueError when the prompt has no such header."""
    starts = [
        i
        for i in range(len(prompt_token_ids) - 1)
        if prompt_token_ids[i] == im_start_id and prompt_token_ids[i + 1] == assistant_id
    ]
    if not starts:
        raise ValueError(
            "audio output needs a chat prompt that opens the assistant's turn "
            "(<|im_start|>assistant); use the chat template with "
            "add_generation_prompt."
        )
    last = len(prompt_token_ids) - 1
    role_at = prompt_token_ids[min(1, last)]
    user_positions = []
    for position, token in enumerate(prompt_token_ids):
        if token == im_start_id:
            role_at = prompt_token_ids[min(position + 1, last)]
        if role_at == user_id:
            user_positions.append(position)
    return user_positions, starts[-1] + 3


@dataclass(eq=False)
class TalkerRequest:
    """The scheduler's view of one request's talker (duck-types ``Request`` for the KV manager)."""

    thinker: Request
    speech: SpeechRequest
    num_computed_tokens: int = 0
    num_frames: int = 0
    num_text_sent: int = 0
    num_preemptions: int = 0
    has_blocks: bool = False
    block_hashes: list[int] = field(default_factory=list)  # no prefix caching for the talker

    @property
    def request_id(self) -> str:
        return self.thinker.request_id

    @property
    def num_tokens(self) -> int:
        """Talker inputs that can be computed now (0 until the prompt can be built)."""
        entries = self.text_entries()
        ended = bool(entries) and entries[-1] == TEXT_END
        usable = len(entries) - ended
        if usable < 1:
            return 0
        decodes = self.num_frames if ended else min(self.num_frames, usable - 1)
        return self.speech.prompt_len + decodes

    def text_entries(self) -> list[int]:
        """The reply entries known now: thinker token ids from ``text_start``, then TEXT_END.

        transformers' rule: entry ``i + 1`` feeds decode step ``i`` while ``i`` is below the
        end marker's step ``min(e, L)``, where ``e`` is the index of the first end-of-turn
        token among the generated ones (their count when there is none) and ``L`` the number of
        reply inputs the thinker fed back (all of its tokens but the last). While the thinker
        runs, an entry is final once no end marker can come before it.
        """
        thinker, start = self.thinker, self.speech.text_start
        tokens, outputs = thinker.all_token_ids, thinker.output_token_ids
        known = len(tokens) - start
        if self.speech.reply_in_prompt:  # the prompt's reply, whole; nothing generated is spoken
            reply = tokens[start : len(thinker.prompt_token_ids)]
            return [*reply, TEXT_END] if thinker.is_finished else []
        stops = {thinker.eos_token_id, *thinker.sampling_params.stop_token_ids}
        first_stop = next((i for i, t in enumerate(outputs) if t in stops), None)
        if thinker.is_finished or (first_stop is not None and first_stop <= known - 2):
            marker = first_stop if first_stop is not None else len(outputs)
            if thinker.is_finished:
                marker = min(marker, known - 2)
            return [*tokens[start : start + 1 + marker], TEXT_END] if marker >= 0 else []
        limit = min(known, (len(outputs) if first_stop is None else first_stop) + 1)
        if self.speech.reads_reply_hidden:  # only tokens the thinker has been fed this far
            limit = min(limit, thinker.num_computed_tokens - start)
        return list(tokens[start : start + max(limit, 0)])

    def usable_text(self) -> int:
        entries = self.text_entries()
        return len(entries) - (bool(entries) and entries[-1] == TEXT_END)


class TalkerScheduler:
    """Admits and steps talker requests in arrival order under their own limits; preempts the
    newest running one (recompute) when its block pool runs out."""

    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, TalkerRequest] = {}  # arrival order
        self.finished_req_ids: set[str] = set()
        self.cut: set[str] = set()
        """Requests whose talker outgrew the whole pool alone: they end with what was spoken.
        The front end refuses such requests (``talker_capacity``); this guards the engine
        against one that reached it another way, which would otherwise wait forever."""
        self.num_preemptions = 0

    def add(self, thinker: Request, speech: SpeechRequest) -> None:
        self.requests[thinker.request_id] = TalkerRequest(thinker, speech)

    def finish(self, req_id: str) -> None:
        request = self.requests.pop(req_id, None)
        if request is not None:
            self.kv_cache_manager.free(request)
            self.finished_req_ids.add(req_id)

    def schedule(self) -> TalkerSchedulerOutput:
        out = TalkerSchedulerOutput()
        budget = self.max_num_batched_tokens
        running = [r for r in self.requests.values() if r.has_blocks]
        queue = [r for r in self.requests.values() if not r.has_blocks]
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            while (blocks := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
                victim = running.pop()  # past the cursor: nothing of this step to give back
                self._preempt(victim, out)
                if victim is request:
                    break
            if blocks is None:
                if index == 0:  # alone, it still outgrew the pool: its speech ends here
                    self._cut(request)
                break
            self._commit(request, num_new, blocks.get_block_ids(), False, out)
            budget -= num_new
            index += 1
        seats = self.max_num_seqs - sum(r.has_blocks for r in self.requests.values())
        for request in queue:
            if budget <= 0 or seats <= 0 or out.preempted_req_ids:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue  # its prompt is not known yet; later arrivals may be ready
            if self.kv_cache_manager.allocate_slots(request, num_new) is None:
                if not any(r.has_blocks for r in self.requests.values()):
                    self._cut(request)  # nothing to wait for: it never fits
                break
            request.has_blocks = True
            seats -= 1
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            self._commit(request, num_new, block_ids, True, out)
            budget -= num_new
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        for req_id in out.num_scheduled_tokens:
            self.requests[req_id].num_computed_tokens += out.num_scheduled_tokens[req_id]
        return out

    def _commit(
        self,
        request: TalkerRequest,
        num_new: int,
        block_ids: list[int],
        is_new: bool,
        out: TalkerSchedulerOutput,
    ) -> None:
        req_id = request.request_id
        if is_new:
            out.new_reqs.append(
                NewTalkerRequestData(req_id, request.speech, block_ids, request.num_computed_tokens)
            )
        else:
            out.cached_reqs.req_ids.append(req_id)
            out.cached_reqs.new_block_ids.append(block_ids)
            out.cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
        out.num_scheduled_tokens[req_id] = num_new
        entries = request.text_entries()
        if len(entries) > request.num_text_sent:
            out.new_text[req_id] = entries[request.num_text_sent :]
            request.num_text_sent = len(entries)

    def _cut(self, request: TalkerRequest) -> None:
        self.cut.add(request.request_id)
        logger.warning(
            "Request %s: its talker needs more than the whole talker KV pool (%d blocks of %d "
            "tokens); its speech ends after %d frames. Raise --talker-kv-cache-memory.",
            request.request_id, self.kv_cache_manager.block_pool.num_blocks,
            self.kv_cache_manager.block_size, request.num_frames)  # fmt: skip

    def _preempt(self, request: TalkerRequest, out: TalkerSchedulerOutput) -> None:
        self.kv_cache_manager.free(request)
        request.has_blocks = False
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_req_ids.add(request.request_id)

    def update(self, outputs: dict[str, SpeechStepOutput]) -> list[str]:
        """Record the workers' progress; returns the talker requests that finished."""
        done = []
        for req_id, result in outputs.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.num_frames = result.num_frames
            if result.done:
                done.append(req_id)
        return done

    def stopped(self) -> set[str]:
        """Requests to end without a worker's word: nothing to speak (the thinker finished with
        no reply text), or cut by the pool."""
        silent = {
            req_id
            for req_id, r in self.requests.items()
            if r.thinker.is_finished and r.usable_text() < 1
        }
        cut, self.cut = self.cut & self.requests.keys(), set()
        return silent | cut

    @property
    def usage(self) -> float:
        return self.kv_cache_manager.usage

    # ---- what the engine reports --------------------------------------------------------------
    def hold(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """A request whose text ended normally goes on speaking: its finish is reported when the
        talker is done. An aborted or failed one stops speaking too."""
        for output in outputs:
            if output.request_id not in self.requests or output.finish_reason is None:
                continue
            if output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                output.finish_reason, output.stop_reason = None, None
            else:
                self.finish(output.request_id)
        return outputs

    def outputs(self, speech: dict[str, SpeechStepOutput]) -> list[EngineCoreOutput]:
        """Audio progress from the workers' ``speech``; a talker that is done (or never had text
        to speak, or was cut) ends its request with the thinker's finish reason."""
        done = set(self.update(speech)) | self.stopped()
        outputs = []
        for req_id in [*speech, *(done - speech.keys())]:
            request = self.requests.get(req_id)
            if request is None:
                continue
            result = speech.get(req_id)
            finished = req_id in done
            audio = result.audio if result is not None else None
            if audio is None and not finished:
                continue
            thinker = request.thinker
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=[],
                    new_audio=audio,
                    num_audio_tokens=request.num_frames,
                    finish_reason=FINISH_REASONS.get(thinker.status) if finished else None,
                    stop_reason=thinker.stop_reason if finished else None,
                    num_cached_tokens=max(thinker.num_cached_tokens, 0),
                )
            )
            if finished:
                self.finish(req_id)
        return outputs
