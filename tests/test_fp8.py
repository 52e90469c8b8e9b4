"""Block-scaled FP8 checkpoints (Qwen's ``-FP8`` format): the CPU kernel decodes every e4m3 code
as torch does and multiplies as the dequantized weight does; the block scales widen to per-row
ones that tensor parallelism shards as it shards weights, rows not filling their last block
included; a checkpoint serves what transformers computes loading the same files (fp32 greedy:
tokens identical, logprobs close), its MoE experts dequantized at load; what omniserve cannot
run is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from omniserve import LLM
from omniserve.checkpoint_builder.quantized import build_quantized_checkpoint, quantize_fp8
from omniserve.config import QuantizationConfig
from omniserve.cpu import linear as cpu_linear
from omniserve.cpu.linear import Fp8Linear
from omniserve.layers.quantization import (
    dequantize_fp8,
    fp8_row_scales,
)
from tests.hf_reference import (
    CompressedTensorsDequantized,
    assert_matches_reference,
    hf_greedy,
    make_prompts,
)
from tests.test_cpu_backend import DTYPES, _close
from tests.test_quantization import GREEDY, MAX_TOKENS, Matrix, check_tensor_parallel_shards

BLOCK = 32


def _fp8_weights(out_features: int, in_features: int, group_size: int, seed: int):
    """Every e4m3 code but the two NaNs, at random, and fp32 row scales ``[N, K / g]``."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out_features, in_features), generator=gen, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    scales = torch.rand(out_features, in_features // group_size, generator=gen) * 0.01
    return codes.view(torch.float8_e4m3fn), scales


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_kernel_decodes_every_code_as_torch(dtype: torch.dtype) -> None:
    """All 254 finite codes (subnormals, both zeros) under ordinary, tiny and huge scales decode
    bit for bit as ``dequantize_fp8`` (torch's e4m3 cast times the scale, rounded once)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(4, 1)
    codes[codes & 0x7F == 0x7F] = 0
    weight = codes.view(torch.float8_e4m3fn)
    scales = torch.tensor([[0.01, 3.0], [1e-30, 1e-40], [1e30, 2.0**-126], [1.0, 0.0]])
    kernel = Fp8Linear(weight, scales, dtype)
    assert torch.equal(kernel.dequantize(), dequantize_fp8(weight, scales, dtype))
    assert torch.equal(kernel.dequantize(1, 3), dequantize_fp8(weight, scales, dtype)[1:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 8, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_the_dequantized_weight(rows, group_size, bias, dtype) -> None:
    """The kernel without a scratch (up to 7 rows), the one with (up to 8 here) and the
    decode-then-``F.linear`` path above them, on 103 output rows (tiles of 4, 2 and 6 with a
    remainder) and rows of a wider input, against the dequantized weight."""
    weight, scales = _fp8_weights(103, 384, group_size, rows)
    assert Fp8Linear.supports(weight, scales, dtype)
    kernel = Fp8Linear(weight, scales, dtype, max_rows=8)
    bias_t = torch.randn(103) if bias else None
    x = torch.randn(rows, 400).to(dtype)[:, 8:392]
    with torch.inference_mode():
        got = kernel(x, bias_t)
    reference = dequantize_fp8(weight, scales, dtype).float()
    expected = F.linear(x.float(), reference, None if bias_t is None else bias_t.to(dtype).float())
    assert got.dtype == dtype
    _close(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_fp8_linear_long_rows_and_pieces(rows, dtype, monkeypatch) -> None:
    """Rows of over 2,048 features in slices; past the scratch's size the weight is decoded in
    pieces; leading dims; an empty batch; a wrong dtype refused."""
    weight, scales = _fp8_weights(100, 2176, 128, rows)
    bias = torch.randn(100).to(dtype)
    x = torch.randn(2, rows, 2176).to(dtype)
    monkeypatch.setattr(cpu_linear, "DEQUANTIZE_SCRATCH_BYTES", 100 * 2176 * 2 // 3)
    expected = F.linear(x.float(), dequantize_fp8(weight, scales, dtype).float(), bias.float())
    with torch.inference_mode():
        for max_rows in (16, 0):  # the kernel, then decoded pieces
            got = Fp8Linear(weight, scales, dtype, max_rows=max_rows)(x, bias)
            assert got.shape == (2, rows, 100)
            _close(got, expected, dtype)
        kernel = Fp8Linear(weight, scales, dtype)
        assert kernel(torch.empty(0, 2176).to(dtype), None).shape == (0, 100)
        with pytest.raises(TypeError, match="does not match"):
            kernel(torch.randn(2, 2176).to(torch.float16), None)


def test_fp8_linear_refuses_shapes_off_the_kernel() -> None:
    assert Fp8Linear.supports(*_fp8_weights(8, 64, 32, 0), torch.float32)
    assert not Fp8Linear.supports(*_fp8_weights(8, 48, 48, 0), torch.float32)  # K % 32
    assert not Fp8Linear.supports(*_fp8_weights(8, 64, 16, 0), torch.float32)  # groups of 16
    assert not Fp8Linear.supports(*_fp8_weights(8, 64, 32, 0), torch.float16)
    weight, scales = _fp8_weights(8, 64, 32, 0)
    assert not Fp8Linear.supports(weight.view(torch.uint8), scales, torch.float32)
    assert not Fp8Linear.supports(weight, scales.double(), torch.float32)


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize(
    "config",
    [QuantizationConfig("fp8", BLOCK, row_block=48),
     QuantizationConfig("fp8", 0, row_block=1, scale_name="weight_scale"),
     QuantizationConfig("fp8", 0, row_block=0, scale_name="weight_scale")],
    ids=["blocks", "per-row", "per-tensor"],
)  # fmt: skip
def test_fp8_scales_shard_as_weights(monkeypatch, tp_size, config) -> None:
    """Blocks of 48 rows (k and v: 32 rows, one partial block; q: 128, two and a partial) and 32
    features, a scale per row (``[N, 1]``) or one per matrix (a scalar), each spanning the
    features of every rank: every rank's product equals the same slice of the whole dequantized
    matrix's."""
    gen = torch.Generator().manual_seed(1)

    def fp8(out_features: int, in_features: int) -> Matrix:
        weight = torch.randn(out_features, in_features, generator=gen)
        codes, _ = quantize_fp8(weight, (BLOCK, BLOCK))
        row_block, group_size = config.block(out_features, in_features)
        grid = torch.rand(-(-out_features // row_block), in_features // group_size, generator=gen)
        grid = grid.bfloat16()  # as Qwen stores them
        full = dequantize_fp8(codes, fp8_row_scales(grid, out_features, row_block), torch.float32)
        stored = grid if config.row_block else grid.reshape(1)  # one scale: stored as [1]
        return {"weight": codes, config.scale_name: stored}, full

    check_tensor_parallel_shards(monkeypatch, tp_size, config, fp8)


def test_fp8_scale_grids_must_cover_their_rows() -> None:
    with pytest.raises(ValueError, match="one row of scales per 48 of 100"):
        fp8_row_scales(torch.ones(2, 4), 100, 48)


@pytest.mark.parametrize(
    ("architecture", "method"),
    [("Qwen2ForCausalLM", "fp8"), ("Qwen3MoeForCausalLM", "fp8"),
     ("Qwen2ForCausalLM", "fp8-dynamic"), ("Qwen3MoeForCausalLM", "fp8-dynamic")],
)  # fmt: skip
def test_fp8_checkpoint_matches_transformers_loading_it(tiny_checkpoint, architecture, method):
    """transformers reads the same FP8 files (Qwen's format: it dequantizes them on a CPU;
    compressed-tensors: through the compressed-tensors library); the dense projections stay
    e4m3 in omniserve (a byte per weight plus fp32 row scales), and so do the MoE experts."""
    model_dir = str(tiny_checkpoint(architecture))
    quantized, twin = build_quantized_checkpoint(model_dir, method, BLOCK)
    prompts = make_prompts(model_dir, [5, 19, 36])
    reference_cls = None if method == "fp8" else CompressedTensorsDequantized
    reference = hf_greedy(str(quantized), prompts, MAX_TOKENS, reference_cls)
    assert reference[0].token_ids == hf_greedy(str(twin), prompts[:1], MAX_TOKENS)[0].token_ids
    flag = "fp8" if method == "fp8" else "compressed-tensors"
    llm = LLM(str(quantized), dtype="float32", quantization=flag)
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    assert info["layer_kernels"]["linear: C FP8, float32 activations"] > 0
    if architecture == "Qwen3MoeForCausalLM":
        assert info["layer_kernels"]["MoE: C FP8, float32 activations"] == 2
    unquantized = LLM(str(twin), dtype="float32").llm_engine.engine_core.call_utility(
        "get_model_info"
    )["weight_bytes"]
    assert info["weight_bytes"] < unquantized
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, reference)


def _per_expert_fp8(source: Path, target: Path, block: int) -> Path:
    """Qwen3-VL-MoE as Qwen's FP8 checkpoints store it: experts split into per-expert e4m3
    projections (in blocks of 128 there), the fused tensors gone; its dequantized twin in
    transformers' fused layout beside it (``target / "twin"``)."""
    shutil.copytree(source, target)
    state = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    hidden = config["text_config"]["hidden_size"]
    inter = config["text_config"]["moe_intermediate_size"]
    quantized, twin = {}, {}
    for name, tensor in state.items():
        stem, _, fused = name.rpartition(".experts.")
        if fused not in ("gate_up_proj", "down_proj"):
            quantized[name] = twin[name] = tensor
            continue
        experts = []
        for e, w in enumerate(tensor):  # transformers' [2I, H] / [H, I], or the hub's transposed
            w = w if w.shape[0] == (2 * inter if fused == "gate_up_proj" else hidden) else w.t()
            parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
            dense = []
            for part, rows in zip(parts, w.chunk(len(parts)), strict=True):
                codes, grid = quantize_fp8(rows.contiguous(), (block, block))
                quantized[f"{stem}.experts.{e}.{part}.weight"] = codes
                quantized[f"{stem}.experts.{e}.{part}.weight_scale_inv"] = grid
                scales = fp8_row_scales(grid, rows.shape[0], block)
                dense.append(dequantize_fp8(codes, scales, tensor.dtype))
            experts.append(torch.cat(dense))
        twin[f"{stem}.experts.{fused}"] = torch.stack(experts)
    save_file(quantized, target / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(source, target / "twin")
    save_file(twin, target / "twin" / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}  # fmt: skip
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("block", [16, 32])
def test_qwen3_vl_moe_per_expert_fp8_matches_its_dequantized_twin(tiny_checkpoint, tmp_path, block):
    """Qwen3-VL-30B-A3B-FP8's layout (per-expert FP8 projections where the bf16 checkpoint
    fuses them): the experts fill the fused layer and serve what transformers computes on the
    dequantized, fused twin; kept FP8 where the blocks divide the expert width (48 here: 16;
    the 30B's 768 in blocks of 128), else dequantized at load. (transformers 5.24 cannot read
    these files: it reports the fused experts missing, initializes them at random and ignores
    the per-expert tensors.)"""
    source = tiny_checkpoint("Qwen3VLMoeForConditionalGeneration")
    quantized = _per_expert_fp8(source, tmp_path / "fp8", block)
    prompts = make_prompts(str(source), [5, 19])
    reference = hf_greedy(str(quantized / "twin"), prompts, MAX_TOKENS,
                          transformers.Qwen3VLMoeForConditionalGeneration)  # fmt: skip
    llm = LLM(str(quantized), dtype="float32")
    info = llm.llm_engine.engine_core.call_utility("get_model_info")
    # (the C kernels take multiples of 32: the tiny experts run on torch)
    placement = "MoE: torch FP8 (dequantized per call)" if block == 16 else "MoE: torch"
    assert info["layer_kernels"][placement] == 2
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, reference)


@pytest.mark.gpu
def test_fp8_checkpoint_on_gpu_matches_transformers(tiny_checkpoint):
    """On CUDA (the dequantize-per-call kernel), fp32 against transformers' fp32 on the CPU."""
    model_dir = str(tiny_checkpoint("Qwen2ForCausalLM"))
    quantized, twin = build_quantized_checkpoint(model_dir, "fp8", BLOCK)
    prompts = make_prompts(model_dir, [5, 19, 36])
    llm = LLM(str(quantized), dtype="float32", device="cuda")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, hf_greedy(str(twin), prompts, MAX_TOKENS), atol=1e-3)


def _ct(weights: dict, inputs: dict | None = None, **extra: object) -> dict:
    """A compressed-tensors quantization_config with one group."""
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **weights}}
    if inputs is not None:
        group["input_activations"] = {"num_bits": 8, "type": "float", **inputs}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "fp8"}, "without weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "e5m2"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            "static",
        ),  # fmt: skip
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "ue8m0"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "rows, cols"),
        (_ct({"strategy": "channel"}, {"dynamic": False, "strategy": "tensor"}), "static"),
        (_ct({"strategy": "channel"}, kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
        (
            _ct(
                {"strategy": "channel"},
                kv_cache_scheme={"num_bits": 8, "type": "float", "dynamic": True},
            ),
            "static fp8 KV-cache scales per tensor only",
        ),  # fmt: skip
        (_ct({"strategy": "group", "group_size": 128}), "strategy 'group'"),
        (_ct({"strategy": "block", "block_structure": [128]}), "rows, cols"),
        ({**_ct({"strategy": "channel"}), "format": "pack-quantized"}, "pack-quantized"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}},
            },
            "float 4-bit weights",
        ),  # fmt: skip
        ({"quant_method": "compressed-tensors", "config_groups": {}}, "without config_groups"),
    ],
)
def test_unsupported_fp8_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        QuantizationConfig.from_hf(config)


def test_fp8_schemes_parse_to_their_blocks():
    """Qwen's blocks; llm-compressor's FP8_DYNAMIC (a scale per row), FP8_BLOCK and per-tensor
    weights (0: all of the features), with dynamic or no activation quantization."""
    qwen = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 64]}  # fmt: skip
    assert QuantizationConfig.from_hf(qwen, "fp8") == QuantizationConfig("fp8", 64, row_block=128)
    dynamic = {"dynamic": True, "strategy": "token"}
    cases = [
        (_ct({"strategy": "channel"}, dynamic), (1, 0)),
        (_ct({"strategy": "block", "block_structure": [128, 128]}, dynamic), (128, 128)),
        (_ct({"strategy": "tensor"}), (0, 0)),
    ]
    for config, (row_block, group_size) in cases:
        parsed = QuantizationConfig.from_hf(config, "compressed-tensors")
        assert parsed == QuantizationConfig("fp8", group_size, row_block, "weight_scale")
        assert parsed.block(96, 64) == (row_block or 96, group_size or 64)
