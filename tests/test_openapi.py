"""schemathesis against the server's own /openapi.json: generated requests (valid and not) to every route,
and every response checked against the document: no 5xx, only documented status codes, the documented
content type, bodies that match their schema (OpenAI's error body for every error), a 405's Allow header.

The server is the real app on loopback over the fake engine (tests/fake_engine.py), so hundreds of cases
take seconds; what the real engine refuses beyond that is tested in test_server_abuse.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from fake_engine import FakeEngine, serve_in_thread
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from pagedllm.engine.async_engine import AsyncEngine

API_KEY = "openapi-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 40  # per route; about 500 cases in all
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    engine = AsyncEngine(FakeEngine(max_model_len=256, num_kv_blocks=1024, max_num_seqs=8))
    with serve_in_thread(engine, api_key=API_KEY) as (base_url, _):
        yield base_url


@pytest.fixture(scope="module")
def api_schema(served: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(served + "/openapi.json", headers=AUTH)


def test_every_response_matches_the_document(api_schema: schemathesis.BaseSchema) -> None:
    # Cases are drawn per operation with hypothesis directly: schemathesis' own pytest parametrization
    # does not run under pytest 9.
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health", "/metrics"} <= {
        op.path for op in operations
    }
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,  # the same cases every run
        )
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=30)

        check()
