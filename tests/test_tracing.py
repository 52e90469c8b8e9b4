"""``--otlp-traces-endpoint`` (vLLM's): a span per request, sent by OpenTelemetry's OTLP exporter
to a collector (here a small one in the test, over http/protobuf and grpc): vLLM's name, kind
and ``gen_ai.*`` attributes with the request's real counts and latencies, in the trace of the
HTTP request's ``traceparent``; bad settings stop start-up naming them."""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from omniserve import LLM, SamplingParams
from omniserve.engine.arg_utils import EngineArgs
from tests.server_utils import API_KEY, MODEL, free_port, launch_server

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Collector:
    """The spans of every export received, as (name, kind, attributes, trace id, parent id)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, int, dict[str, Any], str, str]] = []
        self.lock = threading.Lock()

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        attributes = {a.key: _value(a.value) for a in span.attributes}
                        ids = (span.trace_id.hex(), span.parent_span_id.hex())
                        self.spans.append((span.name, span.kind, attributes, *ids))


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@pytest.fixture
def http_collector() -> Any:
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            collector.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield collector, f"http://127.0.0.1:{server.server_port}/v1/traces"
    server.shutdown()


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint("Qwen2ForCausalLM"))


def _check_span(span: tuple, prompt_tokens: int, completion_tokens: int, request_id: str) -> None:
    name, kind, attributes, _, _ = span
    assert name == "llm_request" and kind == 2  # SPAN_KIND_SERVER
    assert attributes["gen_ai.request.id"] == request_id
    assert attributes["gen_ai.usage.prompt_tokens"] == prompt_tokens
    assert attributes["gen_ai.usage.completion_tokens"] == completion_tokens
    assert attributes["gen_ai.request.max_tokens"] == completion_tokens
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert 0 < attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    phases = [attributes[f"gen_ai.latency.time_in_{name}"] for name in
              ("queue", "model_prefill", "model_decode", "model_inference")]  # fmt: skip
    queue, prefill, decode, inference = phases
    assert min(phases) >= 0 and prefill + decode == pytest.approx(inference, abs=1e-6)
    assert queue + inference <= attributes["gen_ai.latency.e2e"]


def test_offline_spans_over_http(qwen2: str, http_collector: Any, monkeypatch: Any) -> None:
    collector, url = http_collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    llm = LLM(qwen2, dtype="float32", max_model_len=64, otlp_traces_endpoint=url)
    try:
        for request_id, (prompt, max_tokens) in enumerate((([1, 2, 3], 4), ([4, 5, 6, 7, 8], 2))):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            llm.llm_engine.add_request(str(request_id), {"prompt_token_ids": prompt}, params)
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
    finally:
        llm.shutdown()  # sends the spans still held
    spans = sorted(collector.spans, key=lambda span: span[2]["gen_ai.request.id"])
    assert len(spans) == 2
    _check_span(spans[0], 3, 4, "0")
    _check_span(spans[1], 5, 2, "1")
    assert spans[0][3] != spans[1][3] and spans[0][4] == ""  # each its own trace, a root


def test_offline_spans_over_grpc(qwen2: str) -> None:
    import grpc

    collector = Collector()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (grpc's name)
            collector.take(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        llm = LLM(qwen2, dtype="float32", max_model_len=64,
                  otlp_traces_endpoint=f"http://127.0.0.1:{port}")  # fmt: skip
        try:
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, use_tqdm=False)
        finally:
            llm.shutdown()
    finally:
        server.stop(0)
    (span,) = collector.spans
    _check_span(span, 4, 3, span[2]["gen_ai.request.id"])


def test_server_spans_join_the_callers_trace(
    qwen2: str, http_collector: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    collector, url = http_collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: export soon after each span
    with launch_server(Path(qwen2), tmp_path, "--otlp-traces-endpoint", url) as server:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.0,
                "ignore_eos": True, "request_id": "traced"}  # fmt: skip
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                   "Authorization": f"Bearer {API_KEY}"}  # fmt: skip
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers,
                              timeout=60)  # fmt: skip
        assert response.status_code == 200, response.text
        untraced = server.post("/v1/completions", {**body, "request_id": "plain"})
        assert untraced.status_code == 200
    spans = {span[2]["gen_ai.request.id"]: span for span in collector.spans}
    assert set(spans) == {"cmpl-traced", "cmpl-plain"}, spans
    _check_span(spans["cmpl-traced"], 3, 2, "cmpl-traced")
    assert spans["cmpl-traced"][3:] == (TRACE_ID, PARENT_ID)
    assert spans["cmpl-plain"][3] != TRACE_ID and spans["cmpl-plain"][4] == ""
    assert spans["cmpl-traced"][2]["gen_ai.response.model"] == MODEL


def test_bad_settings_stop_start_up(qwen2: str, monkeypatch: Any) -> None:
    import importlib.util

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="must be grpc or http/protobuf, not 'carrier-pigeon'"):
        LLM(qwen2, dtype="float32", max_model_len=64,
            otlp_traces_endpoint=f"http://127.0.0.1:{free_port()}")  # fmt: skip
    find_spec = importlib.util.find_spec

    def without_otel(name: str, *args: Any) -> Any:
        return None if name.startswith("opentelemetry") else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_otel)
    with pytest.raises(ValueError, match=r"pip install 'omniserve\[otel\]'"):
        EngineArgs(qwen2, otlp_traces_endpoint="http://collector:4317").create_config()
