"""Fuzzing the fields the integrity rules bound: numbers past their bounds, provider options that
would pick a host or credentials, and damaged conversation exports. Each must be refused with
validation_error exactly (or, for an export that is still well-formed, imported whole); a refused
import writes nothing. The strategies are shared with scripts/fuzz_socket.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ksi_common.limits import MAX_TIMEOUT, MAX_TOKENS, MAX_TTL, MAX_TURN_CAP
from ksi_daemon.providers.options import ROUTING_OPTIONS
from tests.test_fuzz import (
    FUZZ_SETTINGS,
    OFFLINE_MODEL,
    FuzzBox,
    FuzzFailure,
    assert_alive,
    box,
    json_values,
    probe_event,
)

__all__ = ["box"]  # the shared fuzzing daemon of tests/test_fuzz.py, module scoped here too


def past(bound: float, integral: bool = False) -> st.SearchStrategy[Any]:
    if integral:
        return st.integers(min_value=int(bound) + 1, max_value=2**63 - 1)
    return st.one_of(st.floats(min_value=bound * 1.0000001, max_value=1e300, allow_infinity=False),
                     st.integers(min_value=int(bound) + 1, max_value=2**63 - 1))


@st.composite
def bounded_payloads(draw: st.DrawFn) -> tuple[str, dict[str, Any], str]:
    """An event, its data with one value past its bound (or a routing option), and the field named."""
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return "conversation:update", {"conversation_id": "fz", "ttl": draw(past(MAX_TTL))}, "ttl"
    if kind == 1:
        return "conversation:update", {"conversation_id": "fz", "turn_cap": draw(past(MAX_TURN_CAP, True))}, "turn_cap"
    if kind == 2:
        return ("completion:async", {"prompt": "p", "model": OFFLINE_MODEL, "timeout": draw(past(MAX_TIMEOUT))},
                "timeout")
    if kind == 3:
        return ("completion:async", {"prompt": "p", "model": OFFLINE_MODEL,
                                     "max_tokens": draw(past(MAX_TOKENS, True))}, "max_tokens")
    if kind == 4:
        return "completion:wait", {"request_id": "req-x", "timeout": draw(past(MAX_TIMEOUT))}, "timeout"
    if kind == 5:
        path = draw(st.text(max_size=10)) + "\x00" + draw(st.text(max_size=10))
        return "completion:async", {"prompt": "p", "model": OFFLINE_MODEL, "files": ["/" + path]}, "files.0"
    name = draw(st.one_of(
        st.sampled_from(sorted(ROUTING_OPTIONS - {"api_key", "api_base"})),
        st.builds(lambda a, b: a + b, st.sampled_from(["aws_", "vertex_", "azure_"]),
                  st.sampled_from(["region_name", "api_base", "base_url", "token", "x_url"]))))
    return ("completion:async", {"prompt": "p", "model": OFFLINE_MODEL, "options": {name: draw(json_values)}},
            f"options.{name}")


def valid_export() -> dict[str, Any]:
    exchanges = [{"inputs": [{"type": "user", "content": f"q{k}", "ts": "2026-01-02T03:04:05Z",
                              "files": [{"path": "/tmp/ref.txt", "size": 3}]}],
                  "reply": {"content": f"a{k}", "model": "echo/x", "usage": {"prompt_tokens": 2},
                            "cost": 0.0, "duration_ms": 5.0, "ts": "2026-01-02T03:04:06Z"},
                  "model": "echo/x", "ts": "2026-01-02T03:04:05Z", "tokens_in": 3, "tokens_out": 2}
                 for k in range(3)]
    return {"v": 1, "format": "ksi.conversation", "conversation": {"title": "t", "tags": ["a"], "ttl": 60.0},
            "exchanges": exchanges}


def _places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path] if path else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += _places(child, (*path, key))
    elif isinstance(value, list):
        for position, child in enumerate(value):
            found += _places(child, (*path, position))
    return found


@st.composite
def damaged_imports(draw: st.DrawFn) -> dict[str, Any]:
    """A valid export with one value anywhere in it replaced by any JSON value, or removed."""
    document = valid_export()
    where = draw(st.sampled_from([p for p in _places(document) if p[0] in ("conversation", "exchanges")]))
    parent = document
    for step in where[:-1]:
        parent = parent[step]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[where[-1]]
    else:
        parent[where[-1]] = draw(st.one_of(json_values, st.sampled_from([-1, -10**9, 10**30, 1e300, -0.5,
                                                                        "not a time", "\x00", None])))
    return document


async def probe_bounded(box: FuzzBox, event: str, data: dict[str, Any], field: str) -> Any:
    result = await probe_event(box.socket, event, data)
    reply = next(f for f in result.frames if f.get("correlation_id") == "fuzz-1")
    if "error" not in reply or reply["error"]["code"] != "validation_error" \
            or field not in reply["error"]["details"].get("fields", {}):
        raise FuzzFailure(f"{event} with {field} out of bounds was not refused as validation_error: {reply!r}")
    return result


def var_files(box: FuzzBox) -> set[Path]:
    layout = box.daemon.layout
    return {p for root in (layout.conversations_dir, layout.conversation_meta_dir) if root.exists()
            for p in root.iterdir()}


# a damaged document's codes: a malformed field, or an item fault named by its own code
IMPORT_REFUSALS = {"validation_error", "unknown_item_type", "unknown_call_id", "duplicate_call_id", "arguments_not_json"}


async def probe_import(box: FuzzBox, document: dict[str, Any]) -> Any:
    before = var_files(box)
    result = await probe_event(box.socket, "conversation:import", {"data": copy.deepcopy(document)})
    reply = next(f for f in result.frames if f.get("correlation_id") == "fuzz-1")
    if "error" in reply:
        if reply["error"]["code"] not in IMPORT_REFUSALS:
            raise FuzzFailure(f"a damaged import was answered {reply['error']['code']}: {reply!r}")
        if var_files(box) != before:
            raise FuzzFailure(f"a refused import wrote {sorted(map(str, var_files(box) - before))}")
        return result
    # accepted: whole, and every number it stored within bounds
    conversation_id = reply["data"]["conversation_id"]
    shown = await probe_event(box.socket, "conversation:show", {"conversation_id": conversation_id})
    data = next(f for f in shown.frames if f.get("correlation_id") == "fuzz-1")["data"]
    if len(data["exchanges"]) != reply["data"]["exchanges"]:
        raise FuzzFailure(f"import said {reply['data']['exchanges']} exchanges, stored {len(data['exchanges'])}")
    for exchange in data["exchanges"]:
        usage = (exchange.get("reply") or {}).get("usage") or {}
        numbers = [exchange["tokens_in"], exchange["tokens_out"], *(v for v in usage.values() if v is not None)]
        if any(not isinstance(n, int) or not 0 <= n <= MAX_TOKENS for n in numbers):
            raise FuzzFailure(f"an import stored token counts out of range: {numbers} from {document!r}"[:600])
    return result


@settings(max_examples=40, **FUZZ_SETTINGS)
@given(case=bounded_payloads())
async def test_values_past_their_bounds_are_validation_errors(box: FuzzBox, case: tuple[str, dict[str, Any], str]
                                                              ) -> None:
    event, data, field = case
    await probe_bounded(box, event, data, field)
    await assert_alive(box.socket)


@settings(max_examples=40, **FUZZ_SETTINGS)
@given(document=damaged_imports())
async def test_damaged_imports_are_refused_whole_or_imported(box: FuzzBox, document: dict[str, Any]) -> None:
    await probe_import(box, document)
    await assert_alive(box.socket)


def test_the_strategies_hit_their_targets() -> None:
    """The damage reaches every part of the document (not only the top level)."""
    places = _places(valid_export())
    assert ("exchanges", 2, "reply", "usage", "prompt_tokens") in places
    assert ("exchanges", 0, "inputs", 0, "files", 0, "path") in places
