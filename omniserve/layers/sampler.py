"""The sampler: last-position logits of each request -> its next token (and logprobs).

Order of operations (vLLM's): raw logprobs (log_softmax of the model's logits, before anything
else), the token rules (allowed_token_ids, bad words, logit_bias), min_tokens blocking, penalties,
then greedy rows take the argmax and random rows go through temperature, min-p, top-k, top-p and a
random draw.

CPU speed is a design goal (batch 256 x vocab 150k), so:

- Flags in ``SamplingMetadata`` skip whole stages; penalties are applied sparsely to the few
  token ids a row has seen, never as dense [num_reqs, vocab] masks.
- Truncated rows (top-k, or a top-p / min-p nucleus that turns out small) are sampled among the
  top candidates from ``topk``, probing ``_PROBE_SIZES`` in turn; the full vocab is sorted only for
  top-p rows whose nucleus fits in none of them.
- The draw is inverse-CDF in token-id order with ONE uniform per row (not an exponential race
  over the vocab, which costs ~0.9 s per 256 x 150k batch on CPU). A seeded row takes its uniform
  from its own generator, so its token depends only on its own logits, params and seed, never on
  the rest of the batch.
- Total: a row whose weights have no finite positive mass (every token masked, or logits pushed
  to inf/NaN by extreme penalties) takes its most likely remaining token instead of an
  out-of-range draw, so no parameter the front door lets through can fail a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from omniserve.messages import LogprobsLists
from omniserve.sampling_params import SAMPLING_EPS

# Candidates taken with topk for rows truncated only by top-p / min-p, tried in turn (topk of 1k
# costs ~0.1 s, 16k ~0.35 s, a full sort ~2 s on a 256 x 150k batch on 2 CPU cores).
_PROBE_SIZES = (1_024, 16_384)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, one row per request that samples this step."""

    temperature: torch.Tensor  # [num_reqs] float32 (0 for greedy rows)
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [num_reqs] float32 (1.0 = off), or None when no row uses it
    top_k: torch.Tensor | None  # [num_reqs] int64 (0 = off), or None when no row uses it
    min_p: torch.Tensor | None  # [num_reqs] float32 (0.0 = off), or None when no row uses it
    generators: dict[int, torch.Generator]
    """row -> the request's own generator (seeded requests)."""
    max_num_logprobs: int | None
    """Max over rows of the logprobs asked for (None: no row asked)."""
    no_penalties: bool
    presence_penalties: torch.Tensor  # [num_reqs] float32
    frequency_penalties: torch.Tensor  # [num_reqs] float32
    repetition_penalties: torch.Tensor  # [num_reqs] float32
    prompt_token_ids: torch.Tensor | None
    """[num_reqs, max_prompt_len] int64, padded with vocab_size (only when penalties are used)."""
    output_token_ids: list[list[int]]
    """Per row, the tokens generated so far."""
    min_tokens: dict[int, tuple[int, set[int]]]
    """row -> (min_tokens, ids blocked while fewer tokens were generated: eos + stop ids)."""
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """row -> the only ids it may sample."""
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """row -> ids it may not sample this step (the bad words its last tokens began)."""
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    """row -> {token id: bias added to its logit}."""


@dataclass
class LogprobsTensors:
    """Logprobs of a run of rows: per row the chosen token first, then the top-k."""

    token_ids: torch.Tensor  # [num_rows, 1 + k] int64
    logprobs: torch.Tensor  # [num_rows, 1 + k] float32
    ranks: torch.Tensor  # [num_rows] int64: rank of the chosen token (1 = most likely)
    _lists: tuple[list, list, list] | None = field(default=None, init=False, repr=False)

    def to_lists(self, row: int, num_logprobs: int) -> LogprobsLists:
        """Row ``row`` as one position, trimmed to that request's own ``num_logprobs``."""
        ids, logprobs, ranks = self._as_lists()
        width = 1 + num_logprobs
        return LogprobsLists([ids[row][:width]], [logprobs[row][:width]], [ranks[row]])

    def to_lists_all(self, num_logprobs: int) -> LogprobsLists:
        """Every row as consecutive positions (a request's prompt logprobs)."""
        ids, logprobs, ranks = self._as_lists()
        width = 1 + num_logprobs
        return LogprobsLists([r[:width] for r in ids], [r[:width] for r in logprobs], ranks)

    def _as_lists(self) -> tuple[list, list, list]:
        # NOTE: one device->host conversion for all rows; the runner slices it per request.
        if self._lists is None:
            self._lists = (self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())
        return self._lists


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsTensors | None
    """Raw-distribution logprobs of the sampled tokens plus the top ``max_num_logprobs``."""


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of ``token_ids`` (one per row) and the top ``num_logprobs`` under ``logits``.

    ``logits`` [num_rows, vocab]; used by the runner for prompt logprobs.
    """
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, num_logprobs)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Pick the chosen token's logprob and rank plus the top-k out of full ``logprobs``."""
    token_ids = token_ids.long()
    chosen = logprobs.gather(1, token_ids[:, None])  # [num_rows, 1]
    # vLLM's rank: tokens at least as likely as the chosen one (ties count against it).
    ranks = (logprobs >= chosen).sum(-1, dtype=torch.int32).long()  # [num_rows]
    num_logprobs = min(num_logprobs, logprobs.shape[1])
    if num_logprobs == 0:
        return LogprobsTensors(token_ids[:, None], chosen, ranks)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [num_rows, k]
    return LogprobsTensors(
        torch.cat([token_ids[:, None], top_ids], 1), torch.cat([chosen, top_logprobs], 1), ranks
    )


class Sampler(nn.Module):
    """Samples one token per row. NOTE: float32 ``logits`` are consumed (modified in place)."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # [num_reqs, vocab]
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_reqs, vocab]
        if metadata.allowed_token_ids or metadata.banned_token_ids or metadata.logit_bias:
            _apply_token_rules(logits, metadata)
        if metadata.min_tokens:
            _block_min_tokens(logits, metadata)
        if not metadata.no_penalties:
            apply_penalties(logits, metadata)
        sampled = _sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)


def banned_by_bad_words(sequences: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens the output just ended with."""
    banned = []
    for sequence in sequences:
        prefix = sequence[:-1]
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix) :] == prefix:
            banned.append(sequence[-1])
    return banned


def _apply_token_rules(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """allowed_token_ids, bad words and logit_bias, touching only the listed rows."""
    device = logits.device
    for row, allowed in md.allowed_token_ids.items():
        keep = torch.tensor(allowed, device=device)
        values = logits[row, keep]
        logits[row] = -torch.inf
        logits[row, keep] = values
    for row, banned in md.banned_token_ids.items():
        logits[row, torch.tensor(banned, device=device)] = -torch.inf
    for row, bias in md.logit_bias.items():
        ids = torch.tensor(list(bias), device=device)
        logits[row, ids] += torch.tensor(list(bias.values()), device=device)


def _block_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Forbid eos / stop tokens in rows that have not yet generated ``min_tokens``."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, (min_tokens, blocked) in md.min_tokens.items():
        if len(md.output_token_ids[row]) < min_tokens:
            ids = [t for t in blocked if t < vocab]
            rows.extend([row] * len(ids))
            cols.extend(ids)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = -torch.inf


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Repetition (prompt + output tokens, HF-style) and frequency/presence (output tokens, OpenAI).

    Touches only the listed ids: gather their logits, penalize, scatter back. A token listed
    several times gets the same new value from each copy, so duplicate writes agree.
    """
    vocab = logits.shape[1]
    device = logits.device
    rep, freq, pres = md.repetition_penalties, md.frequency_penalties, md.presence_penalties
    rows = ((rep != 1.0) | (freq != 0.0) | (pres != 0.0)).nonzero().squeeze(1)  # [n]
    if rows.numel() == 0:
        return
    outputs = [md.output_token_ids[r] for r in rows.tolist()]
    max_out = max(map(len, outputs))
    out_ids = torch.tensor(
        [o + [vocab] * (max_out - len(o)) for o in outputs], dtype=torch.long, device=device
    ).view(len(outputs), max_out)
    prompt_ids = (
        md.prompt_token_ids[rows].long()
        if md.prompt_token_ids is not None
        else out_ids.new_empty(len(outputs), 0)
    )
    token_ids = torch.cat([prompt_ids, out_ids], 1)  # [n, num_listed]; vocab marks padding
    if token_ids.shape[1] == 0:
        return
    real = token_ids < vocab
    # Padding borrows its row's first real token, so its write repeats a genuine one.
    first_real = token_ids.gather(1, real.int().argmax(1, keepdim=True))
    token_ids = torch.where(real, token_ids, first_real).clamp_(max=vocab - 1)

    values = logits[rows[:, None], token_ids]  # [n, num_listed]
    penalty = rep[rows, None]
    penalized = torch.where(values > 0, values / penalty, values * penalty)
    if max_out and bool(((freq[rows] != 0.0) | (pres[rows] != 0.0)).any()):
        sorted_out = out_ids.sort(1).values  # padding (vocab) sorts last and never matches
        counts = (
            torch.searchsorted(sorted_out, token_ids, right=True)
            - torch.searchsorted(sorted_out, token_ids)
        ).to(values.dtype)
        penalized -= freq[rows, None] * counts + pres[rows, None] * (counts > 0).to(values.dtype)
    # Rows with no token at all (nothing listed) keep their logits.
    penalized = torch.where(real.any(1, keepdim=True), penalized, values)
    logits[rows[:, None], token_ids] = penalized


def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Token per row [num_reqs]: argmax for greedy rows, a truncated random draw for the rest."""
    num_reqs = logits.shape[0]
    if md.all_greedy:
        return logits.argmax(-1)
    device = logits.device
    sampled = torch.empty(num_reqs, dtype=torch.long, device=device)
    is_random = md.temperature >= SAMPLING_EPS  # [num_reqs]
    if not md.all_random:
        greedy_rows = (~is_random).nonzero().squeeze(1)
        sampled[greedy_rows] = _take_rows(logits, greedy_rows).argmax(-1)
    uniform = _uniforms(md, num_reqs, device)  # [num_reqs]
    truncated = torch.zeros(num_reqs, dtype=torch.bool, device=device)
    if md.top_k is not None:
        truncated |= md.top_k > 0
    if md.top_p is not None:
        truncated |= md.top_p < 1.0
    if md.min_p is not None:
        truncated |= md.min_p > 0.0
    full_rows = (is_random & ~truncated).nonzero().squeeze(1)
    candidate_rows = (is_random & truncated).nonzero().squeeze(1)
    for num_probe in _PROBE_SIZES:
        if candidate_rows.numel() == 0:
            break
        candidate_rows = _sample_candidates(logits, candidate_rows, md, uniform, sampled, num_probe)
    full_rows = torch.cat([full_rows, candidate_rows]).sort().values
    if full_rows.numel():
        _sample_full_vocab(logits, full_rows, md, uniform, sampled)
    return sampled


def _uniforms(md: SamplingMetadata, num_reqs: int, device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row; seeded rows draw theirs from their own generator."""
    uniform = torch.rand(num_reqs, device=device)
    for row, generator in md.generators.items():
        uniform[row] = torch.rand(1, generator=generator, device=device)[0]
    return uniform


def _take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]``, without a copy when ``rows`` (sorted, unique) is every row."""
    return x if rows.numel() == x.shape[0] else x[rows]


def _sample_candidates(
    logits: torch.Tensor,
    rows: torch.Tensor,
    md: SamplingMetadata,
    uniform: torch.Tensor,
    sampled: torch.Tensor,
    num_probe: int,
) -> torch.Tensor:
    """Sample truncated ``rows`` among their top candidates; return the rows that did not fit.

    Candidates: the largest top-k among ``rows``, or ``num_probe`` if larger and some row has no
    top-k.

    A row fits when everything its top-k / min-p / top-p keep lies among the candidates (the kept
    set is always a prefix of the value-sorted order, so checking the last candidate suffices).
    """
    x = _take_rows(logits, rows)  # [n, vocab]
    vocab = x.shape[1]
    top_k = md.top_k[rows] if md.top_k is not None else torch.zeros_like(rows)
    num_candidates = int(top_k.max())
    if not bool((top_k > 0).all()):
        num_candidates = max(num_candidates, num_probe)
    num_candidates = min(num_candidates, vocab)
    values, ids = x.topk(num_candidates, dim=-1)  # [n, C], sorted descending
    temperature = md.temperature[rows, None]  # [n, 1]
    values = values / temperature
    keep = _keep_candidates(values, x, temperature, top_k, md, rows)  # [n, C]
    fits = (top_k > 0) | ~keep[:, -1]
    fit = fits.nonzero().squeeze(1)
    if fit.numel():
        ids_by_id, order = ids[fit].sort(-1)  # draw in token-id order, as the full path does
        weights = (values[fit] - values[fit, :1]).exp().masked_fill(~keep[fit], 0.0)
        picked = _draw(weights.gather(1, order), uniform[rows[fit]])
        drawn = ids_by_id.gather(1, picked.clamp(min=0)[:, None]).squeeze(1)
        sampled[rows[fit]] = torch.where(picked >= 0, drawn, ids[fit, 0])
    return rows[~fits]


def _keep_candidates(
    values: torch.Tensor,
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    md: SamplingMetadata,
    rows: torch.Tensor,
) -> torch.Tensor:
    """Which of the value-sorted candidates [n, C] survive top-k, then min-p, then top-p."""
    num_candidates = values.shape[1]
    position = torch.arange(num_candidates, device=values.device)
    keep = position < torch.where(top_k > 0, top_k, num_candidates)[:, None]
    keep &= values > -torch.inf
    log_min_p = None
    if md.min_p is not None:
        log_min_p = md.min_p[rows].log()[:, None]  # log(0) = -inf keeps everything
        keep &= values >= values[:, :1] + log_min_p
    if md.top_p is None:
        return keep
    top_p = md.top_p[rows]
    masked = values.masked_fill(~keep, -torch.inf)
    log_mass = masked.logsumexp(-1)  # [n]
    # Survivors may run past the candidates (no top-k, min-p not cutting): top-p must then be
    # normalized over the whole row.
    spill = (keep[:, -1] & (top_k == 0) & (top_p < 1.0)).nonzero().squeeze(1)
    if spill.numel():
        scaled = x[spill] / temperature[spill]  # [num_spill, vocab]
        if log_min_p is not None:
            scaled.masked_fill_(scaled < values[spill, :1] + log_min_p[spill], -torch.inf)
        log_mass[spill] = scaled.logsumexp(-1)
    probs = (masked - log_mass[:, None]).exp()
    mass_before = probs.cumsum(-1) - probs
    # The most likely candidate always survives top-p, however small top_p is.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0) | (position == 0)
    return keep


def _sample_full_vocab(
    logits: torch.Tensor,
    rows: torch.Tensor,
    md: SamplingMetadata,
    uniform: torch.Tensor,
    sampled: torch.Tensor,
) -> None:
    """Sample ``rows`` (no top-k) over the whole vocab, with their min-p and top-p."""
    scaled = _take_rows(logits, rows)
    temperature = md.temperature[rows, None]
    # Divide in place when the rows are the whole batch (the logits are ours to consume).
    scaled = scaled.div_(temperature) if scaled is logits else scaled / temperature  # [n, vocab]
    row_max, row_argmax = scaled.max(-1, keepdim=True)  # [n, 1]
    if md.min_p is not None:
        min_p = md.min_p[rows, None]
        scaled.masked_fill_(scaled < row_max + min_p.log(), -torch.inf)
    if md.top_p is not None:
        nucleus = (md.top_p[rows] < 1.0).nonzero().squeeze(1)
        if nucleus.numel():
            _mask_top_p(scaled, nucleus, md.top_p[rows[nucleus]])
    weights = scaled.sub_(row_max).exp_()  # [n, vocab], 0 where masked
    picked = _draw(weights, uniform[rows])
    sampled[rows] = torch.where(picked >= 0, picked, row_argmax.squeeze(1))


def _mask_top_p(scaled: torch.Tensor, nucleus: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask (in place) the tokens of rows ``nucleus`` outside their top-p nucleus; sorts the vocab.

    Tokens tied with the smallest kept value are kept too.
    """
    sub = scaled[nucleus]  # [m, vocab]
    values = sub.sort(-1, descending=True).values
    probs = values.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    num_keep = (mass_before < top_p[:, None]).sum(-1, keepdim=True).clamp_(min=1)
    cutoff = values.gather(1, num_keep - 1)  # [m, 1]
    scaled[nucleus] = sub.masked_fill_(sub < cutoff, -torch.inf)


def _draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: per row, the position whose cumulative weight first exceeds u * total.

    ``weights`` [n, m] non-negative, unnormalized (consumed: turned into their cumulative sum in
    place); ``uniform`` [n] in [0, 1). Zero-weight positions are never picked; a row without a
    finite positive total (all masked, inf or NaN weights) gets -1, for the caller's fallback.
    """
    cumulative = weights.cumsum_(-1)  # [n, m]
    total = cumulative[:, -1:]
    # Strictly below the total even when u * total rounds up to it.
    target = torch.minimum(uniform[:, None] * total, total.nextafter(torch.zeros_like(total)))
    picked = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    has_mass = ((total > 0) & (total < torch.inf)).squeeze(1)  # NaN fails both
    return picked.masked_fill_(~has_mass, -1)
