"""Engine settings a user gets wrong fail at start-up naming the setting: in the Python API
(``LLM(**kwargs)`` builds ``EngineArgs``) as on the command line, before any request meets them."""

from __future__ import annotations

from typing import Any

import pytest

from omniserve.engine.arg_checks import check_vllm_only, without_vllm_only
from omniserve.engine.arg_utils import EngineArgs, parse_bytes

REFUSED = [
    # types the Python API would otherwise carry deep into the engine
    ({"block_size": "16"}, TypeError, "block_size must be an integer, got '16'"),
    ({"max_model_len": 200.5}, TypeError, "max_model_len must be an integer or None, got 200.5"),
    ({"max_num_seqs": True}, TypeError, "max_num_seqs must be an integer, got True"),
    ({"allowed_media_domains": "example.com"}, TypeError, "allowed_media_domains must be"),
    ({"mm_processor_cache_gb": float("nan")}, ValueError, "mm_processor_cache_gb must be a number"),
    ({"limit_mm_per_prompt": {"image": True}}, TypeError, "limit_mm_per_prompt must be"),
    ({"seed": 2**64}, ValueError, "seed must be in [-9223372036854775808, 18446744073709551615]"),
    # values no request could run with
    ({"max_logprobs": -2}, ValueError, "max_logprobs must be >= 0 (or -1: no cap)"),
    ({"max_num_encoder_input_tokens": -1}, ValueError, "max_num_encoder_input_tokens must be >= 1"),
    ({"max_num_encoder_input_tokens": 0}, ValueError, "max_num_encoder_input_tokens must be >= 1"),
    ({"encoder_cache_size": 0}, ValueError, "encoder_cache_size must be >= 1, got 0"),
    ({"long_prefill_token_threshold": -1}, ValueError, "long_prefill_token_threshold must be >= 0"),
    ({"kv_cache_memory": "1e999"}, ValueError, "--kv-cache-memory: cannot read '1e999'"),
    ({"kv_cache_memory": "..."}, ValueError, "--kv-cache-memory: cannot read '...'"),
    ({"served_model_name": []}, ValueError, "served_model_name: an empty list"),
    # settings that would only fail in every request
    ({"allowed_local_media_path": "/nonexistent"}, ValueError,
     "--allowed-local-media-path /nonexistent is not a directory"),
    ({"limit_mm_per_prompt": {"image": {"count": 2, "depth": 3}}}, ValueError,
     "limit_mm_per_prompt['image']['depth']: not a setting of image (it takes: count, width, "
     "height)"),
    ({"limit_mm_per_prompt": '{"video": {"num_frames": 0}}'}, ValueError,
     "limit_mm_per_prompt['video']['num_frames'] must be an integer >= 1, got 0"),
    ({"limit_mm_per_prompt": '{"images": 2}'}, ValueError,
     "--limit-mm-per-prompt: this model does not take images input (it takes: image, video)"),
    ({"mm_processor_kwargs": '{"max_pixel": 100}'}, ValueError,
     "max_pixel is not an option of this model's processor (did you mean max_pixels"),
]  # fmt: skip


def _start(model: str, **kwargs: object) -> None:
    """Everything start-up checks short of loading weights: the config and the front end."""
    from omniserve.engine.processor import Processor

    Processor(EngineArgs(model=model, **kwargs).create_config())  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "error", "message"), REFUSED)
def test_bad_settings_fail_at_start_naming_them(tiny_checkpoint, kwargs, error, message):
    with pytest.raises(error) as raised:
        _start(str(tiny_checkpoint("Qwen2VLForConditionalGeneration")), **kwargs)
    assert message in str(raised.value)


def test_good_settings_start(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    args = EngineArgs(model=model, served_model_name=["a", "b"], kv_cache_memory=4e8,
                      allowed_media_domains=["example.com"])  # fmt: skip
    config = args.create_config()
    assert config.model_config.name == "a"
    assert config.cache_config.kv_cache_memory_bytes == 400_000_000
    # a modality the model does not take may be limited to 0 (a launch script shared by models)
    _start(model, limit_mm_per_prompt={"audio": 0, "image": 1},
           allowed_local_media_path=str(tmp_path),
           mm_processor_kwargs={"max_pixels": 200704, "fps": 1.0})  # fmt: skip
    _start(model, limit_mm_per_prompt={"audio": 1})  # a modality other models take: logged
    with pytest.raises(ValueError, match="this model takes no multimodal input"):
        _start(str(tiny_checkpoint("Qwen3ForCausalLM")), limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="this model takes no multimodal input"):
        _start(str(tiny_checkpoint("Qwen3ForCausalLM")),
               limit_mm_per_prompt={"image": {"width": 512}})  # fmt: skip


def test_max_logprobs_minus_one_is_no_cap_but_the_vocabulary(tiny_checkpoint):
    """vLLM's -1: no cap; a request still cannot ask for more than the vocabulary holds."""
    from omniserve.engine.processor import Processor
    from omniserve.sampling_params import SamplingParams

    model = str(tiny_checkpoint("Qwen3ForCausalLM"))
    processor = Processor(EngineArgs(model=model, max_logprobs=-1).create_config())
    processor._validate_params(SamplingParams(logprobs=100, prompt_logprobs=100))
    with pytest.raises(ValueError, match=f"at most {processor.vocab_size} logprobs"):
        processor._validate_params(SamplingParams(logprobs=processor.vocab_size + 1))


def test_parse_bytes_reads_units_and_numbers():
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("1e9") == parse_bytes(1e9) == parse_bytes(10**9) == 10**9
    assert parse_bytes(None) is None
    with pytest.raises(ValueError, match="--kv-cache-memory: cannot read '4 parsecs'"):
        parse_bytes("4 parsecs", "kv_cache_memory")


def test_vllm_settings_of_the_python_api(caplog):
    """``LLM(trust_remote_code=True)`` means what ``--trust-remote-code`` means: nothing here."""
    with caplog.at_level("INFO", logger="omniserve.engine.arg_checks"):
        check_vllm_only({"trust_remote_code": True, "tokenizer_mode": "auto", "seed": 1})
    assert "--trust-remote-code has no effect here" in caplog.text
    with pytest.raises(ValueError, match="--tokenizer-mode must be one of"):
        check_vllm_only({"tokenizer_mode": "mistral"})
    with pytest.raises(ValueError, match="--cpu-offload-gb: weight offloading is not implemented"):
        check_vllm_only({"cpu_offload_gb": 4})
    assert without_vllm_only({"trust_remote_code": True, "seed": 1}) == {"seed": 1}
    # vLLM's names: logged, refused naming the feature, or renamed to this engine's
    with caplog.at_level("INFO", logger="omniserve.engine.arg_checks"):
        kept = without_vllm_only({"revision": "main", "model_impl": "auto",
                                  "kv_cache_memory_bytes": 1 << 30})  # fmt: skip
    assert kept == {"kv_cache_memory": 1 << 30}
    assert "--revision has no effect here" in caplog.text
    with pytest.raises(ValueError, match="--model-impl must be one of"):
        check_vllm_only({"model_impl": "transformers"})
    with pytest.raises(ValueError, match="--headless: an engine without an API server"):
        check_vllm_only({"headless": True})
    with pytest.raises(ValueError, match="kv_cache_memory_bytes and kv_cache_memory are one"):
        without_vllm_only({"kv_cache_memory_bytes": 1, "kv_cache_memory": 2})


def test_vllm_spellings_of_settings(tiny_checkpoint):
    """vLLM's other forms: a torch dtype, seed None, ``image=2,video=1`` limits, None for a
    default, ``--dtype half``, ``--max-model-len 1k``, ``serve --model DIR``."""
    import torch

    from omniserve.entrypoints.cli import build_parser

    model = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))
    args = EngineArgs(model=model, dtype=torch.float32, seed=None,
                      limit_mm_per_prompt="image=2, video=1")  # fmt: skip
    config = args.create_config()
    assert (config.model_config.dtype, config.model_config.seed) == ("float32", None)
    assert config.multimodal_config.limit_mm_per_prompt == {"image": 2, "video": 1}
    # vLLM's None for "its default": prefix caching and chunked prefill on, async scheduling off
    config = EngineArgs(model=model, enable_prefix_caching=None, enable_chunked_prefill=None,
                        async_scheduling=None).create_config()  # fmt: skip
    sched = config.scheduler_config
    assert config.cache_config.enable_prefix_caching and sched.enable_chunked_prefill
    assert not sched.async_scheduling
    # vLLM's older spellings: --task, --disable-mm-preprocessor-cache
    config = EngineArgs(model=model, task="embed", disable_mm_preprocessor_cache=True,
                        skip_mm_profiling=True).create_config()  # fmt: skip
    assert config.model_config.runner == "pooling"
    assert config.multimodal_config.mm_processor_cache_gb == 0
    assert config.multimodal_config.skip_mm_profiling
    with pytest.raises(ValueError, match="--task generate contradicts --runner pooling"):
        EngineArgs(model=model, task="generate", runner="pooling").create_config()
    with pytest.raises(ValueError, match="--task must be one of auto, generate"):
        EngineArgs(model=model, task="draw").create_config()
    parser = build_parser()
    parsed = parser.parse_args(["serve", "--model", model, "--dtype", "half",
                                "--max-model-len", "1k", "--disable-chunked-mm-input",
                                "--logprobs-mode", "processed_logits"])  # fmt: skip
    parsed.check_flags(parser, parsed)
    assert (parsed.model, parsed.dtype, parsed.max_model_len) == (model, "half", 1000)
    config = EngineArgs.from_cli_args(parsed).create_config()
    assert config.model_config.dtype == "float16"
    assert config.scheduler_config.disable_chunked_mm_input
    assert config.model_config.logprobs_mode == "processed_logits"
    for text, tokens in (("32K", 32768), ("1.5k", 1500), ("4096", 4096), ("1M", 1 << 20)):
        assert parser.parse_args(["serve", "--max-model-len", text]).max_model_len == tokens
    for argv in (["serve", "--max-model-len", "lots"], ["serve", "a", "--model", "b"]):
        with pytest.raises(SystemExit):
            parsed = parser.parse_args(argv)
            parsed.check_flags(parser, parsed)


def test_hf_overrides_as_a_function(tiny_checkpoint):
    """vLLM's callable ``hf_overrides``: the transformers config in, changed; read once as the
    keys it changed (nested configs key by key), so every process applies the same."""
    vl = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))

    def shorter(config):
        config.text_config.max_position_embeddings = 256
        config.image_token_id = config.image_token_id  # unchanged: not an override
        return config

    config = EngineArgs(model=vl, hf_overrides=shorter).create_config()
    assert config.model_config.hf_overrides == {"text_config": {"max_position_embeddings": 256}}
    assert config.model_config.max_model_len == 256
    assert config.model_config.hf_config.text_config.max_position_embeddings == 256
    for function, message in (
        (lambda config: None, "must return the transformers config it was given"),
        (lambda config: 1 / 0, "the function raised ZeroDivisionError"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=vl, hf_overrides=function).create_config()
    with pytest.raises(TypeError, match="hf_overrides must be a dict .* a function or None"):
        EngineArgs(model=vl, hf_overrides=3)  # type: ignore[arg-type]


def test_disable_sliding_window(tiny_checkpoint) -> None:
    """vLLM's --disable-sliding-window: sliding layers attend fully, max_model_len capped at the
    window; then a prompt within the window answers as with the window (greedy fp32)."""
    from omniserve import LLM, SamplingParams

    windowed = str(tiny_checkpoint("Qwen2ForCausalLM", overrides={
        "use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}))  # fmt: skip
    config = EngineArgs(windowed, disable_sliding_window=True).create_config().model_config
    assert config.max_model_len == 24
    text = config.hf_config.get_text_config()
    assert set(text.layer_types) == {"full_attention"} and text.sliding_window is None
    with pytest.raises(ValueError, match="exceeds the sliding window \\(24\\)"):
        EngineArgs(windowed, disable_sliding_window=True, max_model_len=64).create_config()
    plain = EngineArgs(str(tiny_checkpoint("Qwen2ForCausalLM")), disable_sliding_window=True)
    assert plain.create_config().model_config.max_model_len > 24  # no window: nothing capped
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    prompt = {"prompt_token_ids": list(range(10, 26))}  # 16 + 6 tokens: within the window
    from omniserve.attention.layer import get_attention_layers

    answers = []
    for disable, windows in ((False, [None, 24]), (True, [None, None])):
        llm = LLM(windowed, dtype="float32", max_model_len=24, disable_sliding_window=disable)
        try:
            worker = llm.llm_engine.engine_core.engine_core.model_executor.worker
            layers = get_attention_layers(worker.model_runner.model)
            assert [layer.sliding_window for layer in layers] == windows
            answers.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0])
        finally:
            llm.shutdown()
    assert answers[0].token_ids == answers[1].token_ids
    for a, b in zip(answers[0].logprobs, answers[1].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_cuda_graph_sizes_and_renamed_pooler_config(tiny_checkpoint) -> None:
    import argparse

    model = str(tiny_checkpoint("Qwen2ForCausalLM"))

    def graphs(**kwargs: Any) -> tuple[bool, tuple[int, ...], int | None]:
        config = EngineArgs(model, **kwargs).create_config().model_config
        return config.enforce_eager, config.cuda_graph_sizes, config.max_cudagraph_capture_size

    assert graphs() == (False, (), None)
    assert graphs(cuda_graph_sizes=[8, 16]) == (False, (8, 16), None)
    assert graphs(cuda_graph_sizes=[32]) == graphs(max_cudagraph_capture_size=32) == (
        False, (), 32)  # fmt: skip
    # vLLM's --compilation-config: its graph keys take effect (a one-size list is that size)
    assert graphs(compilation_config={"cudagraph_capture_sizes": [16, 4, 4]}) == (
        False, (4, 16), None)  # fmt: skip
    assert graphs(compilation_config='{"cudagraph_capture_sizes": [8]}') == (False, (8,), None)
    assert graphs(compilation_config={"max_cudagraph_capture_size": 64, "mode": 3}) == (
        False, (), 64)  # fmt: skip
    assert graphs(compilation_config={"cudagraph_mode": "NONE"})[0]
    assert graphs(compilation_config={"use_cudagraph": False})[0]
    assert graphs(optimization_level=0)[0] and not graphs(optimization_level=3)[0]
    assert not graphs(compilation_config=3)[0]  # a bare number: torch.compile's mode
    for bad, message in (
        ({"cudagraph_mode": "ALL"}, "cudagraph_mode must be one of NONE, PIECEWISE"),
        ({"cudagraph_capture_sizes": [0]}, "cudagraph_capture_sizes must be a list of batch"),
        ({"max_cudagraph_capture_size": True}, "max_cudagraph_capture_size must be a batch"),
        ({"use_cudagraph": "no"}, "use_cudagraph must be true or false"),
        ({"cuda_graph_sizes": [1]}, r"unknown key\(s\) cuda_graph_sizes \(vLLM's keys: "),
        ("{level: 3}", "--compilation-config is not JSON"),
        ("[1]", "--compilation-config must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=message):
            graphs(compilation_config=bad)
    with pytest.raises(ValueError, match="-O/--optimization-level must be 0-3"):
        graphs(optimization_level=4)
    with pytest.raises(ValueError, match="--cuda-graph-sizes and --max-cudagraph-capture-size "
                       "are one setting"):  # fmt: skip
        EngineArgs(model, cuda_graph_sizes=[8], max_cudagraph_capture_size=8).create_config()
    with pytest.raises(ValueError, match="--cuda-graph-sizes and --compilation-config "
                       "cudagraph_capture_sizes are one setting"):  # fmt: skip
        graphs(cuda_graph_sizes=[8, 16], compilation_config={"cudagraph_capture_sizes": [8]})
    with pytest.raises(ValueError, match="batch sizes >= 1"):
        EngineArgs(model, cuda_graph_sizes=[0]).create_config()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--cuda-graph-sizes", "1", "4", "--override-pooler-config",
                              '{"pooling_type": "MEAN"}'])  # fmt: skip
    assert args.cuda_graph_sizes == [1, 4] and args.pooler_config == '{"pooling_type": "MEAN"}'
    args = parser.parse_args(["-O0", "-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'])
    assert (args.optimization_level, args.compilation_config) == (
        0, '{"cudagraph_mode": "FULL_AND_PIECEWISE"}')  # fmt: skip


def test_hf_config_path_reads_another_config(tiny_checkpoint, tmp_path) -> None:
    """vLLM's --hf-config-path: config.json from another directory (a checkpoint whose own is
    broken, say), the weights and tokenizer still the model's."""
    import json
    import shutil

    from omniserve import LLM, SamplingParams

    source = tiny_checkpoint("Qwen3ForCausalLM")
    model = tmp_path / "model"
    shutil.copytree(source, model)
    (model / "config.json").write_text("{}")  # no architectures: unusable alone
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    config = json.loads((source / "config.json").read_text())
    (fixed / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 300}))
    with pytest.raises(ValueError, match="names no 'architectures'"):
        EngineArgs(model=str(model)).create_config()
    made = EngineArgs(model=str(model), hf_config_path=str(fixed)).create_config().model_config
    assert (made.max_model_len, made.model, made.tokenizer) == (300, str(model), str(model))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    answers = []
    for path, extra in ((source, {}), (model, {"hf_config_path": str(fixed)})):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
            llm = LLM(str(path), max_model_len=256, kv_cache_memory="4MiB", **extra)
        answers.append(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params,
                                    use_tqdm=False)[0].outputs[0].token_ids)  # fmt: skip
        llm.llm_engine.shutdown()
    assert answers[0] == answers[1]
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        EngineArgs(model=str(model), hf_config_path=str(tmp_path / "none")).create_config()


def test_mm_encoder_tp_mode_settings(tiny_checkpoint) -> None:
    model = str(tiny_checkpoint("Qwen2VLForConditionalGeneration"))

    def mode(**kwargs: Any) -> str:
        return (
            EngineArgs(model=model, **kwargs).create_config().multimodal_config.mm_encoder_tp_mode
        )

    assert mode() == "weights" and mode(mm_encoder_tp_mode="data") == "data"
    assert mode(enable_multimodal_encoder_data_parallel=True) == "data"  # vLLM's older flag
    with pytest.raises(ValueError, match="mm_encoder_tp_mode must be one of"):
        mode(mm_encoder_tp_mode="shards")
