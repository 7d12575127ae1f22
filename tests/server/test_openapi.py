"""The OpenAPI document tells the truth: errors are 400s (never 422) in OpenAI's shape,
/metrics is text, /health answers llama-server's `{"status": "ok"}`, and empty prompts and
message lists are refused by the schema, as the server refuses them."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def openapi(server_url):
    return httpx.get(server_url + "/openapi.json").json()


def _operations(document):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


def test_no_operation_promises_422(openapi):
    promised = [(path, method) for path, method, op in _operations(openapi) if "422" in op["responses"]]
    assert promised == []
    assert "HTTPValidationError" not in openapi.get("components", {}).get("schemas", {})


def test_every_post_documents_400_in_openai_error_shape(openapi):
    schemas = openapi["components"]["schemas"]
    for path, method, op in _operations(openapi):
        if method != "post" or path.startswith("/v1/messages"):  # Anthropic's shape (test_anthropic_messages.py)
            continue
        body = op["responses"]["400"]["content"]["application/json"]["schema"]
        error = schemas[body["$ref"].rsplit("/", 1)[1]]
        detail = schemas[error["properties"]["error"]["$ref"].rsplit("/", 1)[1]]
        assert set(detail["properties"]) == {"message", "type", "param", "code"}, path


def test_every_route_with_a_body_documents_the_body_limits(openapi):
    """408 (a stalled body) and 413 (too large) come from the body-limit middleware, in OpenAI's shape."""
    for path, method, op in _operations(openapi):
        if "requestBody" not in op:
            continue
        for status in ("408", "413"):
            body = op["responses"][status]["content"]["application/json"]["schema"]
            assert body["$ref"].endswith("/ErrorResponse"), (path, status)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generation_routes_document_json_and_event_streams(openapi, path):
    content = openapi["paths"][path]["post"]["responses"]["200"]["content"]
    assert set(content) == {"application/json", "text/event-stream"}


def test_metrics_is_documented_and_served_as_text(openapi, server_url):
    content = openapi["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]
    assert httpx.get(server_url + "/metrics").headers["content-type"].startswith("text/plain")


def test_health_is_documented_and_served_as_json_status_ok(openapi, server_url):
    responses = openapi["paths"]["/health"]["get"]["responses"]
    schema = responses["200"]["content"]["application/json"]["schema"]
    assert schema["properties"]["status"]["enum"] == ["ok"]
    assert "application/json" in responses["503"]["content"]
    response = httpx.get(server_url + "/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def _alternatives(schema):
    return schema.get("anyOf", [schema])


def test_empty_prompts_and_message_lists_are_outside_the_schema(openapi):
    schemas = openapi["components"]["schemas"]
    for alternative in _alternatives(schemas["CompletionRequest"]["properties"]["prompt"]):
        if alternative["type"] == "string":
            assert alternative["minLength"] == 1
        else:
            assert alternative["minItems"] == 1
            item = alternative["items"]
            if item.get("type") in ("string", "array"):
                assert item.get("minLength", item.get("minItems")) == 1
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
