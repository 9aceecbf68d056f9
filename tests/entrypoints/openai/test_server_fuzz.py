"""Property-based fuzzing of both endpoints from the server's own /openapi.json (issue 14).

Bodies are drawn from the request schemas the server publishes (`from_schema` below: the JSON-schema subset
FastAPI emits for these models, each constraint respected), plus arbitrary JSON. Every answer must be documented
for its route, be 2xx or 4xx (never 5xx), carry OpenAI's error shape when it is an error, and leave the server
healthy. A fixed example budget and derandomized draws keep CI fast and repeatable.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.server import serving, wait_idle
from tsengine.config import EngineConfig, SpeculativeConfig

KEY, MODEL = "sk-fuzz", "tiny-llama"
AUTH = {"Authorization": f"Bearer {KEY}"}
BUDGET = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzzed(tiny_dirs, heads):
    spec = {"method": "eagle3", "adaptive": False, "model": str(heads["llama"]), "num_speculative_tokens": 3}
    config = EngineConfig.make(model=str(tiny_dirs["llama"]), max_model_len=96, block_size=4, max_num_seqs=4,
                               speculative=SpeculativeConfig.resolve(config_json=spec))
    with serving(config, MODEL, KEY, default_max_tokens=4, max_queue_len=4) as s:
        s.schema = httpx.get(s.url + "/openapi.json").json()
        yield s


def from_schema(node: dict, components: dict):
    """A hypothesis strategy for the values `node` allows ($ref, anyOf, const/enum, objects, arrays, and
    strings and numbers with their bounds). Optional properties are sometimes left out."""
    if "$ref" in node:
        return st.deferred(lambda: from_schema(components[node["$ref"].rsplit("/", 1)[1]], components))
    if "anyOf" in node:
        return st.one_of([from_schema(n, components) for n in node["anyOf"]])
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "object":
        props, required = node.get("properties", {}), set(node.get("required", []))
        return st.fixed_dictionaries({k: from_schema(v, components) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v, components) for k, v in props.items()
                                               if k not in required})
    if kind == "array":
        return st.lists(from_schema(node.get("items", {}), components), min_size=node.get("minItems", 0),
                        max_size=min(node.get("maxItems", 6), 6))
    if kind == "string":
        return st.text(min_size=node.get("minLength", 0), max_size=min(node.get("maxLength", 40), 40))
    if kind == "integer":
        return st.integers(node.get("minimum"), node.get("maximum"))
    if kind == "number":
        lo, hi = node.get("minimum"), node.get("maximum")
        return st.floats(lo, hi, exclude_min="exclusiveMinimum" in node, allow_nan=False, allow_infinity=False)\
            if "exclusiveMinimum" not in node else st.floats(node["exclusiveMinimum"], hi, exclude_min=True)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    raise AssertionError(f"schema node the fuzzer does not know: {node}")


def body_strategy(schema: dict, name: str):
    components = schema["components"]["schemas"]
    return from_schema(components[name], components)


def check(server, path: str, content: bytes) -> int:
    r = httpx.post(server.url + path, content=content, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=60)
    documented = set(server.schema["paths"][path]["post"]["responses"])
    assert str(r.status_code) in documented, (r.status_code, r.text[:300])
    assert r.status_code < 500, r.text[:300]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        body = r.json()
        assert body["choices"] and body["usage"]["completion_tokens"] >= 0
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    return r.status_code


@pytest.mark.parametrize("path, model", [("/v1/completions", "CompletionRequest"),
                                         ("/v1/chat/completions", "ChatCompletionRequest")])
def test_schema_drawn_requests_are_answered_as_documented(fuzzed, path, model):
    seen = []

    @BUDGET
    @given(body_strategy(fuzzed.schema, model))
    def run(body):
        body = {**body, "model": MODEL} if "model" in body else body  # a random model name is a plain 404
        seen.append(check(fuzzed, path, json.dumps(body).encode()))

    run()
    wait_idle(fuzzed.engine)
    assert 200 in seen and any(400 <= c < 500 for c in seen), seen  # both sides of the validator were reached


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=12)
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
          "stop_token_ids", "min_p", "stream_options", "max_completion_tokens", "ignore_eos"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_arbitrary_json_is_never_a_5xx(fuzzed, path):
    @BUDGET
    @given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=5) | JSON)
    def run(body):
        check(fuzzed, path, json.dumps(body).encode())

    run()
    wait_idle(fuzzed.engine)
