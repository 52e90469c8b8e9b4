"""vLLM's observability settings: where request traces go (``--otlp-traces-endpoint``)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

OTEL_EXTRA = "pip install 'omniserve[otel]' (opentelemetry-sdk, opentelemetry-exporter-otlp)"


@dataclass(frozen=True)
class ObservabilityConfig:
    otlp_traces_endpoint: str | None = None
    """Where a span per request goes, by OpenTelemetry's OTLP exporter (``omniserve.tracing``),
    over the protocol ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` names (grpc, as in vLLM, or
    http/protobuf); None: no tracing."""

    def __post_init__(self) -> None:
        endpoint = self.otlp_traces_endpoint
        if endpoint is None:
            return
        if not isinstance(endpoint, str) or not endpoint.strip():
            raise ValueError(f"--otlp-traces-endpoint must be a URL, got {endpoint!r}.")
        if importlib.util.find_spec("opentelemetry.sdk") is None:
            raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry: {OTEL_EXTRA}.")
