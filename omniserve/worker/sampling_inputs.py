"""A step's sampling settings, held on the host -> the sampler's ``SamplingMetadata``.

Every choice the sampler would otherwise make by reading the device (which rows are greedy,
which have a top-k and how large, which rows and ids a penalty or a token rule touches) is made
here from host arrays, and everything is sent in one upload, so that sampling on CUDA never waits
for the step it samples (async scheduling launches the next step behind it).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from omniserve.layers.sampler import Penalties, SamplingMetadata, TokenRules, banned_by_bad_words
from omniserve.sampling_params import SAMPLING_EPS, SamplingParams
from omniserve.transfers import upload
from omniserve.worker.input_batch import InputBatch
from omniserve.worker.logits_processors import LogitsProcessorBatch

SeenTokens = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
"""Rows -> their prompt and output token ids, each [rows, width] padded with -1."""


def build_sampling_metadata(
    device: torch.device,
    *,
    temperature: np.ndarray,
    top_p: np.ndarray,
    top_k: np.ndarray,
    min_p: np.ndarray,
    generators: dict[int, torch.Generator],
    max_num_logprobs: int | None = None,
    repetition: np.ndarray | None = None,
    frequency: np.ndarray | None = None,
    presence: np.ndarray | None = None,
    seen_tokens: SeenTokens | None = None,
    allowed: dict[int, list[int]] | None = None,
    banned: dict[int, list[int]] | None = None,
    bias: dict[int, dict[int, float]] | None = None,
    grammar: tuple[np.ndarray, np.ndarray] | None = None,
    processors: LogitsProcessorBatch | None = None,
) -> SamplingMetadata:
    """Per-row settings (one entry per sampling row; penalties default to none) -> metadata.
    ``seen_tokens`` is asked only for the rows with a penalty; ``grammar``: rows under one and
    the ids each may sample next ([rows, vocab] bool); ``processors``: the custom logits
    processors, told the rows already."""
    num_rows = len(temperature)
    random = temperature >= SAMPLING_EPS
    with_top_k = random & (top_k > 0)
    nucleus = random & ~with_top_k & ((top_p < 1.0) | (min_p > 0.0))
    arrays: list[np.ndarray] = [
        temperature.astype(np.float32), top_p.astype(np.float32), top_k.astype(np.int64),
        min_p.astype(np.float32), np.flatnonzero(~random), np.flatnonzero(with_top_k),
        np.flatnonzero(nucleus), np.flatnonzero(random & ~with_top_k & ~nucleus),
    ]  # fmt: skip
    penalties = _penalty_arrays(num_rows, repetition, frequency, presence, seen_tokens)
    rules = _rule_arrays(allowed or {}, banned or {}, bias or {})
    masks = list(grammar) if grammar is not None and len(grammar[0]) else []
    tensors = upload(device, arrays + penalties + rules + masks)
    (temperature_t, top_p_t, top_k_t, min_p_t, greedy_rows, top_k_rows, nucleus_rows,
     plain_rows) = tensors[:8]  # fmt: skip
    return SamplingMetadata(
        temperature=temperature_t,
        all_greedy=not random.any(),
        top_p=top_p_t if (top_p[random] < 1.0).any() else None,
        top_k=top_k_t if with_top_k.any() else None,
        min_p=min_p_t if (min_p[random] > 0.0).any() else None,
        greedy_rows=greedy_rows,
        top_k_rows=top_k_rows,
        max_top_k=int(top_k[with_top_k].max(initial=0)),
        nucleus_rows=nucleus_rows,
        plain_rows=plain_rows,
        probe=device.type != "cuda",
        generators=generators,
        max_num_logprobs=max_num_logprobs,
        penalties=_penalties(tensors[8 : 8 + len(penalties)], penalties),
        rules=TokenRules(*_pairs(tensors[8 + len(penalties) : 8 + len(penalties) + len(rules)]))
        if rules
        else None,
        grammar=(tensors[-2], tensors[-1]) if masks else None,
        processors=processors.others if processors is not None else (),
        random_processors=processors.argmax_invariant if processors is not None else (),
    )


def batch_sampling_metadata(
    batch: InputBatch,
    rows: np.ndarray,
    device: torch.device,
    vocab_size: int,
    read_back: Callable[[], None],
    grammar: tuple[np.ndarray, np.ndarray] | None = None,
    drafts_before: np.ndarray | None = None,
    processors: LogitsProcessorBatch | None = None,
) -> SamplingMetadata:
    """The settings of the persistent batch's sampling ``rows``. A row's tokens still in flight
    (the last step's) count toward ``min_tokens`` as they are; penalties, bad words and custom
    logits ``processors`` read their values, so when such a row has one, ``read_back`` fetches
    the last step first (called once this step's forward is launched, so on CUDA that wait
    overlaps it). ``drafts_before``: per row, how many of its request's drafts precede its
    position; they count as the request's tokens there (penalties, bad words, ``min_tokens``),
    as they will be if the row's token is kept."""
    if drafts_before is None:
        drafts_before = np.zeros(len(rows), np.int64)
    generators, allowed, banned, bias = {}, {}, {}, {}
    max_num_logprobs = None
    states = []
    for i, row in enumerate(rows):
        state = batch.states[row]
        assert state is not None
        states.append(state)
        params = state.sampling_params
        if batch.num_in_flight[row] and (params.reads_output_tokens or processors is not None):
            read_back()
        if state.generator is not None:
            generators[i] = state.generator
        if params.logprobs is not None:
            max_num_logprobs = max(max_num_logprobs or 0, params.logprobs)
        ahead = int(drafts_before[i])
        drafted = []  # the drafts follow the row's tokens
        if ahead:
            end = int(batch.num_tokens[row])
            drafted = batch.token_ids[row, end : end + ahead].tolist()
        outputs = state.output_token_ids
        if drafted and params.bad_words_token_ids:
            outputs = outputs + drafted
        num_generated = len(state.output_token_ids) + int(batch.num_in_flight[row]) + ahead
        blocked = banned_ids(params, outputs, num_generated, state.eos_token_id, vocab_size)
        if blocked:
            banned[i] = blocked
        if params.allowed_token_ids:
            allowed[i] = params.allowed_token_ids
        if state.thinking is not None and state.thinking.must_close(drafted):
            allowed[i] = [state.thinking.end]
        if params.logit_bias:
            bias[i] = params.logit_bias
    if processors is not None:  # (no drafts here: one row per request)
        processors.update(states)
    return build_sampling_metadata(
        device,
        temperature=batch.temperature[rows],
        top_p=batch.top_p[rows],
        top_k=batch.top_k[rows],
        min_p=batch.min_p[rows],
        generators=generators,
        max_num_logprobs=max_num_logprobs,
        repetition=batch.repetition_penalty[rows],
        frequency=batch.frequency_penalty[rows],
        presence=batch.presence_penalty[rows],
        seen_tokens=lambda penalized: batch.seen_tokens(rows[penalized], drafts_before[penalized]),
        allowed=allowed,
        banned=banned,
        bias=bias,
        grammar=grammar,
        processors=processors,
    )


def banned_ids(
    params: SamplingParams,
    output_token_ids: list[int],
    num_generated: int,
    eos_token_id: int | None,
    vocab_size: int,
) -> list[int]:
    """Ids a request may not sample next: eos and its stop ids while fewer than ``min_tokens``
    were generated (``num_generated`` counts tokens still in flight too), and the last token of
    each bad word the output just began (read from ``output_token_ids``)."""
    banned = []
    if num_generated < params.min_tokens:
        stops = {*params.stop_token_ids, eos_token_id}
        banned = [t for t in stops if t is not None and t < vocab_size]
    if params.bad_words_token_ids:
        banned += banned_by_bad_words(params.bad_words_token_ids, output_token_ids)
    return banned


def _penalty_arrays(
    num_rows: int,
    repetition: np.ndarray | None,
    frequency: np.ndarray | None,
    presence: np.ndarray | None,
    seen_tokens: SeenTokens | None,
) -> list[np.ndarray]:
    """[rows, prompt ids, output ids, repetition, frequency, presence] of the penalized rows, or
    nothing."""
    rep = np.ones(num_rows, np.float32) if repetition is None else repetition.astype(np.float32)
    freq = np.zeros(num_rows, np.float32) if frequency is None else frequency.astype(np.float32)
    pres = np.zeros(num_rows, np.float32) if presence is None else presence.astype(np.float32)
    rows = np.flatnonzero((rep != 1.0) | (freq != 0.0) | (pres != 0.0))
    if rows.size == 0:
        return []
    assert seen_tokens is not None, "penalties need the rows' tokens"
    prompt, output = seen_tokens(rows)
    return [rows, prompt.astype(np.int64), output.astype(np.int64), rep[rows], freq[rows],
            pres[rows]]  # fmt: skip


def _penalties(tensors: list[torch.Tensor], arrays: list[np.ndarray]) -> Penalties | None:
    if not arrays:
        return None
    _, _, output, _, freq, pres = arrays
    counts = output.shape[1] > 0 and bool(((freq != 0.0) | (pres != 0.0)).any())
    rows, prompt_ids, output_ids, rep, freq_t, pres_t = tensors
    return Penalties(rows, prompt_ids, output_ids, rep, freq_t, pres_t, counts)


def _rule_arrays(
    allowed: dict[int, list[int]], banned: dict[int, list[int]], bias: dict[int, dict[int, float]]
) -> list[np.ndarray]:
    """[allowed rows, (row, id) of each allowed id, of each banned id, (row, id, bias) of each
    biased id], or nothing when no row has a rule."""
    if not (allowed or banned or bias):
        return []
    return [
        np.fromiter(allowed, np.int64, len(allowed)),
        *_flat(allowed),
        *_flat(banned),
        *_flat({row: list(ids) for row, ids in bias.items()}),
        np.fromiter((b for ids in bias.values() for b in ids.values()), np.float32),
    ]


def _flat(ids_by_row: dict[int, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Each (row, id) pair, as a rows array and an ids array."""
    rows = np.repeat(np.fromiter(ids_by_row, np.int64, len(ids_by_row)),
                     [len(ids) for ids in ids_by_row.values()])  # fmt: skip
    ids = np.fromiter((i for ids in ids_by_row.values() for i in ids), np.int64, len(rows))
    return rows, ids


def _pairs(tensors: list[torch.Tensor]) -> tuple:
    allowed_rows, a_rows, a_ids, b_rows, b_ids, c_rows, c_ids, c_bias = tensors
    return allowed_rows, (a_rows, a_ids), (b_rows, b_ids), (c_rows, c_ids, c_bias)


def padded(rows: list[list[int]]) -> np.ndarray:
    """Ragged token lists -> [len(rows), longest] int64, padded with -1."""
    out = np.full((len(rows), max(map(len, rows), default=0)), -1, np.int64)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = ids
    return out
