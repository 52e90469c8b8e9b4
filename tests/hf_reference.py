"""Reference outputs from Hugging Face transformers on the same checkpoint (greedy, fp32):
prompt factories and assertions; the runner itself is ``omniserve.plugin_tools.reference``."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

# The shared HF runner lives in the package (register-model --check uses it too).
from omniserve.plugin_tools.reference import ReferenceOutput, hf_greedy

__all__ = [
    "CompressedTensorsDequantized",
    "ReferenceOutput",
    "assert_matches_reference",
    "hf_greedy",
    "make_prompts",
]


class CompressedTensorsDequantized:
    """transformers reading a compressed-tensors checkpoint into dense weights, as ``hf_greedy``'s
    model class (without ``dequantize`` it would also round activations to FP8, as vLLM's GPU
    kernels do)."""

    @staticmethod
    def from_pretrained(path: str, **kwargs: object) -> object:
        config = CompressedTensorsConfig(dequantize=True)
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, **kwargs)


def make_prompts(model_dir: str, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, from varied text so the model sees real tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = (
        "the quick brown fox jumps over a lazy dog while serving models on cpu with paged "
        "attention and continuous batching makes throughput high café 日本語 "
    ).split()
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for length in lengths:
        ids: list[int] = []
        while len(ids) < length:
            order = torch.randperm(len(words), generator=gen).tolist()
            ids += tokenizer(" ".join(words[i] for i in order), add_special_tokens=False).input_ids
        prompts.append(ids[:length])
    return prompts


def assert_matches_reference(
    outputs: list, reference: list[ReferenceOutput], atol: float = 1e-4
) -> None:
    """Greedy tokens identical; the sampled token's logprob and the top logprobs close."""
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == ref.token_ids, (
            f"prompt {i}: tokens differ\n ours {completion.token_ids}\n  hf  {ref.token_ids}"
        )
        assert completion.logprobs is not None and len(completion.logprobs) == len(ref.logprobs)
        for pos, (ours, ref_lp) in enumerate(zip(completion.logprobs, ref.logprobs, strict=True)):
            for token_id, logprob in ours.items():
                expected = ref_lp[token_id].item()
                assert abs(logprob.logprob - expected) < atol, (
                    f"prompt {i} position {pos} token {token_id}: {logprob.logprob} vs {expected}"
                )
