"""A bounded property-based run against the server's own /openapi.json: bodies drawn from the
documented request schemas (and arbitrary JSON besides), every reply checked against the document:
no 5xx, a documented status, and a body matching the documented schema."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import HttpDaemon

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
                    max_leaves=8)


def from_schema(schema: dict[str, Any], document: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values valid for the subset of JSON Schema pydantic writes (enough to reach the handlers)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return from_schema(document["components"]["schemas"][name], document, depth)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(option, document, depth) for option in schema[key]])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        if depth > 3:
            return st.fixed_dictionaries({k: from_schema(properties[k], document, depth + 1) for k in required})
        return st.fixed_dictionaries(
            {k: from_schema(v, document, depth + 1) for k, v in properties.items() if k in required},
            optional={k: from_schema(v, document, depth + 1) for k, v in properties.items() if k not in required})
    if kind == "array":
        items = from_schema(schema.get("items", {}), document, depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=30)
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -10) + 1 if "exclusiveMinimum" in schema else None)
        return st.integers(min_value=low, max_value=schema.get("maximum", 4096))
    if kind == "number":
        return st.floats(min_value=schema.get("minimum"), max_value=schema.get("maximum"), allow_nan=False,
                         allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON


def check_reply(document: dict[str, Any], operation: dict[str, Any],
                reply: httpx.Response) -> None:
    assert reply.status_code < 500, reply.text
    documented = operation["responses"].get(str(reply.status_code))
    assert documented is not None, f"status {reply.status_code} is not documented: {reply.text}"
    media = reply.headers.get("content-type", "").split(";")[0]
    assert media in documented["content"], f"{media} is not documented for {reply.status_code}"
    if media == "application/json":
        # the components ride along, so `#/components/...` resolves as it does in the document
        schema = {**documented["content"][media]["schema"], "components": document["components"]}
        jsonschema.Draft202012Validator(schema).validate(reply.json())
    if reply.status_code == 429:
        assert reply.headers["retry-after"].isdigit()


def sample_ids(http: httpx.Client) -> list[str]:
    first = http.post("/v1/responses", json={"input": "seed"}).json()
    return [first["id"], first["conversation"]["id"], "conv-none", "..", "x" * 200]


async def test_replies_match_the_openapi_document(http_daemon: HttpDaemon) -> None:
    def run() -> int:
        with httpx.Client(base_url=http_daemon.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {http_daemon.token}"}) as http:
            document = http.get("/openapi.json").json()
            ids = sample_ids(http)
            operations = [(path, method, operation) for path, item in document["paths"].items()
                          for method, operation in item.items() if method in ("get", "post", "delete")]
            calls = 0

            @settings(max_examples=60, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(st.data())
            def one_call(data: st.DataObject) -> None:
                nonlocal calls
                path, method, operation = data.draw(st.sampled_from(operations))
                target = re.sub(r"\{id\}", lambda _m: data.draw(st.sampled_from(ids)), path)
                kwargs: dict[str, Any] = {}
                if "requestBody" in operation:
                    schema = operation["requestBody"]["content"]["application/json"]["schema"]
                    kwargs["json"] = data.draw(from_schema(schema, document) | JSON)
                reply = http.request(method.upper(), target, **kwargs)
                calls += 1
                check_reply(document, operation, reply)

            one_call()
            return calls

    # a blocking client beside the server, which runs on this test's loop
    calls = await asyncio.to_thread(run)
    assert calls >= 60
