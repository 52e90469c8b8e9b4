"""No Triton kernel compiles while serving. Triton compiles a kernel once per class of its
integer arguments (1, multiples of 16, the rest), of its pointers' alignment and of its constexpr
values, on first use, and each compile takes about a second: on an H200 a batch-32 run spent
1.6 s of its 2.3 s compiling in its first steps. So the arguments that change from step to step
are left unspecialized, the step's arrays arrive 16-byte aligned, and the start-up warm-up
launches every variant a step can (CPU: the declarations and the warm-up's launches; GPU: the
compiled-kernel caches before and after serving steps of many shapes)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

pytest.importorskip("triton")  # a dependency only on Linux x86_64 (pyproject.toml)

import omniserve.attention.triton_backend as attention
import omniserve.layers.triton_fused_moe as moe

KERNELS = {
    attention._paged_attention_kernel: {"stride_bt", "num_splits"},
    attention._combine_splits_kernel: {"num_splits"},
    moe._grouped_gemm_kernel: {"num_pairs"},
}
"""Each kernel and the arguments that vary between steps of one model."""


def test_step_varying_arguments_are_unspecialized() -> None:
    # Triton ignores a do_not_specialize name that is no parameter: a typo would compile again.
    for kernel, varying in KERNELS.items():
        assert {p.name for p in kernel.params if p.do_not_specialize} == varying


def _warm_up_heights() -> list[int]:
    """The block heights of the grouped-GEMM launches that ``warm_up`` makes (interpreted)."""
    heights: list[int] = []
    moe._grouped_gemm_kernel.add_pre_run_hook(lambda *a, **kw: heights.append(kw["BLOCK_M"]))
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(4, 32, 16, generator=gen), torch.randn(4, 16, 16, generator=gen)
    moe.warm_up(gate_up, down, 2, torch.float32)
    return heights


def test_moe_warm_up_launches_every_block_height() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")  # before triton is imported in the child
        pool = multiprocessing.get_context("spawn").Pool(1)
    with pool:
        heights = pool.apply_async(_warm_up_heights).get(timeout=120)
    assert sorted(set(heights)) == list(moe._BLOCK_MS) and len(heights) == 2 * len(moe._BLOCK_MS)
    picked = {moe._block_m(pairs, experts) for pairs in range(1, 5000) for experts in (4, 128)}
    assert picked == set(moe._BLOCK_MS)


def _compiled_variants() -> int:
    """Compiled variants in the JIT caches of every Triton kernel omniserve launches."""
    import omniserve.cuda.kernels as layer_kernels

    kernels = [value for module in (attention, moe, layer_kernels)
               for value in vars(module).values() if hasattr(value, "device_caches")]  # fmt: skip
    assert len(kernels) >= 7
    return sum(len(caches[0]) for kernel in kernels for caches in kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3MoeForCausalLM"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_no_kernel_compiles_while_serving(
    architecture: str, enforce_eager: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 1 to 300 tokens, alone and batched (prefill chunks, mixed steps, decode
    batches of every size up to ``max_num_seqs``, MoE layers at all three block heights)."""
    from omniserve import LLM, SamplingParams
    from omniserve.checkpoint_builder import build_tiny_checkpoint

    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")  # this process holds the engine
    llm = LLM(str(build_tiny_checkpoint(architecture)), device="cuda", dtype="bfloat16",
              max_model_len=512, kv_cache_memory=64 << 20, max_num_seqs=8,
              max_num_batched_tokens=256, enforce_eager=enforce_eager)  # fmt: skip
    compiled = _compiled_variants()
    assert compiled > 0
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    for lengths in ([1], [17], [300], [3, 100, 45], [5, 6, 7, 8, 9, 10, 11, 130]):
        prompts = [{"prompt_token_ids": [(7 * i + n) % 500 + 10 for i in range(n)]}
                   for n in lengths]  # fmt: skip
        llm.generate(prompts, params, use_tqdm=False)
    assert _compiled_variants() == compiled
