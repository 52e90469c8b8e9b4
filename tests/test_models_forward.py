"""Each zoo model, run through the paged cache, against transformers on its checkpoint (fp32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import model_zoo
from omniserve.attention import AttentionMetadata, get_attention_layers
from omniserve.forward_context import set_forward_context
from omniserve.registry import ModelRegistry
from omniserve.worker.model_loader import load_model_weights

ARCHS = ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"]
BLOCK_SIZE = 4
ATOL = 1e-4


def load_ours(model_dir: Path) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(model_dir)
    model_zoo.register()
    model = ModelRegistry.resolve_model_cls(config.architectures[0])(config)
    load_model_weights(model, model_dir)
    return model.eval()


class PagedRunner:
    """A minimal model runner: per-request block lists, one flattened batch per step."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 64) -> None:
        self.model = model
        for layer in get_attention_layers(model):
            layer.kv_cache = torch.zeros(
                2, num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size
            )
        # Hand out blocks in a scrambled order so requests never own contiguous memory.
        self.free_blocks = list(reversed(range(1, num_blocks)))
        self.blocks: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    @torch.no_grad()
    def step(self, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run the new tokens of each (request id, token ids); return each request's logits."""
        positions, slots, seq_lens, tables = [], [], [], []
        for req_id, token_ids in batch:
            start = self.num_computed.get(req_id, 0)
            end = start + len(token_ids)
            blocks = self.blocks.setdefault(req_id, [])
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free_blocks.pop(len(self.free_blocks) // 2))
            positions += range(start, end)
            slots += [
                blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
            seq_lens.append(end)
            tables.append(blocks)
            self.num_computed[req_id] = end
        query_lens = [len(ids) for _, ids in batch]
        max_blocks = max(len(t) for t in tables)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(
                [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor(
                [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor([t for _, ids in batch for t in ids])
        with set_forward_context(metadata):
            hidden = self.model(input_ids, torch.tensor(positions))
        return list(self.model.compute_logits(hidden).split(query_lens))


@pytest.fixture(scope="module", params=ARCHS)
def models(
    request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]
) -> tuple[torch.nn.Module, torch.nn.Module, int]:
    model_dir = tiny_checkpoint(request.param)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return load_ours(model_dir), hf, hf.config.vocab_size


def hf_logits(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()  # [seq_len, vocab]


def tokens(vocab_size: int, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=gen).tolist()


def test_prefill_matches_hf(models: tuple) -> None:
    ours, hf, vocab = models
    prompt = tokens(vocab, 21, seed=0)
    (logits,) = PagedRunner(ours).step([("a", prompt)])
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_hf(models: tuple) -> None:
    ours, hf, vocab = models
    seq = tokens(vocab, 24, seed=1)
    runner = PagedRunner(ours)
    got = runner.step([("a", seq[:9])]) + runner.step([("a", seq[9:21])])
    got += [runner.step([("a", [t])])[0] for t in seq[21:]]
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, seq), atol=ATOL, rtol=0)


def test_mixed_batch_equals_per_request(models: tuple) -> None:
    ours, hf, vocab = models
    a, b, c = tokens(vocab, 14, seed=2), tokens(vocab, 11, seed=3), tokens(vocab, 17, seed=4)
    runner = PagedRunner(ours)
    runner.step([("a", a[:13]), ("c", c[:6])])
    # one step: a decodes, b starts its prefill, c prefills its second chunk (cached context)
    logits_b, logits_a, logits_c = runner.step([("b", b), ("a", a[13:]), ("c", c[6:])])
    torch.testing.assert_close(logits_a, hf_logits(hf, a)[13:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits_b, hf_logits(hf, b), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits_c, hf_logits(hf, c)[6:], atol=ATOL, rtol=0)
    # two decodes together
    logits_a2, logits_b2 = runner.step([("a", [5]), ("b", [7])])
    torch.testing.assert_close(logits_a2, hf_logits(hf, a + [5])[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits_b2, hf_logits(hf, b + [7])[-1:], atol=ATOL, rtol=0)


def test_inputs_embeds_and_dummy_forward(models: tuple) -> None:
    ours, hf, vocab = models
    prompt = tokens(vocab, 10, seed=5)
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    with torch.no_grad(), set_forward_context(None):  # no cache: one causal sequence
        from_ids = ours(ids, positions)
        from_embeds = ours(None, positions, inputs_embeds=ours.get_input_embeddings(ids))
    torch.testing.assert_close(from_embeds, from_ids, atol=0, rtol=0)
    logits = ours.compute_logits(from_ids)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_sliding_window_matches_hf(tiny_checkpoint: Callable[..., Path]) -> None:
    # Layer 0 full attention, layer 1 a 5-token window (Qwen2's max_window_layers rule).
    model_dir = tiny_checkpoint(
        "Qwen2ForCausalLM",
        overrides={"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    )
    ours = load_ours(model_dir)
    assert [layer.sliding_window for layer in get_attention_layers(ours)] == [None, 5]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq = tokens(hf.config.vocab_size, 16, seed=6)
    windowless = load_ours(model_dir)
    for layer in get_attention_layers(windowless):
        layer.sliding_window = None
    full_attention_logits = PagedRunner(windowless).step([("a", seq)])[0]
    # the window matters for this sequence
    assert not torch.allclose(full_attention_logits, hf_logits(hf, seq), atol=1e-2)
    runner = PagedRunner(ours)
    got = runner.step([("a", seq[:11])]) + runner.step([("a", seq[11:14])])
    got += [runner.step([("a", [t])])[0] for t in seq[14:]]
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, seq), atol=ATOL, rtol=0)


def test_tied_embeddings_share_one_parameter(tiny_checkpoint: Callable[..., Path]) -> None:
    ours = load_ours(tiny_checkpoint("Qwen2ForCausalLM"))
    assert ours.config.tie_word_embeddings
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(ours.named_parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_matches_hf(arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    # Built the way the worker builds it: under the model dtype as the default dtype.
    model_dir = tiny_checkpoint(arch)
    config = AutoConfig.from_pretrained(model_dir)
    model_zoo.register()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ours = ModelRegistry.resolve_model_cls(arch)(config)
    finally:
        torch.set_default_dtype(previous)
    load_model_weights(ours, model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    runner = PagedRunner(ours)
    for layer in get_attention_layers(ours):
        layer.kv_cache = layer.kv_cache.bfloat16()
    seq = tokens(config.vocab_size, 18, seed=7)
    (got,) = runner.step([("a", seq)])
    # A whole-prompt prefill runs the same operations in the same order as transformers, so bf16
    # results agree far inside one bf16 ulp of the logits (later chunks attend through the cache
    # with differently shaped kernels, which moves bf16 rounding).
    torch.testing.assert_close(got, hf_logits(hf, seq), atol=1e-2, rtol=1e-2)
