"""Sampler: greedy, truncation (top-k / top-p / min-p), seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from omniserve.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    banned_by_bad_words,
    compute_logprobs,
)
from omniserve.sampling_params import SamplingParams
from omniserve.worker.sampling_inputs import banned_ids, build_sampling_metadata, padded


def make_metadata(
    params: list[SamplingParams],
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    vocab_size: int = 100,
    eos_token_id: int | None = None,
    generators: dict[int, torch.Generator] | None = None,
    device: torch.device | None = None,
) -> SamplingMetadata:
    """SamplingMetadata the way the model runner builds it, from plain per-row params (on a
    ``device`` other than the CPU, the sampler takes CUDA's paths: no probes)."""
    outputs = outputs if outputs is not None else [[] for _ in params]
    if generators is None:
        generators = {
            i: torch.Generator().manual_seed(p.seed)
            for i, p in enumerate(params)
            if p.seed is not None and not p.greedy
        }

    def column(name: str) -> np.ndarray:
        return np.array([getattr(p, name) for p in params])

    banned = {
        i: ids
        for i, p in enumerate(params)
        if (ids := banned_ids(p, outputs[i], len(outputs[i]), eos_token_id, vocab_size))
    }
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return build_sampling_metadata(
        device or torch.device("cpu"),
        temperature=column("temperature"),
        top_p=column("top_p"),
        top_k=column("top_k"),
        min_p=column("min_p"),
        generators=generators,
        max_num_logprobs=max(logprobs) if logprobs else None,
        repetition=column("repetition_penalty"),
        frequency=column("frequency_penalty"),
        presence=column("presence_penalty"),
        seen_tokens=lambda rows: (
            padded([prompts[r] if prompts else [] for r in rows]),
            padded([outputs[r] for r in rows]),
        ),
        allowed={i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids},
        banned=banned,
        bias={i: p.logit_bias for i, p in enumerate(params) if p.logit_bias},
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> torch.Tensor:
    metadata = make_metadata(params, vocab_size=logits.shape[1], **kwargs)
    return Sampler()(logits.clone(), metadata).sampled_token_ids


def test_greedy_is_argmax_in_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5)] * 3
    tokens = sample(logits, params)
    assert tokens[0::2].tolist() == logits[0::2].argmax(-1).tolist()
    all_greedy = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert all_greedy.tolist() == logits.argmax(-1).tolist()
    # Ties go to the first id, as argmax and transformers' greedy search take it.
    tied = torch.zeros(3, 4096)
    tied[:, [700, 3000, 4095]] = 1.0
    tied[2, 5] = 1.0
    assert sample(tied, [SamplingParams(temperature=0.0)] * 3).tolist() == [700, 700, 5]
    mixed = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0)]
    assert sample(tied, mixed)[::2].tolist() == [700, 5]


def _frequencies(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Empirical token distribution from ``draws`` independent rows in one batch."""
    tokens = sample(logits_row.repeat(draws, 1), [params] * draws)
    return torch.bincount(tokens, minlength=logits_row.numel()).float() / draws


def _assert_matches(freq: torch.Tensor, expected: torch.Tensor, draws: int) -> None:
    assert bool((freq[expected == 0] == 0).all()), "a truncated token was sampled"
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-3  # 5 sigma
    assert bool(((freq - expected).abs() <= tolerance).all()), (freq, expected)


PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(), [0, 1, 2, 3, 4, 5]),
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_p=0.7), [0, 1, 2]),  # mass before token 2 is 0.65 < 0.7
        (SamplingParams(min_p=0.3), [0, 1, 2]),  # p >= 0.3 * 0.4 = 0.12
        (SamplingParams(top_k=4, top_p=0.75), [0, 1, 2]),  # top-p over the renormalized top 4
        (SamplingParams(min_p=0.2, top_p=0.9), [0, 1, 2, 3]),
    ],
)
def test_truncation_keeps_exactly_the_allowed_tokens(
    params: SamplingParams, allowed: list[int]
) -> None:
    torch.manual_seed(1)
    draws = 20000
    freq = _frequencies(PROBS.log(), params, draws)
    expected = torch.zeros_like(PROBS)
    expected[allowed] = PROBS[allowed] / PROBS[allowed].sum()
    _assert_matches(freq, expected, draws)


def test_temperature_reshapes_the_distribution() -> None:
    torch.manual_seed(2)
    draws = 20000
    freq = _frequencies(PROBS.log(), SamplingParams(temperature=0.5), draws)
    sharpened = PROBS**2
    _assert_matches(freq, sharpened / sharpened.sum(), draws)


def test_large_vocab_paths_respect_truncation() -> None:
    """Near-flat logits: nuclei larger than every topk probe force the full-vocab paths."""
    torch.manual_seed(3)
    vocab, draws = 40_000, 200
    logits = torch.randn(vocab) * 0.05
    order = logits.argsort(descending=True)
    probs = logits.softmax(-1)
    for params, allowed_count in [
        (SamplingParams(top_p=0.5), int(((probs[order].cumsum(0) - probs[order]) < 0.5).sum())),
        (SamplingParams(min_p=0.8), int((probs >= 0.8 * probs.max()).sum())),
        (SamplingParams(top_k=1500), 1500),
    ]:
        tokens = sample(logits.repeat(draws, 1), [params] * draws)
        rank_of = torch.empty(vocab, dtype=torch.long)
        rank_of[order] = torch.arange(vocab)
        assert allowed_count > 16_384 or params.top_k  # more than the largest topk probe
        assert int(rank_of[tokens].max()) < allowed_count, params
        assert len(set(tokens.tolist())) > 100  # still random within the allowed set


def test_seeded_rows_reproduce_regardless_of_batch() -> None:
    torch.manual_seed(4)
    vocab = 2000
    target = torch.randn(vocab)
    seeded = SamplingParams(seed=1234, top_p=0.9)
    alone = sample(target[None], [seeded])
    torch.manual_seed(99)  # the global RNG must not matter
    again = sample(target[None], [seeded])
    others = torch.randn(5, vocab)
    batch = torch.cat([others[:2], target[None], others[2:]])
    mixed = sample(
        batch,
        [
            SamplingParams(temperature=0.0),
            SamplingParams(top_k=1500),
            seeded,
            SamplingParams(),
            SamplingParams(min_p=0.1, seed=7),
            SamplingParams(temperature=0.7),
        ],
    )
    assert alone.item() == again.item() == mixed[2].item()
    for params in (
        SamplingParams(seed=5),
        SamplingParams(seed=5, top_k=3),
        SamplingParams(seed=5, min_p=0.2),
    ):
        runs = [
            sample(torch.cat([others[:k], target[None]]), [SamplingParams()] * k + [params])
            for k in range(4)
        ]
        assert len({int(run[-1]) for run in runs}) == 1, params


def test_seeded_sequence_differs_across_steps_and_seeds() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is informative
    generator = torch.Generator().manual_seed(0)
    steps = [
        sample(logits, [SamplingParams(seed=0)], generators={0: generator}).item() for _ in range(5)
    ]
    assert len(set(steps)) > 1
    first_tokens = {sample(logits, [SamplingParams(seed=s)]).item() for s in range(10)}
    assert len(first_tokens) > 1


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]  # untouched row
    metadata = make_metadata(
        params, prompts=[[0, 1], [0, 1, 2]], outputs=[[2, 2, 1, 2], [3, 3]], vocab_size=6
    )
    apply_penalties(logits, metadata.penalties)
    # Row 0: repetition on prompt+output tokens {0, 1, 2}; counts in output: 2 -> 3, 1 -> 1.
    expected = [
        2.0 / 2,  # seen in prompt only: repetition, no frequency/presence
        -1.0 * 2 - 0.5 * 1 - 0.25,  # negative: multiplied; once in output
        0.5 / 2 - 0.5 * 3 - 0.25,  # three times in output
        3.0,
        -2.0,
        1.0,
    ]  # never seen
    assert logits[0].tolist() == pytest.approx(expected)
    assert logits[1].tolist() == pytest.approx([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


def test_penalties_without_prompt_or_output_tokens() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    metadata = make_metadata(
        [SamplingParams(frequency_penalty=1.0)], prompts=None, outputs=[[]], vocab_size=3
    )
    apply_penalties(logits, metadata.penalties)
    assert logits.tolist() == [[1.0, 2.0, 3.0]]


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy]).item() == 0
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.1)
    assert sample(logits, [penalized], prompts=[[0]], outputs=[[]]).item() == 1  # 2/1.1 < 1.9
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.06)
    assert sample(logits, [freq], prompts=[[0]], outputs=[[0]]).item() == 0  # 1.94 > 1.9
    assert sample(logits, [freq], prompts=[[2]], outputs=[[0, 0]]).item() == 1  # 1.88 < 1.9


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert sample(logits, [params], outputs=[[3]], eos_token_id=0).item() == 2
    assert sample(logits, [params], outputs=[[3, 3]], eos_token_id=0).item() == 0
    random_rows = [SamplingParams(min_tokens=3)] * 200
    tokens = sample(
        torch.tensor([[9.0, 0.0, 0.0]]).repeat(200, 1),
        random_rows,
        outputs=[[]] * 200,
        eos_token_id=0,
    )
    assert 0 not in tokens.tolist()


def test_token_rules_allowed_ids_bad_words_and_logit_bias() -> None:
    """Each rule touches only its own row; greedy and random rows alike; logprobs stay raw."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(4, 1)
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]),
        SamplingParams(temperature=0.0, bad_words_token_ids=[[2, 0], [1]]),
        SamplingParams(temperature=0.0, logit_bias={4: 10.0, 0: -100.0}),
        SamplingParams(temperature=0.0),
    ]
    outputs = [[], [2], [], []]  # row 1 just wrote 2: the bad word [2, 0] bans 0, [1] bans 1
    assert sample(logits, params, outputs=outputs).tolist() == [3, 2, 4, 0]
    random_rows = [SamplingParams(allowed_token_ids=[1, 3], logprobs=1)] * 200
    metadata = make_metadata(random_rows, outputs=[[]] * 200, vocab_size=5)
    out = Sampler()(logits[:1].repeat(200, 1), metadata)
    assert set(out.sampled_token_ids.tolist()) == {1, 3}
    assert out.logprobs.token_ids[:, 1].eq(0).all()  # the raw distribution's top token
    assert banned_by_bad_words([[7, 8, 9]], [1, 7, 8]) == [9]
    assert banned_by_bad_words([[7, 8, 9]], [7, 1, 8]) == []


def test_logprobs_are_raw_with_ranks_and_top_k() -> None:
    torch.manual_seed(5)
    logits = torch.randn(4, 50)
    raw = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, top_k=10, logprobs=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_tokens=5),
    ]
    metadata = make_metadata(
        params,
        prompts=[[int(logits[0].argmax())], [1], [2], [3]],
        outputs=[[], [], [], []],
        vocab_size=50,
        eos_token_id=int(logits[3].argmax()),
    )
    out = Sampler()(logits.clone(), metadata)
    assert out.logprobs is not None
    sampled = out.sampled_token_ids
    assert out.logprobs.token_ids.shape == (4, 4)
    assert out.logprobs.token_ids[:, 0].tolist() == sampled.tolist()
    for row in range(4):
        chosen = int(sampled[row])
        assert out.logprobs.logprobs[row, 0].item() == pytest.approx(raw[row, chosen].item())
        assert out.logprobs.ranks[row].item() == int((raw[row] >= raw[row, chosen]).sum())
        top = raw[row].topk(3)
        assert out.logprobs.token_ids[row, 1:].tolist() == top.indices.tolist()
        assert out.logprobs.logprobs[row, 1:].tolist() == pytest.approx(top.values.tolist())
    # Penalized / blocked greedy rows did not pick the raw argmax; their rank shows it.
    assert out.logprobs.ranks[0].item() > 1 and out.logprobs.ranks[3].item() > 1
    assert out.logprobs.ranks[2].item() == 1

    lists = out.logprobs.to_lists(range(1, 2), 1)
    assert lists.token_ids == [[int(sampled[1]), int(raw[1].argmax())]]
    assert lists.ranks == [out.logprobs.ranks[1].item()]
    assert len(out.logprobs.to_lists(range(1), 3).logprobs[0]) == 4


def test_compute_logprobs_for_prompt_positions() -> None:
    torch.manual_seed(6)
    logits = torch.randn(5, 30)
    targets = torch.tensor([3, 7, 7, 0, 29])
    lists = compute_logprobs(logits, targets, 2).to_lists_all(2)
    raw = torch.log_softmax(logits, -1)
    assert [ids[0] for ids in lists.token_ids] == targets.tolist()
    assert all(len(ids) == 3 for ids in lists.token_ids)
    for i, target in enumerate(targets.tolist()):
        assert lists.logprobs[i][0] == pytest.approx(raw[i, target].item())
        assert lists.ranks[i] == int((raw[i] >= raw[i, target]).sum())
        assert lists.token_ids[i][1:] == raw[i].topk(2).indices.tolist()
    zero = compute_logprobs(logits, targets, 0).to_lists_all(0)
    assert zero.token_ids == [[t] for t in targets.tolist()]
    assert math.isclose(sum(math.exp(v) for v in raw[0].tolist()), 1.0, rel_tol=1e-5)


def test_seeded_row_same_token_on_candidate_and_full_vocab_paths() -> None:
    """A top-p nucleus of ~16.8k tokens fits no topk probe when alone (full-vocab sort) but fits
    when a top_k=18000 row enlarges the candidates; the token must not change."""
    vocab = 20_000
    logits = (-5e-5 * torch.arange(vocab, dtype=torch.float32))[
        torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    ]
    other = torch.randn(1, vocab)
    for seed in range(8):
        params = SamplingParams(seed=seed, top_p=0.9)
        alone = sample(logits[None], [params])
        batched = sample(torch.cat([other, logits[None]]), [SamplingParams(top_k=18_000), params])
        assert alone.item() == batched[1].item()


def _mixed_batch(vocab: int) -> tuple[torch.Tensor, list[SamplingParams], dict[str, Any]]:
    """Logits and params of rows on every path and with every rule, seeded (so the draws do
    not depend on the batch or on the path taken)."""
    torch.manual_seed(11)
    logits = torch.randn(10, vocab) * 3
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),
        SamplingParams(seed=1, top_k=7, frequency_penalty=0.5),
        SamplingParams(seed=2, top_p=0.6, presence_penalty=0.3),
        SamplingParams(seed=3, min_p=0.05, bad_words_token_ids=[[4], [9, 8]]),
        SamplingParams(seed=4, top_p=0.95, min_p=0.01, min_tokens=5, stop_token_ids=[1]),
        SamplingParams(seed=5, temperature=0.7),
        SamplingParams(seed=6, top_k=3, top_p=0.5, allowed_token_ids=[2, 3, 5, 7, 11]),
        SamplingParams(seed=7, logit_bias={5: 4.0, 6: -100.0}, logprobs=0),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(seed=8, top_p=1.0, min_p=0.2),
    ]
    kwargs = dict(
        prompts=[[1, 2, 3], [4], [5, 5], [6], [7, 8], [9], [10], [11], [12], [13]],
        outputs=[[2, 2], [3], [], [9], [1, 4], [], [7], [], [0], [5, 5, 5]],
        eos_token_id=0,
        vocab_size=vocab,
    )
    return logits, params, kwargs


@pytest.mark.parametrize("vocab", [64, 3_000])
def test_cuda_paths_draw_the_cpu_paths_tokens(vocab: int) -> None:
    """Without probes (CUDA: rows truncated by top-p / min-p alone sort the vocab at once) every
    row draws the token the probing CPU paths draw."""
    logits, params, kwargs = _mixed_batch(vocab)
    outputs = []
    for probe in (True, False):
        metadata = make_metadata(params, **kwargs)
        metadata.probe = probe
        outputs.append(Sampler()(logits.clone(), metadata))
    assert outputs[0].sampled_token_ids.tolist() == outputs[1].sampled_token_ids.tolist()
    assert outputs[0].logprobs.token_ids.equal(outputs[1].logprobs.token_ids)


class _DeviceReads(TorchFunctionMode):
    """Fails on every op that reads a device tensor back to the host (on CUDA, each waits for
    all the work queued before it): values, truth tests, and shapes that depend on values."""

    READS = frozenset(
        "tolist item __bool__ __int__ __float__ __index__ nonzero argwhere masked_select unique "
        "unique_consecutive repeat_interleave".split()
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        indexes = args[1:2] if name in ("__getitem__", "__setitem__") else ()
        flat = [i for index in indexes for i in (index if isinstance(index, tuple) else (index,))]
        if name in self.READS or any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flat
        ):
            raise AssertionError(f"the sampler read the device back: {name}")
        return func(*args, **(kwargs or {}))


def test_sampling_without_probes_never_reads_the_device() -> None:
    """What CUDA runs (``probe`` off) queues every op without reading a value back, so a step's
    sampling never waits for its forward, nor, with async scheduling, for the next step's."""
    logits, params, kwargs = _mixed_batch(3_000)
    metadata = make_metadata(params, **kwargs)
    metadata.probe = False
    with _DeviceReads():
        Sampler()(logits.clone(), metadata)
    metadata.probe = True
    with pytest.raises(AssertionError, match="read the device back"), _DeviceReads():
        Sampler()(logits.clone(), metadata)


@pytest.mark.gpu
def test_sampling_on_cuda_does_not_synchronize() -> None:
    logits, params, kwargs = _mixed_batch(3_000)
    device = torch.device("cuda")
    generators = {
        i: torch.Generator(device=device).manual_seed(p.seed)
        for i, p in enumerate(params)
        if p.seed is not None and not p.greedy
    }
    metadata = make_metadata(params, **kwargs, generators=generators, device=device)
    assert not metadata.probe
    logits = logits.to(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        Sampler()(logits, metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_rows_with_no_possible_token_are_flagged() -> None:
    """A row whose rules exclude every token (here: its one allowed id, banned as a bad word),
    or whose scores are NaN, is flagged on the device; its id stays a vocabulary id (the next
    step may feed it) and the engine is told -1. Greedy, top-k, top-p and plain random rows
    with a possible token are not flagged, not even with a single possible token."""
    vocab = 100
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))
    logits[3] = torch.nan
    excluded = dict(allowed_token_ids=[7], bad_words_token_ids=[[7]], max_tokens=5)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, **excluded),
        SamplingParams(temperature=1.0, seed=1, **excluded),
        SamplingParams(temperature=0.0),  # NaN scores
        SamplingParams(temperature=1.0, seed=2, top_k=5),
        SamplingParams(temperature=1.0, seed=3, top_p=0.5, **excluded),
        SamplingParams(temperature=1.0, seed=4, allowed_token_ids=[9]),
        SamplingParams(temperature=0.8, seed=5),
    ]
    for probe in (True, False):
        metadata = make_metadata(params, vocab_size=vocab)
        metadata.probe = probe
        out = Sampler()(logits.clone(), metadata)
        flagged = [1, 2, 3, 5]
        assert out.no_token.tolist() == [i in flagged for i in range(8)]
        assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < vocab)).all()
        reported = out.reported_ids().tolist()
        assert [reported[i] for i in flagged] == [-1] * 4
        assert reported[6] == 9 and all(reported[i] >= 0 for i in (0, 4, 7))


def _reference_processed(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Hand-computed processed logits: logit_bias, then (random rows) temperature, min-p, top-k
    and top-p, excluded tokens at -inf."""
    rows = []
    for row, p in zip(logits, params, strict=True):
        x = row.clone()
        for token, bias in (p.logit_bias or {}).items():
            x[token] += bias
        if not p.greedy:
            x = x / p.temperature
            probs = x.softmax(-1)
            keep = probs >= p.min_p * probs.max()
            if p.top_k > 0:
                keep &= x >= x.topk(p.top_k).values[-1]
            if p.top_p < 1.0:
                kept = torch.where(keep, probs, 0.0)
                order = kept.argsort(descending=True)
                before = (kept[order] / kept.sum()).cumsum(0) - kept[order] / kept.sum()
                nucleus = torch.zeros_like(keep)
                nucleus[order[before < p.top_p]] = True
                keep &= nucleus
            x = x.masked_fill(~keep, -torch.inf)
        rows.append(x)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
)
def test_logprobs_modes(mode: str) -> None:
    """vLLM's ``--logprobs-mode``: the raw distribution, or the one each token is drawn from."""
    torch.manual_seed(7)
    logits = torch.randn(5, 60) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=4, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.5, top_k=5, logprobs=4, seed=1),
        SamplingParams(temperature=0.9, top_p=0.5, logprobs=4, seed=2),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=4, seed=3),
        SamplingParams(temperature=2.0, logprobs=4, seed=4),
    ]
    want = {
        "raw_logprobs": torch.log_softmax(logits, -1),
        "raw_logits": logits,
        "processed_logits": _reference_processed(logits, params),
        "processed_logprobs": torch.log_softmax(_reference_processed(logits, params), -1),
    }[mode]
    for _ in range(20):  # different draws: every sampled token has its reported value
        metadata = make_metadata(params, vocab_size=60)
        out = Sampler(mode)(logits.clone(), metadata)
        assert out.logprobs is not None
        sampled = out.sampled_token_ids
        reported = out.logprobs.logprobs
        torch.testing.assert_close(reported[:, 0], want.gather(1, sampled[:, None])[:, 0])
        torch.testing.assert_close(reported[:, 1:], want.topk(4, -1).values)
        if mode.startswith("processed"):
            assert torch.isfinite(reported[:, 0]).all()  # drawn where the processed row allows
