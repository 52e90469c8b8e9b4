"""vLLM's periodic stats line (``LoggingStatLogger``): throughput over the interval, the load,
KV cache usage and the interval's prefix cache hit rate; nothing while the engine is idle."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from omniserve.messages import EngineCoreOutput, EngineCoreOutputs
from omniserve.metrics import LoggingStatLogger


def test_the_stats_line_every_interval_while_the_engine_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    stats_logger = LoggingStatLogger(10.0, clock=lambda: now[0])
    requests = [SimpleNamespace(request_id=r, prompt_token_ids=[1] * 50) for r in ("a", "b")]
    stats_logger.record_new_requests(requests)  # type: ignore[arg-type]

    def step(at: float, tokens: dict[str, int], **stats: float) -> None:
        now[0] = at
        outputs = [EngineCoreOutput(r, [7] * n) for r, n in tokens.items()]
        stats_logger.record(EngineCoreOutputs(outputs, scheduler_stats=stats), None)

    with caplog.at_level(logging.INFO, logger="omniserve.metrics"):
        step(101.0, {"a": 1, "b": 1}, num_running=2, kv_cache_usage=0.25,
             prefix_cache_queries=100, prefix_cache_hits=40)  # fmt: skip
        step(105.0, {"a": 4, "b": 4}, num_running=2, num_waiting=1, kv_cache_usage=0.25,
             prefix_cache_queries=100, prefix_cache_hits=40)  # fmt: skip
        assert not caplog.records  # not 10 s yet
        step(110.0, {"a": 5}, num_running=1, num_waiting=3, kv_cache_usage=0.5,
             prefix_cache_queries=100, prefix_cache_hits=40)  # fmt: skip
        (line,) = [r.getMessage() for r in caplog.records]
        assert line == (
            "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 1.5 tokens/s, "
            "Running: 1 reqs, Waiting: 3 reqs, KV cache usage: 50.0%, Prefix cache hit rate: "
            "40.0%"
        )
        caplog.clear()
        # After a minute without steps (idle), the next window starts at the next step.
        step(175.0, {"b": 2}, num_running=1, prefix_cache_queries=150, prefix_cache_hits=90)
        assert not caplog.records
        step(185.0, {"b": 3}, num_running=1, prefix_cache_queries=150, prefix_cache_hits=90)
        (line,) = [r.getMessage() for r in caplog.records]
        assert "generation throughput: 0.5 tokens/s" in line and "hit rate: 100.0%" in line
