"""Prometheus metrics of an ``AsyncLLM`` (served at ``/metrics``), named like vLLM's, and vLLM's
periodic stats line in the log (``LoggingStatLogger``).

``PrometheusStatLogger`` is passed to ``AsyncLLM(stat_loggers=[...])``, which calls it at three
points: ``record_new_requests`` when engine requests are submitted (arrival time, prompt length),
``record`` after every engine step, and ``record_aborted`` when requests are aborted. Stats are per
engine request, so each of the ``n`` samples of a request counts as one request, as in vLLM V1.

Load gauges come from the scheduler's stats; because an idle engine sends no steps, the server
refreshes them at scrape time (``record_scheduler_stats``), so a drained engine reads 0. Everything
an engine core reports (load gauges, cache and preemption counters, requests received) carries an
``engine`` label, its data-parallel rank, as vLLM's metrics do; front-end metrics (tokens,
latencies, finished requests) cover all engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from omniserve.lora.request import RUNNING_KEY, WAITING_KEY
from omniserve.messages import (
    ACCEPTED_AT_KEY,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestTimes,
)

logger = logging.getLogger(__name__)
PREFIX = "omniserve:"
# Seconds; fine at the low end (a step of a small model) and up to long CPU generations.
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
# scheduler_stats key (also the counter's name) -> help; the engine reports them cumulatively.
_ENGINE_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "num_preemptions": "Requests preempted to free KV blocks.",
    "encoder_cache_queries": "Multimodal items a scheduled step needed encoder outputs for.",
    "encoder_cache_hits": "Of those, items whose encoder output was cached or shared (not "
    "encoded again).",
    "num_requests_received": "Requests the engine core was given (each of n samples counts).",
    "spec_decode_num_drafts": "Speculative decoding: request steps that verified drafts.",
    "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted (the "
    "model sampled the same token).",
}
_ENGINE_GAUGES = {  # scheduler_stats key -> (metric name, help)
    "num_running": ("num_requests_running", "Requests in the running batch."),
    "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."),
    "encoder_cache_usage": (
        "encoder_cache_usage_perc",
        "Fraction of the encoder cache in use (0-1).",
    ),
}


class PrometheusStatLogger:
    """Engine load, token counts and per-request latencies, in a registry of its own."""

    def __init__(self, model_name: str, num_engines: int = 1, max_loras: int = 0) -> None:
        """``max_loras``: adapters per step with LoRA on (0: off, no LoRA metric)."""
        self.registry = CollectorRegistry()
        self._requests: dict[str, RequestTimes] = {}  # engine request id -> its timings
        # (engine rank, counter key) -> the engine's last cumulative value
        self._last_engine_counters: dict[tuple[int, str], float] = {}
        self._model_name = model_name
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str) -> Any:
            return Histogram(
                PREFIX + name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry
            ).labels(model_name)

        engine_labels = ["model_name", "engine"]
        self._engine_gauges = {
            key: Gauge(PREFIX + name, doc, engine_labels, registry=self.registry)
            for key, (name, doc) in _ENGINE_GAUGES.items()
        }
        self._prefix_cache_hit_rate = Gauge(
            PREFIX + "prefix_cache_hit_rate",
            "Prefix-cache hits / queries since start (tokens).",
            engine_labels,
            registry=self.registry,
        )
        self._engine_counters = {
            key: Counter(PREFIX + key, doc, engine_labels, registry=self.registry)
            for key, doc in _ENGINE_COUNTERS.items()
        }
        self._accepted_at = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: drafts accepted at each draft position (0: the first).",
            [*engine_labels, "position"],
            registry=self.registry,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's outputs.")
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1).",
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self._phases = {
            "queue": histogram("request_queue_time_seconds",
                               "Received by the engine core to first scheduled."),
            "prefill": histogram("request_prefill_time_seconds", "First scheduled to first token."),
            "decode": histogram("request_decode_time_seconds", "First token to last token."),
            "inference": histogram("request_inference_time_seconds",
                                   "First scheduled to last token."),
        }  # fmt: skip
        self._max_loras = max_loras
        self._lora_info = (
            Gauge(
                PREFIX + "lora_requests_info",
                "The adapters of running and waiting requests (vLLM's labels); the value is "
                "when they were read.",
                [*engine_labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                registry=self.registry,
            )
            if max_loras
            else None
        )
        self._lora_labels: dict[int, tuple[str, ...]] = {}  # engine -> its current label set
        for engine in range(num_engines):  # every engine shows from the start, at zero
            self.record_scheduler_stats({}, engine)

    def record_new_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        for request in requests:
            self._requests[request.request_id] = RequestTimes(
                request.arrival_time, len(request.prompt_token_ids)
            )

    def record(self, outputs: EngineCoreOutputs, processed: Any) -> None:
        """One engine step: token counts, latencies, finished requests, scheduler stats.

        ``processed.reqs_to_abort`` lists requests a stop string finished in the front end; the
        engine reports no finish for those, so they finish here with reason "stop".
        """
        now = time.time()
        if outputs.scheduler_stats:
            self.record_scheduler_stats(outputs.scheduler_stats, outputs.engine_index)
        for output in outputs.outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            if output.new_token_ids:
                self._record_tokens(times, len(output.new_token_ids), now)
            if output.finish_reason is not None:
                self._finish(output.request_id, str(output.finish_reason), now, output)
        for request_id in getattr(processed, "reqs_to_abort", ()):
            self._finish(request_id, "stop", now)

    def record_aborted(self, request_ids: Iterable[str]) -> None:
        now = time.time()
        for request_id in request_ids:
            self._finish(request_id, "abort", now)

    def record_scheduler_stats(self, stats: dict[str, float], engine: int = 0) -> None:
        """One engine core's stats (``EngineCore.make_stats``): gauges, cumulative counters."""
        labels = (self._model_name, str(engine))
        for key, gauge in self._engine_gauges.items():
            gauge.labels(*labels).set(stats.get(key, 0.0))
        for key, counter in self._engine_counters.items():
            child = counter.labels(*labels)  # created at zero, so it shows before any traffic
            value = stats.get(key)
            if value is not None:
                child.inc(self._growth(engine, key, value))
        for key, value in stats.items():
            if key.startswith(ACCEPTED_AT_KEY):
                position = key.removeprefix(ACCEPTED_AT_KEY)
                self._accepted_at.labels(*labels, position).inc(self._growth(engine, key, value))
        if self._lora_info is not None:
            adapters = [",".join(sorted(k.removeprefix(prefix) for k in stats
                                        if k.startswith(prefix)))
                        for prefix in (RUNNING_KEY, WAITING_KEY)]  # fmt: skip
            lora_labels = (*labels, str(self._max_loras), *adapters)
            previous = self._lora_labels.get(engine)
            if previous is not None and previous != lora_labels:
                self._lora_info.remove(*previous)
            self._lora_labels[engine] = lora_labels
            self._lora_info.labels(*lora_labels).set_to_current_time()
        queries = stats.get("prefix_cache_queries", 0.0)
        hit_rate = self._prefix_cache_hit_rate.labels(*labels)
        if queries:
            hit_rate.set(stats.get("prefix_cache_hits", 0.0) / queries)

    def _growth(self, engine: int, key: str, value: float) -> float:
        """How much an engine's cumulative counter grew since it was last read; a value below
        the last one is a counter that restarted from zero (``reset_prefix_cache``), all of it
        new, as Prometheus reads a counter reset."""
        last = self._last_engine_counters.get((engine, key), 0.0)
        self._last_engine_counters[engine, key] = value
        return value - last if value >= last else value

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _record_tokens(self, times: RequestTimes, num_tokens: int, now: float) -> None:
        previous = times.add_tokens(num_tokens, now)
        if previous is None:
            self.ttft.observe(now - times.arrival_time)
            self.prompt_tokens.inc(times.num_prompt_tokens)
        else:
            self.itl.observe(now - previous)
        self.generation_tokens.inc(num_tokens)

    def _finish(
        self, request_id: str, reason: str, now: float, last: EngineCoreOutput | None = None
    ) -> None:
        """``last``: the request's last output, which carries its engine times (an abort, or
        a stop string the front end found, has none)."""
        times = self._requests.pop(request_id, None)
        if times is None:
            return
        self._request_success.labels(self._model_name, reason).inc()
        self.e2e.observe(now - times.arrival_time)
        if last is not None:
            for phase, seconds in times.phases(last).items():
                self._phases[phase].observe(seconds)
        if times.num_generated > 1 and times.first_token_time and times.last_token_time:
            self.tpot.observe(
                (times.last_token_time - times.first_token_time) / (times.num_generated - 1)
            )


class LoggingStatLogger:
    """vLLM's stats line, logged at most every ``interval`` seconds while the engine works (an
    idle engine sends no steps, so it logs nothing): prompt and generation throughput since the
    last line, running and waiting requests, KV cache usage and the prefix cache hit rate over
    the interval. Same three calls as ``PrometheusStatLogger``."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last_log = self._last_step = clock()
        # engine request id -> its prompt's tokens, until its first token
        self._prompt_lens: dict[str, int] = {}
        self._prompt_tokens = self._generation_tokens = 0
        self._stats: dict[int, dict[str, float]] = {}  # engine rank -> its last stats
        self._logged_cache = (0.0, 0.0)  # prefix cache (queries, hits) at the last line
        self._hit_rate = 0.0

    def record_new_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        for request in requests:
            self._prompt_lens[request.request_id] = len(request.prompt_token_ids)

    def record(self, outputs: EngineCoreOutputs, processed: Any) -> None:
        now = self._clock()
        if now - self._last_step > self.interval:  # the engine was idle: a new window
            self._last_log, self._prompt_tokens, self._generation_tokens = now, 0, 0
        self._last_step = now
        if outputs.scheduler_stats:
            self._stats[outputs.engine_index] = outputs.scheduler_stats
        for output in outputs.outputs:
            if output.new_token_ids:
                self._prompt_tokens += self._prompt_lens.pop(output.request_id, 0)
                self._generation_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                self._prompt_lens.pop(output.request_id, None)
        self.log(now)

    def record_aborted(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._prompt_lens.pop(request_id, None)

    def log(self, now: float) -> None:
        elapsed = now - self._last_log
        if elapsed < self.interval:
            return
        total = {key: sum(stats.get(key, 0.0) for stats in self._stats.values())
                 for key in ("num_running", "num_waiting", "prefix_cache_queries",
                             "prefix_cache_hits")}  # fmt: skip
        usage = max((stats.get("kv_cache_usage", 0.0) for stats in self._stats.values()),
                    default=0.0)  # fmt: skip
        queries = total["prefix_cache_queries"] - self._logged_cache[0]
        if queries > 0:
            self._hit_rate = (total["prefix_cache_hits"] - self._logged_cache[1]) / queries
        self._logged_cache = (total["prefix_cache_queries"], total["prefix_cache_hits"])
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit "
            "rate: %.1f%%",
            self._prompt_tokens / elapsed,
            self._generation_tokens / elapsed,
            total["num_running"],
            total["num_waiting"],
            100 * usage,
            100 * self._hit_rate,
        )
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = 0
