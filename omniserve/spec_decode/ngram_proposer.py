"""N-gram speculative decoding (prompt lookup): propose drafts, keep the verified ones.

A request whose last n tokens occurred earlier in its own prompt or output (copying, quoting,
code edits, repetition) is likely to continue as it did then. The proposer copies up to ``k``
tokens that followed that earlier occurrence; the next step feeds them after the request's last
token, so one forward scores k + 1 positions, and the runner keeps the longest prefix of drafts
the model agrees with plus the model's own next token (``accept_drafts``). On a memory-bound
decode the forward costs little more for k + 1 positions than for one.

Exactness: position i of a step with drafts ``d`` is sampled from the model's distribution
given the real tokens and ``d[:i]`` (its own row of the sampler, with the request's settings),
giving ``t[i]``; ``t[i]`` is kept only while every earlier draft was kept, i.e. while its context
is the real one. Draft ``d[i]`` is kept iff ``t[i] == d[i]``, which happens with probability
``p_i(d[i])``; otherwise ``t[i]`` is a draw from ``p_i`` conditioned on differing from ``d[i]``.
That is speculative sampling's accept/resample rule for a draft that puts all its mass on one
token (an n-gram lookup does), so every output token has the model's distribution: greedy
requests get the same tokens as without drafts, random ones the same distribution.

Each verifying row samples with the request's settings as they would stand at its position,
the drafts before it counted as the request's tokens (penalties, bad words, ``min_tokens``): so
its distribution is the one the request would have there. Requests under a grammar or speaking
take no drafts (``takes_drafts``) and decode one token per step as before.
"""

from __future__ import annotations

import numpy as np

from omniserve.config import SpeculativeConfig
from omniserve.sampling_params import SamplingParams


def takes_drafts(params: SamplingParams) -> bool:
    """Whether a request's drafts can be verified: not under a grammar (its matcher would have
    to advance through each draft and back) nor with audio output (the talker follows each
    token as it is sampled)."""
    return params.structured_outputs is None and not params.wants_audio


def accept_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a step produced for one request: ``sampled`` holds its k + 1 rows' tokens
    (-1: the row had no token), ``drafts`` the k tokens fed. Keeps rows while the draft before
    each equals what the model sampled there (see the module docstring)."""
    num_kept = 1
    while (
        num_kept <= len(drafts)
        and sampled[num_kept - 1] >= 0
        and sampled[num_kept - 1] == drafts[num_kept - 1]
    ):
        num_kept += 1
    return sampled[:num_kept]


class NgramProposer:
    """Drafts from a request's own tokens: the continuation of the longest earlier match (of
    ``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens) of its last tokens."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: np.ndarray) -> list[int]:
        """Drafts to feed after ``token_ids`` (a request's prompt + output), maybe none.

        Among earlier occurrences of the last token, the one whose match with the sequence's end
        runs longest wins (at least ``min_n``, counted up to ``max_n``); ties go to the one with
        the most tokens after it (up to k), then to the latest. Vectorised: one comparison pass
        over the sequence, then a few over the candidates."""
        length = len(token_ids)
        k = min(self.k, self.max_model_len - length)  # drafts sit at positions < max_model_len
        if k <= 0 or length <= self.min_n:
            return []
        ends = np.flatnonzero(token_ids[: length - 1] == token_ids[-1])  # candidate match ends
        ends = ends[ends >= self.min_n - 1]
        if ends.size == 0:
            return []
        matched = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, self.max_n):
            alive &= ends >= back
            if not alive.any():
                break
            alive[alive] = token_ids[ends[alive] - back] == token_ids[length - 1 - back]
            matched += alive
        good = np.flatnonzero(matched >= self.min_n)
        if good.size == 0:
            return []
        following = np.minimum(length - 1 - ends[good], k)
        # lexsort: the last key is the primary one; the best candidate sorts last.
        best = good[np.lexsort((ends[good], following, matched[good]))[-1]]
        start = int(ends[best]) + 1
        return token_ids[start : start + k].tolist()
