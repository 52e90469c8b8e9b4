"""The talkers (Qwen3-Omni-MoE's with its code predictor, Qwen2.5-Omni's) against transformers'
modules, logits per position (fp32, teacher-forced: both sides read the same inputs), so drift
that greedy decoding would hide behind an unchanged argmax shows."""

from __future__ import annotations

import torch
from transformers import AutoConfig
from transformers import Qwen2_5OmniForConditionalGeneration as HFQwen2_5Omni
from transformers import Qwen3OmniMoeForConditionalGeneration as HFQwen3Omni

from omniserve.attention.layer import get_attention_layers
from omniserve.attention.metadata import AttentionMetadata
from omniserve.forward_context import set_forward_context
from tests.test_models_mm import load_ours

ARCH = "Qwen3OmniMoeForConditionalGeneration"
ATOL = 1e-4


def _paged_talker(talker: torch.nn.Module, embeds: torch.Tensor) -> torch.Tensor:
    """The talker's decoder over a paged cache of its own: one sequence at positions 0..n-1,
    in two chunks (a prefill, then more), as the talker runner feeds it."""
    for layer in get_attention_layers(talker):
        layer.kv_cache = torch.zeros(2, 4, 16, layer.num_kv_heads, layer.head_size)
    positions, length, rows = torch.arange(len(embeds)), len(embeds), []
    for start, end in ((0, 13), (13, length)):
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_table=torch.tensor([[0, 1]], dtype=torch.int32),
            slot_mapping=torch.arange(start, end),
            query_lens_cpu=[end - start],
            seq_lens_cpu=[end],
        )
        with set_forward_context(metadata):
            rows.append(
                talker.model(
                    None, positions[start:end].expand(3, -1), inputs_embeds=embeds[start:end]
                )
            )
    return torch.cat(rows)


def test_talker_and_code_predictor_logits_match_transformers(tiny_checkpoint):
    model_dir = tiny_checkpoint(ARCH)
    ours = load_ours(model_dir)
    hf = HFQwen3Omni.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(model_dir).talker_config
    hidden_size, length = config.text_config.hidden_size, 21
    generator = torch.Generator().manual_seed(0)
    embeds = torch.randn(length, hidden_size, generator=generator)
    positions = torch.arange(length)

    talker = ours.talker
    with torch.inference_mode():
        ours_hidden = _paged_talker(talker, embeds)
        ours_logits = talker.codec_head(ours_hidden)
        reference = hf.talker.model(
            inputs_embeds=embeds[None], position_ids=positions.view(1, 1, -1).expand(4, 1, -1)
        )
        hf_logits = hf.talker.codec_head(reference.last_hidden_state)[0]
    torch.testing.assert_close(ours_logits, hf_logits, rtol=0, atol=ATOL)

    # The code predictor, fed transformers' sequence: [talker hidden, code 0, code 1, ...].
    groups = config.num_code_groups
    codes = torch.randint(
        0, config.code_predictor_config.vocab_size, (3, groups), generator=generator
    )
    predictor = ours.talker.code_predictor
    seen: list[torch.Tensor] = []

    def teacher(logits: torch.Tensor, group: int) -> torch.Tensor:
        seen.append(logits)
        return codes[:, group + 1]

    with torch.inference_mode():
        start = ours_hidden[-3:]
        first = talker.model.embed_tokens(codes[:, 0])
        predictor.predict(start, first, teacher)
        hf_predictor = hf.talker.code_predictor
        sequence = [start[:, None], hf.talker.get_input_embeddings()(codes[:, :1])]
        sequence += [
            hf_predictor.model.codec_embedding[g](codes[:, g + 1 : g + 2])
            for g in range(groups - 2)
        ]
        hidden = hf_predictor.model(inputs_embeds=torch.cat(sequence, 1)).last_hidden_state
        for g in range(groups - 1):
            torch.testing.assert_close(
                seen[g], hf_predictor.lm_head[g](hidden[:, g + 1]), rtol=0, atol=ATOL
            )


def test_qwen2_5_talker_logits_match_transformers(tiny_checkpoint):
    """Qwen2.5-Omni's talker teacher-forced on the same thinker-wide rows as transformers' talker
    (projection, decoder, codec head); its codec embedding is transformers'."""
    model_dir = tiny_checkpoint("Qwen2_5OmniForConditionalGeneration")
    ours = load_ours(model_dir)
    hf = HFQwen2_5Omni.from_pretrained(model_dir, dtype=torch.float32).eval()
    width, length = hf.config.talker_config.embedding_size, 21
    rows = torch.randn(length, width, generator=torch.Generator().manual_seed(0))
    talker = ours.talker
    with torch.inference_mode():
        ours_logits = talker.codec_head(_paged_talker(talker, talker.thinker_to_talker_proj(rows)))
        reference = hf.talker.model(
            inputs_embeds=hf.talker.thinker_to_talker_proj(rows[None]),
            position_ids=torch.arange(length).view(1, 1, -1).expand(3, 1, -1),
        )
        hf_logits = hf.talker.codec_head(reference.last_hidden_state)[0]
        torch.testing.assert_close(ours_logits, hf_logits, rtol=0, atol=ATOL)
        codes = torch.tensor([3, 17, 99])
        torch.testing.assert_close(
            talker.codec_embedding(codes), hf.talker.get_input_embeddings()(codes), rtol=0, atol=0
        )
