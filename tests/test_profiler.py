"""vLLM's profiler API: ``start_profile`` / ``stop_profile`` write each worker's torch profiler
trace and a table of the ops with the most self time into ``OMNISERVE_TORCH_PROFILER_DIR``;
without it they fail with what to set (the server's routes are then absent: test_api_server)."""

from __future__ import annotations

import pytest

from omniserve import LLM, SamplingParams


def test_profile_writes_the_trace_and_the_op_table(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMNISERVE_TORCH_PROFILER_DIR", str(tmp_path))
    llm = LLM(str(tiny_checkpoint("Qwen2ForCausalLM")), kv_cache_memory=16 << 20)
    try:
        with pytest.raises(RuntimeError, match="not running: call start_profile first"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile()
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
        llm.stop_profile()
    finally:
        llm.shutdown()
    table = (tmp_path / "profiler_out_0.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    assert list(tmp_path.glob("rank0*.pt.trace.json.gz"))


def test_profile_without_a_directory_says_what_to_set(tiny_checkpoint, monkeypatch) -> None:
    monkeypatch.delenv("OMNISERVE_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.setenv("OMNISERVE_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(tiny_checkpoint("Qwen2ForCausalLM")), kv_cache_memory=16 << 20)
    with pytest.raises(RuntimeError, match="OMNISERVE_TORCH_PROFILER_DIR"):
        llm.start_profile()
