"""The expensive rows of ``--check``: the model on the CPU, a real engine, transformers.

All three run in float32 on the CPU, where omniserve and transformers agree to ~1e-5, so a
mismatch points at the plugin rather than at numerics: the check is meant for a small (ideally
tiny, ``omniserve make-tiny``) checkpoint of the family, which it loads up to three times.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from omniserve.layers.weight_utils import default_dtype
from omniserve.plugin_tools.report import CheckReport, ModalityCase

LOGPROB_ATOL = 1e-3
"""Largest |logprob difference| to transformers that still passes (fp32, CPU)."""
NUM_LOGPROBS = 5
_TEXT_PROMPT = "The quick brown fox jumps over the lazy dog while the engine"
_MM_SUFFIX = " Describe it."


def build_and_load(report: CheckReport, model_config: Any) -> torch.nn.Module | None:
    """The registered class built from the checkpoint's config, with its weights (a row)."""
    from omniserve.registry import ModelRegistry
    from omniserve.worker.model_loader import checkpoint_files, load_model_weights

    name = "weights load"
    try:
        hf_config = model_config.hf_config
        model_cls = ModelRegistry.resolve_model_cls(model_config.architecture)
        with torch.device("cpu"), default_dtype(torch.float32):
            model = model_cls(hf_config)
    except Exception as exc:
        report.add(name, False, f"cannot build the model: {type(exc).__name__}: {exc}")
        return None
    try:
        load_model_weights(model, model_config.model)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        report.add(name, False, str(exc))
        return None
    num_params = sum(1 for _ in model.parameters())
    num_files = len(checkpoint_files(model_config.model))
    report.add(
        name,
        True,
        f"{num_params} parameters from {num_files} safetensors file(s); "
        "no missing or unexpected keys",
    )
    return model.eval()


def model_rows(report: CheckReport, model_config: Any, cases: list[ModalityCase]) -> None:
    """Load the weights, then compare each modality's encoder output with its placeholders."""
    model = build_and_load(report, model_config)
    if model is None:
        return
    with torch.inference_mode():
        for case in cases:
            encoder_rows(report, model, case)
    del model
    gc.collect()


def encoder_rows(report: CheckReport, model: Any, case: ModalityCase) -> None:
    """The encoder must return one ``[num_embeds, hidden]`` tensor per item with exactly the
    embeddings its placeholder range takes (the engine stops on any mismatch)."""
    name = f"encoder vs placeholders [{case.modality}]"
    expected = [f.mm_position.num_embeds for f in case.features]
    try:
        outputs = model.get_multimodal_embeddings(case.modality, [f.data for f in case.features])
    except Exception as exc:
        report.add(name, False, f"get_multimodal_embeddings raised {type(exc).__name__}: {exc}")
        return
    rows = [int(out.shape[0]) for out in outputs]
    report.add(
        name, rows == expected, f"placeholder embeds per item {expected}, encoder rows {rows}"
    )
    if getattr(model, "uses_mrope", False):
        mrope_row(report, model, case)


def mrope_row(report: CheckReport, model: Any, case: ModalityCase) -> None:
    name = f"M-RoPE positions [{case.modality}]"
    num_tokens = len(case.inputs.prompt_token_ids)
    try:
        positions, _ = model.get_mrope_input_positions(case.inputs.prompt_token_ids, case.features)
    except Exception as exc:
        report.add(name, False, f"get_mrope_input_positions raised {type(exc).__name__}: {exc}")
        return
    shape = tuple(positions.shape)
    report.add(
        name, shape == (3, num_tokens), f"positions {list(shape)} for a {num_tokens}-token prompt"
    )


def run_requests(
    report: CheckReport,
    model_dir: Path,
    processor: Any,
    checkpoint: Path,
    source_architecture: str,
    *,
    max_model_len: int,
    max_tokens: int,
) -> None:
    """One text request and one request per modality through ``LLM``, then transformers."""
    from omniserve.plugin_tools.reference import ReferenceRequest

    requests = {"text": ReferenceRequest(_TEXT_PROMPT)}
    if processor is not None:
        builder = processor.dummy_inputs
        for modality, limit in processor.info.get_allowed_mm_limits().items():
            if limit == 0:
                continue
            try:
                # Half the context for the item leaves room for the text and the answer.
                mm_data = builder.get_dummy_mm_data(max_model_len // 2, {modality: 1})
                text = builder.get_dummy_text({modality: 1}) + _MM_SUFFIX
            except Exception as exc:
                report.add(
                    f"request [{modality}]",
                    False,
                    f"the dummy-inputs builder raised {type(exc).__name__}: {exc}",
                )
                continue
            requests[modality] = ReferenceRequest(text, {modality: mm_data[modality]})
    completions = _engine_completions(report, model_dir, requests, max_model_len, max_tokens)
    if completions:
        _reference_rows(report, checkpoint, source_architecture, requests, completions, max_tokens)


def _engine_completions(
    report: CheckReport,
    model_dir: Path,
    requests: dict[str, Any],
    max_model_len: int,
    max_tokens: int,
) -> dict[str, Any]:
    from omniserve import LLM, SamplingParams

    try:
        llm = LLM(
            str(model_dir),
            dtype="float32",
            device="cpu",
            max_model_len=max_model_len,
            max_num_seqs=4,
        )
    except Exception as exc:
        report.add("engine start", False, f"{type(exc).__name__}: {exc}")
        return {}
    report.add("engine start", True, f"max_model_len={max_model_len}, float32 on the CPU")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=NUM_LOGPROBS)
    completions: dict[str, Any] = {}
    try:
        for kind, request in requests.items():
            name = f"request [{kind}]"
            prompt: dict[str, Any] = {"prompt": request.text}
            if request.mm_data:
                prompt["multi_modal_data"] = {m: list(v) for m, v in request.mm_data.items()}
            try:
                output = llm.generate(prompt, params, use_tqdm=False)[0]
            except Exception as exc:
                report.add(name, False, f"{type(exc).__name__}: {exc}")
                continue
            completion = output.outputs[0]
            completions[kind] = completion
            mm = ", ".join(f"{n} {m} tokens" for m, n in output.num_mm_tokens.items())
            report.add(
                name,
                len(completion.token_ids) > 0,
                f"{len(completion.token_ids)} tokens generated from a "
                f"{len(output.prompt_token_ids)}-token prompt" + (f" ({mm})" if mm else ""),
            )
    finally:
        llm.shutdown()
    return completions


def _reference_rows(
    report: CheckReport,
    checkpoint: Path,
    source_architecture: str,
    requests: dict[str, Any],
    completions: dict[str, Any],
    max_tokens: int,
) -> None:
    from omniserve.plugin_tools.reference import (
        compare_with_reference,
        hf_greedy_mm,
        hf_model_class,
    )

    hf_cls = hf_model_class(source_architecture)
    if hf_cls is None:
        report.add(
            "matches transformers",
            None,
            f"transformers has no {source_architecture} class to compare with",
        )
        return
    kinds = list(completions)
    try:
        references = hf_greedy_mm(str(checkpoint), hf_cls, [requests[k] for k in kinds], max_tokens)
    except Exception as exc:
        report.add(
            "matches transformers",
            None,
            f"transformers could not run {source_architecture}: {type(exc).__name__}: {exc}",
        )
        return
    for kind, reference in zip(kinds, references, strict=True):
        completion = completions[kind]
        result = compare_with_reference(completion.token_ids, completion.logprobs, reference)
        ok = result.tokens_match and result.max_logprob_diff <= LOGPROB_ATOL
        report.add(
            f"matches transformers [{kind}]", ok, f"{result.detail} (tolerance {LOGPROB_ATOL:.0e})"
        )
