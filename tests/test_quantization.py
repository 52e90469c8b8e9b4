"""4-bit AWQ and GPTQ checkpoints: the formats unpack as their quantizers pack them; a
quantized checkpoint serves what transformers computes on its dequantized twin (fp32 greedy:
tokens identical, logprobs close), for a text model, an omni thinker with media and LoRA on
top; tensor parallelism shards the 4-bit tensors as it shards weights; what omniserve cannot
run is refused by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoProcessor

from omniserve import LLM, SamplingParams
from omniserve.checkpoint_builder.quantized import build_quantized_checkpoint, quantize_rtn
from omniserve.config import QuantizationConfig
from omniserve.entrypoints.cli import build_parser
from omniserve.layers import linear
from omniserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from omniserve.layers.quantization import canonical, dequantize, pack_nibbles, quantize_linear
from omniserve.layers.quantized_loading import dequantize_at_load
from omniserve.lora.request import LoRARequest
from omniserve.plugin_tools.reference import ReferenceOutput
from tests.hf_reference import (
    CompressedTensorsDequantized,
    assert_matches_reference,
    hf_greedy,
    make_prompts,
)
from tests.test_fidelity_omni import THINKERS, _engine_prompt, _hf_inputs, _media, _text
from tests.test_layers import as_rank
from tests.test_lora import WithAdapter, save_adapter

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
GROUP = 32


def _pack_like_autoawq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing, written as its loop: nibble i of column c holds value
    ``c * 8 + order[i]``."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order[i]].long() << (i * 4)
    return packed.to(torch.uint32).view(torch.int32)


def _pack_like_autogptq(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's packing along dim 0 (qweight): word row r holds rows 8r..8r+7 in order."""
    packed = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int64)
    for row in range(packed.shape[0]):
        for j in range(8):
            packed[row] |= values[row * 8 + j].long() << (j * 4)
    return packed.to(torch.uint32).view(torch.int32)


def test_awq_and_gptq_tensors_unpack_as_their_quantizers_pack_them():
    gen = torch.Generator().manual_seed(0)
    k, n, groups = 64, 24, 2
    codes = torch.randint(0, 16, (k, n), generator=gen)  # [in, out], as the quantizers hold it
    zeros = torch.randint(0, 16, (groups, n), generator=gen)
    awq = QuantizationConfig("awq", GROUP)
    want_codes, want_zeros = pack_nibbles(codes.t()), zeros.t().to(torch.uint8)
    awq = QuantizationConfig("awq", GROUP)
    assert torch.equal(canonical(awq, "qweight", _pack_like_autoawq(codes)), want_codes)
    assert torch.equal(canonical(awq, "qzeros", _pack_like_autoawq(zeros)), want_zeros)
    gptq = QuantizationConfig("gptq", GROUP)
    assert torch.equal(canonical(gptq, "qweight", _pack_like_autogptq(codes)), want_codes)
    stored = _pack_like_autogptq((zeros - 1).t().contiguous() & 0xF).t()  # v1: zero - 1, along N
    # (packing [groups, N] along N is packing its transpose along dim 0)
    assert torch.equal(canonical(gptq, "qzeros", stored.contiguous()), want_zeros)
    v2 = QuantizationConfig("gptq", GROUP, gptq_v1_zeros=False)
    stored_v2 = _pack_like_autogptq(zeros.t().contiguous()).t().contiguous()
    assert torch.equal(canonical(v2, "qzeros", stored_v2), want_zeros)
    scales = torch.rand(groups, n, generator=gen).half()
    assert torch.equal(canonical(awq, "scales", scales), scales.t().float())


def test_rounding_to_sixteen_levels_bounds_the_error():
    weight = torch.randn(8, 128)
    for symmetric in (False, True):
        codes, zeros, scales = quantize_rtn(weight, GROUP, symmetric)
        w = dequantize(pack_nibbles(codes), zeros, scales.float(), torch.float32)
        step = scales.float().repeat_interleave(GROUP, 1)
        error = (w - weight).abs() / step  # half a level, plus up to half for a rounded zero
        assert error.max() <= 1.001 and error.mean() < 0.3


def test_pack_quantized_tensors_unpack_as_compressed_tensors_packs_them():
    """compressed-tensors' own packing (signed values offset by 8, eight to an int32 along K for
    codes and along N for zero points, N padded to a multiple of 8)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(0)
    n, k, groups = 20, 64, 2
    config = QuantizationConfig("pack-quantized", GROUP)
    codes = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    zeros = torch.randint(-8, 8, (n, groups), generator=gen, dtype=torch.int8)
    packed = pack_to_int32(codes, 4)
    assert torch.equal(canonical(config, "qweight", packed), pack_nibbles(codes + 8))
    packed_zeros = pack_to_int32(zeros, 4, packed_dim=0)
    assert packed_zeros.shape == (3, groups)
    assert torch.equal(canonical(config, "qzeros", packed_zeros, rows=n), (zeros + 8).byte())


@pytest.mark.parametrize("method", ["awq", "pack-quantized"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards_4bit_weights_as_plain_ones(monkeypatch, tp_size, method):
    """Every rank's dequantized slice equals the same slice of the whole dequantized matrix
    (AWQ's packing, and compressed-tensors' with zero points packed along the rows)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(1)
    config = QuantizationConfig(method, GROUP)

    def awq(out_features: int, in_features: int) -> Matrix:
        codes = torch.randint(0, 16, (in_features, out_features), generator=gen)
        zeros = torch.randint(0, 16, (in_features // GROUP, out_features), generator=gen)
        scales = torch.rand(in_features // GROUP, out_features, generator=gen).half()
        full = dequantize(pack_nibbles(codes.t()), zeros.t().to(torch.uint8), scales.t().float(),
                          torch.float32)  # fmt: skip
        if method == "pack-quantized":
            signed = (codes.t() - 8).to(torch.int8), (zeros.t() - 8).to(torch.int8)
            return {"qweight": pack_to_int32(signed[0], 4), "scales": scales.t().contiguous(),
                    "qzeros": pack_to_int32(signed[1], 4, packed_dim=0)}, full  # fmt: skip
        tensors = {"qweight": _pack_like_autoawq(codes), "qzeros": _pack_like_autoawq(zeros),
                   "scales": scales}  # fmt: skip
        return tensors, full

    check_tensor_parallel_shards(monkeypatch, tp_size, config, awq)


Matrix = tuple[dict[str, torch.Tensor], torch.Tensor]
"""A quantized matrix's checkpoint tensors by the layer parameter they load into, and the whole
matrix dequantized."""


def check_tensor_parallel_shards(
    monkeypatch: pytest.MonkeyPatch,
    tp_size: int,
    config: QuantizationConfig,
    make: Callable[[int, int], Matrix],
) -> None:
    """Quantized q/k/v, gate/up and down projections (``make(out, in)`` each) loaded into every
    rank's layers: each rank's outputs equal the same slice of the whole dequantized matrices'
    (the row-parallel down projection's partial sums add up to the whole product)."""
    gen = torch.Generator().manual_seed(3)
    hidden, head, heads, kv_heads, inter = 128, 16, 8, 2, 256
    q, k, v = (
        make(heads * head, hidden),
        make(kv_heads * head, hidden),
        make(kv_heads * head, hidden),
    )
    gate, up, down = make(inter, hidden), make(inter, hidden), make(hidden, inter)
    x, h = torch.randn(3, hidden, generator=gen), torch.randn(3, inter, generator=gen)
    row_sum, gate_up_parts = torch.zeros(3, hidden), []
    for rank in range(tp_size):
        as_rank(monkeypatch, rank, tp_size, linear)
        qkv = QKVParallelLinear(hidden, head, heads, kv_heads)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter])
        down_proj = RowParallelLinear(inter, hidden)
        for layer, parts in ((qkv, {"q": q, "k": k, "v": v}), (gate_up, {0: gate, 1: up}),
                             (down_proj, {None: down})):  # fmt: skip
            quantize_linear(layer, config)
            for shard, (tensors, _) in parts.items():
                for suffix, tensor in tensors.items():
                    param = getattr(layer, suffix)
                    param.weight_loader(param, tensor, *(() if shard is None else (shard,)))
        out = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], -1)
        torch.testing.assert_close(out[0], F.linear(x, q[1].chunk(tp_size)[rank]))
        source = rank // qkv.num_kv_head_replicas  # the KV head a rank holds (or a replica of)
        kv_rows = slice(source * qkv.kv_size, (source + 1) * qkv.kv_size)
        torch.testing.assert_close(out[1], F.linear(x, k[1][kv_rows]))
        torch.testing.assert_close(out[2], F.linear(x, v[1][kv_rows]))
        gate_up_parts.append(gate_up(x))
        row_sum += down_proj(h.chunk(tp_size, -1)[rank])
    both = torch.cat(gate_up_parts, -1).unflatten(-1, (tp_size, 2, -1))
    torch.testing.assert_close(both[:, :, 0].flatten(1), F.linear(x, gate[1]))
    torch.testing.assert_close(both[:, :, 1].flatten(1), F.linear(x, up[1]))
    # The ranks' partial sums add the products in another order than one whole product: each
    # element within the worst-case bound of fp32 summation, inter * eps * sum of |products|
    # (a fixed atol failed on magnitudes up to 16 where the order left 1.8e-4).
    bound = inter * torch.finfo(torch.float32).eps * (h.abs() @ down[1].abs().T)
    assert bool(((row_sum - F.linear(h, down[1])).abs() <= bound).all())


@pytest.fixture(scope="module")
def text_case(tiny_checkpoint):
    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    return model_dir, make_prompts(model_dir, [5, 19, 36])


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantized_checkpoint_matches_transformers_on_its_dequantized_twin(text_case, method):
    model_dir, prompts = text_case
    quantized, twin = build_quantized_checkpoint(model_dir, method, GROUP)
    reference = hf_greedy(str(twin), prompts, MAX_TOKENS)
    assert reference[0].token_ids != hf_greedy(model_dir, prompts[:1], MAX_TOKENS)[0].token_ids
    llm = LLM(str(quantized), dtype="float32", quantization=f"{method}_marlin")
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    # fp32 projections become 4-bit codes with fp32 scales and uint8 zeros per 32: 16% left.
    total, projections = _weight_bytes(twin)
    assert total - info["weight_bytes"] > 0.8 * projections
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, reference)


def test_w4a16_checkpoint_matches_transformers_loading_it(text_case):
    """compressed-tensors' W4A16 (pack-quantized, symmetric groups): transformers reads the same
    files through the compressed-tensors library."""
    model_dir, prompts = text_case
    quantized, twin = build_quantized_checkpoint(model_dir, "w4a16", GROUP)
    reference = hf_greedy(str(quantized), prompts, MAX_TOKENS, CompressedTensorsDequantized)
    assert reference[0].token_ids == hf_greedy(str(twin), prompts[:1], MAX_TOKENS)[0].token_ids
    llm = LLM(str(quantized), dtype="float32", quantization="compressed-tensors")
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    assert info["layer_kernels"]["linear: C 4-bit, float32 activations"] == 8
    total, projections = _weight_bytes(twin)
    assert total - info["weight_bytes"] > 0.8 * projections
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, reference)


@pytest.mark.parametrize("method", ["awq", "gptq", "w4a16"])
def test_4bit_moe_experts_stay_quantized(tiny_checkpoint, method):
    """AutoAWQ / GPTQModel / llm-compressor quantize every expert's projections; omniserve's
    fused experts keep them 4-bit (the C MoE kernel decodes them), as the dense ones."""
    model_dir = str(tiny_checkpoint("Qwen3MoeForCausalLM"))
    quantized, twin = build_quantized_checkpoint(model_dir, method, GROUP)
    prompts = make_prompts(model_dir, [5, 19])
    llm = LLM(str(quantized), dtype="float32")
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    assert info["layer_kernels"]["linear: C 4-bit, float32 activations"] == 4
    assert info["layer_kernels"]["MoE: C 4-bit, float32 activations"] == 2
    total, projections = _weight_bytes(twin)
    assert total - info["weight_bytes"] > 0.8 * projections
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, hf_greedy(str(twin), prompts, MAX_TOKENS))


def test_dequantizing_at_load_follows_g_idx_and_names_missing_parts():
    """An act-order GPTQ matrix outside the linear layers dequantizes with its features'
    groups; a matrix whose tensors never all arrive is named."""
    gen = torch.Generator().manual_seed(2)
    config = QuantizationConfig("gptq", GROUP)
    codes = torch.randint(0, 16, (64, 16), generator=gen)  # [K, N]
    zeros = torch.randint(0, 16, (2, 16), generator=gen)
    scales = torch.rand(2, 16, generator=gen)
    g_idx = torch.randperm(64, generator=gen).int() // GROUP
    stored = {
        "qweight": _pack_like_autogptq(codes),
        "scales": scales,
        "g_idx": g_idx,
        "qzeros": _pack_like_autogptq((zeros - 1).t().contiguous() & 0xF).t().contiguous(),
    }
    weights = [(f"e.{suffix}", tensor) for suffix, tensor in stored.items()]
    ((name, weight),) = dequantize_at_load(iter(weights), {"e": set(stored)}, config)
    group = g_idx.long()
    expected = (codes.t().float() - zeros.t().float()[:, group]) * scales.t()[:, group]
    assert name == "e.weight" and torch.equal(weight, expected)
    with pytest.raises(ValueError, match=r"lacks \['scales'\] of the quantized matrix 'e'"):
        list(dequantize_at_load(iter(weights[:1] + weights[2:]), {"e": set(stored)}, config))


@pytest.mark.gpu
def test_quantized_checkpoint_on_gpu_matches_transformers(text_case):
    """On CUDA (the dequantize-per-call kernel), fp32 against transformers' fp32 on the CPU."""
    model_dir, prompts = text_case
    quantized, twin = build_quantized_checkpoint(model_dir, "awq", GROUP)
    llm = LLM(str(quantized), dtype="float32", device="cuda")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, hf_greedy(str(twin), prompts, MAX_TOKENS), atol=1e-3)


def _weight_bytes(model_dir: Path) -> tuple[int, int]:
    """(all tensors, the decoder's projections) in bytes."""
    tensors = load_file(model_dir / "model.safetensors")
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    return sum(sizes.values()), sum(v for n, v in sizes.items() if n.endswith("_proj.weight"))


@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_lora_adapters_apply_over_quantized_weights(text_case, tmp_path, method):
    model_dir, prompts = text_case
    quantized, twin = build_quantized_checkpoint(model_dir, method, GROUP)
    adapter = save_adapter(AutoModelForCausalLM, str(twin), tmp_path / "a", 3, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    with_adapter = WithAdapter(AutoModelForCausalLM, adapter)
    reference = hf_greedy(str(twin), prompts, MAX_TOKENS, with_adapter)
    llm = LLM(str(quantized), dtype="float32", enable_lora=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("a", 1, str(adapter)))  # fmt: skip
    assert_matches_reference(outputs, reference)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["Qwen2_5OmniThinkerForConditionalGeneration",
                                  "Qwen3OmniMoeThinkerForConditionalGeneration"])  # fmt: skip
def test_quantized_omni_thinker_with_image_and_audio_matches_transformers(tiny_checkpoint, arch):
    """Both omni thinkers in AWQ with an image and audio (Qwen3-Omni's experts kept 4-bit, as
    the AWQ Qwen3-Omni-30B-A3B checkpoints store them)."""
    quantized, twin = build_quantized_checkpoint(tiny_checkpoint(arch), "awq", GROUP)
    processor = AutoProcessor.from_pretrained(twin)
    items, text = _media(["image", "audio"], 0), _text(processor, ["image", "audio"])
    model = THINKERS[arch].from_pretrained(twin, dtype=torch.float32).eval()
    with torch.inference_mode():
        inputs = _hf_inputs(processor, text, items)
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1) for s in out.logits][: len(tokens)]
    llm = LLM(str(quantized), dtype="float32")
    if arch.startswith("Qwen3"):
        info = llm.llm_engine.engine_core.call_utility("get_model_info")
        assert info["layer_kernels"]["MoE: C 4-bit, float32 activations"] == 2
    outputs = llm.generate([_engine_prompt(text, items)], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, [ReferenceOutput(tokens, logprobs)])


@pytest.mark.parametrize(
    ("config", "requested", "message"),
    [
        ({"quant_method": "bitsandbytes"}, None, "quant_method 'bitsandbytes'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}
                },
            },
            None,
            "strategy 'channel'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}
                },
            },
            None,
            "int 8-bit weights",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "strategy": "group",
                            "group_size": 128,
                        },
                        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                    }
                },
            },
            None,
            "W4A8",
        ),  # fmt: skip
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, None, "bits=8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None, "gemv"),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, None, "group_size=-1"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "gptq", "does not match"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            None,
            "checkpoint_format",
        ),  # fmt: skip
    ],
)
def test_unsupported_quantization_is_refused_by_name(config, requested, message):
    with pytest.raises(ValueError, match=message):
        QuantizationConfig.from_hf(config, requested)


def test_bad_quantized_checkpoints_are_refused_at_start_up(text_case, tmp_path):
    model_dir, _ = text_case
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        LLM(model_dir, quantization="awq")
    quantized, _ = build_quantized_checkpoint(model_dir, "gptq", GROUP)
    shuffled = tmp_path / "act-order"
    shutil.copytree(quantized, shuffled)
    tensors = load_file(shuffled / "model.safetensors")
    key = next(name for name in tensors if name.endswith("g_idx"))
    tensors[key] = tensors[key].flip(0).contiguous()  # desc_act: features reordered
    save_file(tensors, shuffled / "model.safetensors")
    with pytest.raises(ValueError, match="desc_act"):
        LLM(str(shuffled), dtype="float32")
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"]["checkpoint_format"] == "gptq"


def test_cli_takes_vllms_quantization_flag():
    args = build_parser().parse_args(["serve", "m", "--quantization", "awq_marlin"])
    assert args.quantization == "awq_marlin"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "-q", "bitsandbytes"])
