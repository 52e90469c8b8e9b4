"""Schema fuzzing: schemathesis generates requests for every operation of the server's OpenAPI
schema (valid and invalid ones) against a live server, and checks that none gets a 5xx and every
response matches what the schema documents (status, content type, body)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server_utils import API_KEY, Server, launch_server

CASES_PER_OPERATION = 10
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
STATUSES: Counter[tuple[str, int]] = Counter()
"""(operation, status) -> responses."""


pytestmark = pytest.mark.slow  # the refusal check reads what the fuzzing sent


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch_server(
        tiny_checkpoint("Qwen3ForCausalLM"),
        tmp_path_factory.mktemp("fuzz"),
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "64MiB",
        "--max-request-body-mb",
        "1",
        "--override-generation-config",  # answers cut short: the fuzzing checks their shape
        '{"max_new_tokens": 8}',
    ) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Server) -> Any:
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=CASES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_documented(case: Any, fuzz_server: Server) -> None:
    response = case.call(
        base_url=fuzz_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    STATUSES[case.operation.label, response.status_code] += 1
    case.validate_response(response, checks=CHECKS)


def test_fuzzing_reached_both_answers_and_refusals() -> None:
    """Runs after the fuzzing above: it sent a few hundred requests, every generating operation
    answered some, the API routes refused some, and none got a server error."""
    total = sum(STATUSES.values())
    print(
        f"schemathesis: {total} requests;",
        ", ".join(
            f"{operation} {status}: {n}" for (operation, status), n in sorted(STATUSES.items())
        ),
    )
    assert total >= 200, STATUSES
    answered = {operation for (operation, status) in STATUSES if status == 200}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize"} <= answered
    assert any(status == 400 for _, status in STATUSES), STATUSES
    assert not [key for key in STATUSES if key[1] >= 500], STATUSES
