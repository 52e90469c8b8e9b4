"""The sampler: last-position logits of each request -> its next token (and logprobs).

Order of operations (vLLM's): a grammar's mask, raw logprobs (log_softmax of those logits,
before anything else), the token rules (allowed_token_ids, then the banned ids: bad words and,
before min_tokens, eos / stop ids; then logit_bias, which leaves a banned id at -inf), custom
logits processors that may change the argmax, penalties, then greedy rows take the argmax and
random rows go through temperature, the argmax-invariant custom processors, min-p, top-k, top-p
and a random draw. The reported logprobs are the raw ones or, by ``logprobs_mode``, the processed
distribution each row draws from (``processed_logits``), as logprobs or logits.

CPU speed is a design goal (batch 256 x vocab 150k), so:

- ``SamplingMetadata`` says on the host which rows take which path, and stages no row needs are
  skipped; penalties are applied sparsely to the few token ids a row has seen, never as dense
  [num_reqs, vocab] masks.
- Rows with a top-k are sampled among their top candidates from ``topk``. On CPU, rows truncated
  by top-p / min-p alone probe ``_PROBE_SIZES`` candidates in turn, and the full vocab is sorted
  only for those whose nucleus fits in none of them (on CUDA they sort at once: the probe's check
  would read the device back, see ``SamplingMetadata``).
- The draw is inverse-CDF in token-id order with ONE uniform per row (not an exponential race
  over the vocab, which costs ~0.9 s per 256 x 150k batch on CPU). A seeded row takes its uniform
  from its own generator, so its token depends only on its own logits, params and seed, never on
  the rest of the batch.
- Total: a row whose weights have no finite positive mass (every token masked, or logits pushed
  to inf/NaN by extreme penalties) takes its most likely remaining token instead of an
  out-of-range draw, so no parameter the front door lets through can fail a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from omniserve.logits_processor import LogitsProcessor
from omniserve.messages import LogprobsLists

# Candidates taken with topk for rows truncated only by top-p / min-p, tried in turn (topk of 1k
# costs ~0.1 s, 16k ~0.35 s, a full sort ~2 s on a 256 x 150k batch on 2 CPU cores).
_PROBE_SIZES = (1_024, 16_384)


@dataclass
class Penalties:
    """The rows with a repetition, frequency or presence penalty, and the tokens they have seen."""

    rows: torch.Tensor  # [m] int64: batch rows
    prompt_token_ids: torch.Tensor  # [m, max_prompt_len] int64, padded with -1
    output_token_ids: torch.Tensor  # [m, max_output_len] int64, padded with -1
    repetition: torch.Tensor  # [m] float32
    frequency: torch.Tensor  # [m] float32
    presence: torch.Tensor  # [m] float32
    counts_outputs: bool
    """Some row has a frequency or presence penalty and output tokens (they need counting)."""


@dataclass
class TokenRules:
    """allowed_token_ids, banned ids (bad words just begun, eos / stop ids before min_tokens)
    and logit_bias, as flat (row, token id) index pairs."""

    allowed_rows: torch.Tensor  # [a] int64: rows restricted to their allowed ids
    allowed: tuple[torch.Tensor, torch.Tensor]  # (rows, ids) of every allowed id
    banned: tuple[torch.Tensor, torch.Tensor]  # (rows, ids) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, ids, bias added)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, one row per request that samples this step.

    Which rows take which path is decided on the host (``*_rows``), so that on CUDA sampling
    never reads the device back: a read would wait for the whole step, and with async
    scheduling for the next step's forward too."""

    temperature: torch.Tensor  # [num_reqs] float32 (0 for greedy rows)
    all_greedy: bool
    top_p: torch.Tensor | None  # [num_reqs] float32 (1.0 = off), or None when no row uses it
    top_k: torch.Tensor | None  # [num_reqs] int64 (0 = off), or None when no row uses it
    min_p: torch.Tensor | None  # [num_reqs] float32 (0.0 = off), or None when no row uses it
    greedy_rows: torch.Tensor  # [g] int64
    top_k_rows: torch.Tensor  # [k] random rows with a top-k: drawn among their top candidates
    max_top_k: int
    nucleus_rows: torch.Tensor  # random rows truncated by top-p / min-p alone
    plain_rows: torch.Tensor  # random rows drawn over the whole vocab, untruncated
    probe: bool
    """Try ``nucleus_rows`` among ``_PROBE_SIZES`` candidates before sorting the vocab (CPU:
    the check reads the device; on CUDA the vocab sort is cheap and needs no read)."""
    generators: dict[int, torch.Generator]
    """row -> the request's own generator (seeded requests)."""
    max_num_logprobs: int | None
    """Max over rows of the logprobs asked for (None: no row asked)."""
    penalties: Penalties | None = None
    rules: TokenRules | None = None
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None
    """Rows [g] under a grammar, and the ids each may sample next ([g, vocab] bool): applied
    before anything else (raw logprobs included), as vLLM masks the model's logits."""
    processors: Sequence[LogitsProcessor] = ()
    """Custom logits processors that may change the argmax, their batch being these rows."""
    random_processors: Sequence[LogitsProcessor] = ()
    """Argmax-invariant custom processors: run after temperature, unless every row is greedy."""


@dataclass
class LogprobsTensors:
    """Logprobs of a run of rows: per row the chosen token first, then the top-k."""

    token_ids: torch.Tensor  # [num_rows, 1 + k] int64
    logprobs: torch.Tensor  # [num_rows, 1 + k] float32
    ranks: torch.Tensor  # [num_rows] int64: rank of the chosen token (1 = most likely)
    _lists: tuple[list, list, list] | None = field(default=None, init=False, repr=False)

    def tensors(self) -> list[torch.Tensor]:
        """The fields, in the order the constructor takes them."""
        return [self.token_ids, self.logprobs, self.ranks]

    def to_lists(self, rows: range, num_logprobs: int) -> LogprobsLists:
        """``rows`` as consecutive positions of one request, trimmed to its ``num_logprobs``."""
        ids, logprobs, ranks = self._as_lists()
        width = 1 + num_logprobs
        return LogprobsLists([ids[r][:width] for r in rows], [logprobs[r][:width] for r in rows],
                             [ranks[r] for r in rows])  # fmt: skip

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
    sampled_token_ids: torch.Tensor
    """[num_reqs] int64, always a vocabulary id (the next step may feed it to the model)."""
    logprobs: LogprobsTensors | None
    """Logprobs (by the sampler's ``logprobs_mode``) of the sampled tokens plus the top
    ``max_num_logprobs``."""
    no_token: torch.Tensor
    """[num_reqs] bool: the row had no token to sample (its rules and grammar excluded every
    one, or its scores were not finite); its sampled id is a stand-in."""

    def reported_ids(self) -> torch.Tensor:
        """The sampled ids with -1 where there was no token: what the engine is told."""
        return torch.where(self.no_token, -1, self.sampled_token_ids)


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
    """Samples one token per row. NOTE: float32 ``logits`` are consumed (modified in place).

    ``logprobs_mode`` (``config.LOGPROBS_MODES``): what the reported logprobs are of."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # [num_reqs, vocab]
        if metadata.grammar is not None:
            rows, allowed = metadata.grammar
            logits[rows] = logits[rows].masked_fill_(~allowed, -torch.inf)
        mode = self.logprobs_mode if metadata.max_num_logprobs is not None else None
        reported = None  # [num_reqs, vocab]
        if mode == "raw_logprobs":
            reported = torch.log_softmax(logits, dim=-1)
        elif mode == "raw_logits":
            reported = logits.clone()
        if metadata.rules is not None:
            _apply_token_rules(logits, metadata.rules)
        logits = apply_processors(metadata.processors, logits)
        if metadata.penalties is not None:
            apply_penalties(logits, metadata.penalties)
        if metadata.random_processors and not metadata.all_greedy:
            logits, metadata = _temperature_first(logits, metadata)
        if mode in ("processed_logprobs", "processed_logits"):
            reported = processed_logits(logits, metadata)
            if mode == "processed_logprobs":
                reported = torch.log_softmax(reported, dim=-1)
        sampled = _sample(logits, metadata)
        # A draw only lands on an excluded (-inf) token when every token is excluded; a NaN
        # score fails the comparison too. One gather: no pass over the vocabulary.
        no_token = ~(logits.gather(1, sampled[:, None]).squeeze(1) > -torch.inf)
        logprobs = None
        if reported is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(reported, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs, no_token)


def processed_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits each row draws from (a copy), as vLLM's ``processed_logits``: random rows'
    divided by their temperature, with the tokens min-p, top-k and top-p exclude at -inf; greedy
    rows' as the token rules and penalties left them. Costs a vocabulary sort for top-p rows:
    only the processed logprobs modes run it."""
    processed = logits.clone()
    random_rows = torch.cat([md.top_k_rows, md.nucleus_rows, md.plain_rows])
    if random_rows.numel() == 0:
        return processed
    scaled = processed[random_rows] / md.temperature[random_rows, None]  # [n, vocab]
    if md.min_p is not None:
        row_max = scaled.max(-1, keepdim=True).values
        scaled.masked_fill_(scaled < row_max + md.min_p[random_rows, None].log(), -torch.inf)
    if md.top_k is not None:
        top_k = md.top_k[random_rows]
        cut = (top_k > 0).nonzero().squeeze(1)
        if cut.numel():
            values = scaled[cut].topk(min(md.max_top_k, scaled.shape[1]), dim=-1).values
            kth = values.gather(1, (top_k[cut, None] - 1).clamp(max=values.shape[1] - 1))
            scaled[cut] = scaled[cut].masked_fill(scaled[cut] < kth, -torch.inf)
    if md.top_p is not None:
        _mask_top_p(scaled, md.top_p[random_rows])
    processed[random_rows] = scaled
    return processed


def apply_processors(processors: Sequence[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` through each custom processor in turn; a processor may return a new tensor,
    which must have the logits' shape and dtype."""
    for processor in processors:
        out = processor.apply(logits)
        if out is not logits and (
            not isinstance(out, torch.Tensor)
            or out.shape != logits.shape
            or out.dtype != logits.dtype
        ):
            got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else repr(out)
            raise TypeError(f"logits processor {type(processor).__qualname__}.apply returned "
                            f"{got}, not {logits.dtype} {list(logits.shape)} logits.")  # fmt: skip
        logits = out
    return logits


def _temperature_first(
    logits: torch.Tensor, md: SamplingMetadata
) -> tuple[torch.Tensor, SamplingMetadata]:
    """Divide the random rows by their temperature now (vLLM's order) and run the
    argmax-invariant processors on every row; the metadata returned has temperature 1, so the
    draws below do not divide again."""
    divisor = md.temperature.clone()
    divisor[md.greedy_rows] = 1.0
    logits = apply_processors(md.random_processors, logits.div_(divisor[:, None]))
    return logits, dataclasses.replace(md, temperature=torch.ones_like(md.temperature))


def banned_by_bad_words(sequences: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens the output just ended with."""
    banned = []
    for sequence in sequences:
        prefix = sequence[:-1]
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix) :] == prefix:
            banned.append(sequence[-1])
    return banned


def _apply_token_rules(logits: torch.Tensor, rules: TokenRules) -> None:
    """Allowed ids, then banned ids, then the bias (a banned id stays -inf)."""
    if rules.allowed_rows.numel():
        rows, ids = rules.allowed
        values = logits[rows, ids]
        logits[rules.allowed_rows] = -torch.inf
        logits[rows, ids] = values
    rows, ids = rules.banned
    if rows.numel():
        logits[rows, ids] = -torch.inf
    rows, ids, bias = rules.bias
    if rows.numel():
        logits[rows, ids] += bias


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> None:
    """Repetition (prompt + output tokens, HF-style) and frequency/presence (output tokens, OpenAI).

    Touches only the listed ids: gather their logits, penalize, scatter back. A token listed
    several times gets the same new value from each copy, so duplicate writes agree.
    """
    p = penalties
    token_ids = torch.cat([p.prompt_token_ids, p.output_token_ids], 1)  # -1 marks padding
    if token_ids.shape[1] == 0:
        return
    real = token_ids >= 0
    # Padding borrows its row's first real token, so its write repeats a genuine one.
    first_real = token_ids.gather(1, real.int().argmax(1, keepdim=True))
    token_ids = torch.where(real, token_ids, first_real).clamp_(min=0)

    rows = p.rows[:, None]
    values = logits[rows, token_ids]  # [m, num_listed]
    penalty = p.repetition[:, None]
    penalized = torch.where(values > 0, values / penalty, values * penalty)
    if p.counts_outputs:
        sorted_out = p.output_token_ids.sort(1).values  # padding (-1) never matches
        counts = (
            torch.searchsorted(sorted_out, token_ids, right=True)
            - torch.searchsorted(sorted_out, token_ids)
        ).to(values.dtype)
        seen = (counts > 0).to(values.dtype)
        penalized -= p.frequency[:, None] * counts + p.presence[:, None] * seen
    # Rows with no token at all (nothing listed) keep their logits.
    penalized = torch.where(real.any(1, keepdim=True), penalized, values)
    logits[rows, token_ids] = penalized


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first highest score's id per row, as ``argmax``: torch's CPU ``argmax`` is a scalar
    loop, ``max`` a vectorised one (3.3 ms against 1.3 at 32 x 151,936 fp32, 2 cores)."""
    return logits.max(-1).indices


def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Token per row [num_reqs]: argmax for greedy rows, a truncated random draw for the rest."""
    num_reqs = logits.shape[0]
    if md.all_greedy:
        return _argmax(logits)
    device = logits.device
    sampled = torch.empty(num_reqs, dtype=torch.long, device=device)
    if md.greedy_rows.numel():
        sampled[md.greedy_rows] = _argmax(_take_rows(logits, md.greedy_rows))
    uniform = _uniforms(md, num_reqs, device)  # [num_reqs]
    if md.top_k_rows.numel():
        _sample_candidates(logits, md.top_k_rows, md, uniform, sampled, md.max_top_k, False)
    nucleus_rows = md.nucleus_rows
    for num_probe in _PROBE_SIZES if md.probe else ():
        if nucleus_rows.numel() == 0:
            break
        nucleus_rows = _sample_candidates(logits, nucleus_rows, md, uniform, sampled,
                                          num_probe, True)  # fmt: skip
    if nucleus_rows.numel():
        _sample_full_vocab(logits, nucleus_rows, md, uniform, sampled, truncated=True)
    if md.plain_rows.numel():
        _sample_full_vocab(logits, md.plain_rows, md, uniform, sampled, truncated=False)
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
    num_candidates: int,
    probe: bool,
) -> torch.Tensor:
    """Sample truncated ``rows`` among their top ``num_candidates``; return the rows that did not
    fit.

    Rows with a top-k (``num_candidates`` their largest) always fit. A ``probe`` of rows without
    one keeps those whose min-p / top-p keep only candidates: the kept set is always a prefix of
    the value-sorted order, so checking the last candidate suffices (a read of the device).
    """
    x = _take_rows(logits, rows)  # [n, vocab]
    values, ids = x.topk(min(num_candidates, x.shape[1]), dim=-1)  # [n, C], sorted descending
    temperature = md.temperature[rows, None]  # [n, 1]
    values = values / temperature
    top_k = md.top_k[rows] if md.top_k is not None and not probe else None
    keep = _keep_candidates(values, x, temperature, top_k, md, rows)  # [n, C]
    left = rows[:0]
    if probe:
        fits = ~keep[:, -1]
        fit, left = fits.nonzero().squeeze(1), rows[~fits]
        rows, ids, values, keep = rows[fit], ids[fit], values[fit], keep[fit]
    ids_by_id, order = ids.sort(-1)  # draw in token-id order, as the full path does
    weights = (values - values[:, :1]).exp().masked_fill(~keep, 0.0)
    picked = _draw(weights.gather(1, order), uniform[rows])
    drawn = ids_by_id.gather(1, picked.clamp(min=0)[:, None]).squeeze(1)
    sampled[rows] = torch.where(picked >= 0, drawn, ids[:, 0])
    return left


def _keep_candidates(
    values: torch.Tensor,
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    md: SamplingMetadata,
    rows: torch.Tensor,
) -> torch.Tensor:
    """Which of the value-sorted candidates [n, C] survive top-k, then min-p, then top-p."""
    position = torch.arange(values.shape[1], device=values.device)
    keep = values > -torch.inf
    if top_k is not None:
        keep &= position < top_k[:, None]
    log_min_p = None
    if md.min_p is not None:
        log_min_p = md.min_p[rows].log()[:, None]  # log(0) = -inf keeps everything
        keep &= values >= values[:, :1] + log_min_p
    if md.top_p is None:
        return keep
    top_p = md.top_p[rows]
    masked = values.masked_fill(~keep, -torch.inf)
    log_mass = masked.logsumexp(-1)  # [n]
    if top_k is None:
        # Survivors may run past the candidates (min-p not cutting): top-p must then be
        # normalized over the whole row.
        spill = (keep[:, -1] & (top_p < 1.0)).nonzero().squeeze(1)
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
    truncated: bool,
) -> None:
    """Sample ``rows`` (no top-k) over the whole vocab, with their min-p and top-p when
    ``truncated``."""
    scaled = _take_rows(logits, rows)
    temperature = md.temperature[rows, None]
    # Divide in place when the rows are the whole batch (the logits are ours to consume).
    scaled = scaled.div_(temperature) if scaled is logits else scaled / temperature  # [n, vocab]
    row_max, row_argmax = scaled.max(-1, keepdim=True)  # [n, 1]
    if truncated and md.min_p is not None:
        scaled.masked_fill_(scaled < row_max + md.min_p[rows, None].log(), -torch.inf)
    if truncated and md.top_p is not None:
        _mask_top_p(scaled, md.top_p[rows])
    weights = scaled.sub_(row_max).exp_()  # [n, vocab], 0 where masked
    picked = _draw(weights, uniform[rows])
    sampled[rows] = torch.where(picked >= 0, picked, row_argmax.squeeze(1))


def _mask_top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask (in place) the tokens of each row outside its top-p nucleus (a row with top_p 1
    keeps all); sorts the vocab. Tokens tied with the smallest kept value are kept too."""
    values = scaled.sort(-1, descending=True).values
    probs = values.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    num_keep = (mass_before < top_p[:, None]).sum(-1, keepdim=True).clamp_(min=1)
    num_keep = torch.where(top_p[:, None] >= 1.0, values.shape[1], num_keep)
    cutoff = values.gather(1, num_keep - 1)  # [n, 1]
    scaled.masked_fill_(scaled < cutoff, -torch.inf)


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
