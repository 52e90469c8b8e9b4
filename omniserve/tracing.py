"""OpenTelemetry traces of requests (vLLM's ``--otlp-traces-endpoint``).

``RequestTracer`` is a stat logger (``metrics.py``'s three calls): when an engine request
finishes it sends one span, vLLM's ``llm_request`` (kind SERVER, from the request's arrival to
its end) with vLLM's ``gen_ai.*`` attributes, through OTLP over grpc or http/protobuf
(``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``; the other ``OTEL_*`` variables apply as usual). A
request whose HTTP headers carry a W3C trace context (``traceparent``, ``tracestate``) gets its
span in that trace: the server's middleware puts the headers in ``TRACE_HEADERS`` for the
request's task, where ``record_new_requests`` reads them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from omniserve.config import OmniConfig
from omniserve.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestTimes,
)
from omniserve.sampling_params import SamplingParams

TRACE_HEADER_NAMES = ("traceparent", "tracestate")
TRACE_HEADERS: ContextVar[dict[str, str] | None] = ContextVar("trace_headers", default=None)
"""The W3C trace context headers of the HTTP request being served (None: none came)."""
SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's span attribute names (OpenTelemetry's gen_ai conventions)."""

    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_N = "gen_ai.request.n"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    FINISH_REASON = "gen_ai.response.finish_reasons"


_PHASE_ATTRIBUTES = {
    "queue": SpanAttributes.LATENCY_TIME_IN_QUEUE,
    "prefill": SpanAttributes.LATENCY_TIME_IN_MODEL_PREFILL,
    "decode": SpanAttributes.LATENCY_TIME_IN_MODEL_DECODE,
    "inference": SpanAttributes.LATENCY_TIME_IN_MODEL_INFERENCE,
}
"""``messages.RequestTimes.phases``' phases -> vLLM's span attributes."""


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The trace context headers among ``headers`` (None: there are none)."""
    found = {name: headers[name] for name in TRACE_HEADER_NAMES if name in headers}
    return found or None


@dataclass
class _Traced:
    times: RequestTimes
    params: SamplingParams
    max_tokens: int
    parent: Any
    """The OpenTelemetry context the request's headers carried (None: a new trace)."""


class RequestTracer:
    def __init__(self, endpoint: str, model_name: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.model_name = model_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": _service()}))
        self.provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
        self.tracer = self.provider.get_tracer("omniserve")
        self._requests: dict[str, _Traced] = {}

    def record_new_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        from opentelemetry.propagate import extract

        headers = TRACE_HEADERS.get()
        parent = extract(headers) if headers else None
        for request in requests:
            self._requests[request.request_id] = _Traced(
                RequestTimes(request.arrival_time, len(request.prompt_token_ids)),
                request.sampling_params, request.max_tokens, parent,
            )  # fmt: skip

    def record(self, outputs: EngineCoreOutputs, processed: Any) -> None:
        now = time.time()
        for output in outputs.outputs:
            traced = self._requests.get(output.request_id)
            if traced is None:
                continue
            if output.new_token_ids:
                traced.times.add_tokens(len(output.new_token_ids), now)
            if output.finish_reason is not None:
                self._finish(output.request_id, str(output.finish_reason), now, output)
        for request_id in getattr(processed, "reqs_to_abort", ()):  # stop strings
            self._finish(request_id, "stop", now)

    def record_aborted(self, request_ids: Iterable[str]) -> None:
        now = time.time()
        for request_id in request_ids:
            self._finish(request_id, "abort", now)

    def _finish(
        self, request_id: str, reason: str, now: float, last: EngineCoreOutput | None = None
    ) -> None:
        """``last``: the request's last output, with its engine times (as the stat logger's)."""
        from opentelemetry.trace import SpanKind

        traced = self._requests.pop(request_id, None)
        if traced is None:
            return
        params, times = traced.params, traced.times
        attributes: dict[str, Any] = {
            SpanAttributes.REQUEST_ID: request_id,
            SpanAttributes.RESPONSE_MODEL: self.model_name,
            SpanAttributes.REQUEST_MAX_TOKENS: traced.max_tokens,
            SpanAttributes.REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.REQUEST_TOP_P: params.top_p,
            SpanAttributes.REQUEST_N: params.n,
            SpanAttributes.USAGE_PROMPT_TOKENS: times.num_prompt_tokens,
            SpanAttributes.USAGE_COMPLETION_TOKENS: times.num_generated,
            SpanAttributes.USAGE_NUM_SEQUENCES: 1,
            SpanAttributes.LATENCY_E2E: now - times.arrival_time,
            SpanAttributes.FINISH_REASON: [reason],
        }
        if times.first_token_time is not None:
            attributes[SpanAttributes.LATENCY_TIME_TO_FIRST_TOKEN] = (
                times.first_token_time - times.arrival_time
            )
        if last is not None:
            attributes.update({_PHASE_ATTRIBUTES[phase]: seconds
                               for phase, seconds in times.phases(last).items()})  # fmt: skip
        span = self.tracer.start_span(SPAN_NAME, context=traced.parent, kind=SpanKind.SERVER,
                                      attributes=attributes,
                                      start_time=int(times.arrival_time * 1e9))  # fmt: skip
        span.end(end_time=int(now * 1e9))

    def shutdown(self) -> None:
        """Send the spans not sent yet, and stop."""
        self.provider.shutdown()


def request_tracers(config: OmniConfig) -> list[RequestTracer]:
    """The tracer ``--otlp-traces-endpoint`` asks for, as a stat logger (none without it)."""
    endpoint = config.observability_config.otlp_traces_endpoint
    return [RequestTracer(endpoint, config.model_config.name)] if endpoint else []


def close_stat_loggers(stat_loggers: Iterable[Any]) -> None:
    """Let the stat loggers that send things (the tracer) send what they hold."""
    for stat_logger in stat_loggers:
        if callable(close := getattr(stat_logger, "shutdown", None)):
            close()


def _service() -> str:
    return os.environ.get("OTEL_SERVICE_NAME", "omniserve")


def _exporter(endpoint: str) -> Any:
    """vLLM's choice: OTLP over grpc unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says
    http/protobuf."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf, "
                         f"not {protocol!r}.")  # fmt: skip
    return OTLPSpanExporter(endpoint=endpoint)
