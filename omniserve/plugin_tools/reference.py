"""Reference outputs from Hugging Face transformers on the same checkpoint (greedy, CPU; fp32
unless a caller asks for another dtype).

Shared by ``omniserve register-model --check`` and the fidelity tests: each prompt is decoded
alone (no padding) with ``generate``, keeping the log-softmax of the raw logits at every step, so
omniserve's greedy tokens and reported logprobs can be compared one to one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# omniserve's modality -> the keyword a Hugging Face processor takes it under
_HF_MEDIA_KWARGS = {"image": "images", "video": "videos", "audio": "audio"}
_BARE_VIDEO_PAD_PROCESSORS = ("Qwen3VLProcessor",)
"""transformers 5.23-5.24's Qwen3-VL processor replaces only a video's pad, nesting its
timestamped frame groups inside the chat template's ``<|vision_start|>..<|vision_end|>`` (Qwen's
own processor, vLLM and transformers 5.25 replace the whole span: the layout the model was
trained on). Given the bare pad, the form its code keeps for vLLM, every version lays the groups
out as trained."""


def hf_processor_text(processor: Any, text: str) -> str:
    """``text`` as transformers' ``processor`` must take it to expand media as the model was
    trained (see ``_BARE_VIDEO_PAD_PROCESSORS``)."""
    if type(processor).__name__ not in _BARE_VIDEO_PAD_PROCESSORS:
        return text
    span = f"{processor.vision_start_token}{processor.video_token}{processor.vision_end_token}"
    return text.replace(span, processor.video_token)


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per generated token: the full log_softmax of the raw logits


@dataclass
class ReferenceRequest:
    """A prompt with its media in omniserve's form (audio as ``(waveform, rate)``)."""

    text: str
    mm_data: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    mm_kwargs: Mapping[str, object] = field(default_factory=dict)


def hf_model_class(architecture: str) -> type | None:
    """transformers' class for a config.json architecture name, if it has one that generates."""
    import transformers

    try:
        cls = getattr(transformers, architecture, None)
    except Exception:  # transformers' lazy module raises for names whose backend is missing
        return None
    if not isinstance(cls, type) or not hasattr(cls, "generate"):
        return None
    return cls


def hf_greedy(
    model_dir: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    model_cls: Any = None,
    dtype: torch.dtype = torch.float32,
) -> list[ReferenceOutput]:
    """Greedy-decode token-id prompts (``AutoModelForCausalLM`` unless ``model_cls``)."""
    if model_cls is None:
        from transformers import AutoModelForCausalLM as model_cls
    model = model_cls.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        return [
            _generate(model, {"input_ids": torch.tensor([ids])}, max_new_tokens) for ids in prompts
        ]


def hf_greedy_mm(
    model_dir: str,
    model_cls: Any,
    requests: list[ReferenceRequest],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> list[ReferenceOutput]:
    """Greedy-decode text + media prompts through the checkpoint's own HF processor, which
    expands each placeholder itself (the reference for omniserve's prompt updates)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    model = model_cls.from_pretrained(model_dir, dtype=dtype).eval()
    results = []
    with torch.inference_mode():
        for request in requests:
            inputs = processor(
                text=[hf_processor_text(processor, request.text)],
                return_tensors="pt",
                **_media_kwargs(request),
                **request.mm_kwargs,
            )
            inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
            results.append(_generate(model, inputs, max_new_tokens))
    return results


def _media_kwargs(request: ReferenceRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for modality, items in request.mm_data.items():
        items = list(items)
        if not items:
            continue
        if modality == "audio":
            rates = {rate for _, rate in items}
            if len(rates) != 1:
                raise ValueError(f"audio items at several sampling rates: {sorted(rates)}")
            kwargs["sampling_rate"] = rates.pop()
            items = [np.asarray(waveform) for waveform, _ in items]
        kwargs[_HF_MEDIA_KWARGS[modality]] = items
    return kwargs


def _generate(model: Any, inputs: dict[str, Any], max_new_tokens: int) -> ReferenceOutput:
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    generated = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return ReferenceOutput(generated, logprobs[: len(generated)])


@dataclass(frozen=True)
class Comparison:
    tokens_match: bool
    max_logprob_diff: float
    """Max |ours - reference| over every logprob omniserve reported (inf if none)."""
    detail: str


def compare_with_reference(
    token_ids: list[int], logprobs: list[Mapping[int, Any]] | None, reference: ReferenceOutput
) -> Comparison:
    """omniserve's greedy completion (``CompletionOutput.token_ids`` / ``.logprobs``) against
    the reference: tokens identical, and the largest logprob difference."""
    if token_ids != reference.token_ids:
        first = next(
            (
                i
                for i, (a, b) in enumerate(zip(token_ids, reference.token_ids, strict=False))
                if a != b
            ),
            min(len(token_ids), len(reference.token_ids)),
        )
        return Comparison(
            False,
            float("inf"),
            f"greedy tokens differ from position {first}: omniserve {token_ids}, "
            f"transformers {reference.token_ids}",
        )
    diffs = [
        abs(float(getattr(logprob, "logprob", logprob)) - ref_lp[token_id].item())
        for ours, ref_lp in zip(logprobs or [], reference.logprobs, strict=False)
        for token_id, logprob in ours.items()
    ]
    max_diff = max(diffs) if diffs else float("inf")
    return Comparison(
        True,
        max_diff,
        f"{len(token_ids)} greedy tokens identical, max |logprob diff| {max_diff:.1e}",
    )
