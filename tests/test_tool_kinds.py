"""The client-run tool kinds on a provider that takes only functions, both ways: the functions it is
given, a call it makes shown in the client's form, and that form (as a client resends it) read back
as the same call, so a resent history matches the stored one (the same canonical item)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ksi_common.items import canonical_item
from ksi_daemon.providers.tool_kinds import (
    CUSTOM_PARAMETERS,
    as_functions,
    catalog,
    client_call,
    function_form,
    provider_names,
    streams_as_function,
)

LOOKUP: dict[str, Any] = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
TOOLS: list[dict[str, Any]] = [
    LOOKUP, {"type": "custom", "name": "apply_patch", "description": "patch",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "namespace", "name": "crm", "tools": [{**LOOKUP, "name": "find"}, {"type": "custom", "name": "note"}]},
    {"type": "local_shell"}, {"type": "shell"}]


def call(name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
    return {"type": "function_call", "call_id": "c1", "name": name, "arguments": text}


def test_every_tool_is_a_function_for_the_provider() -> None:
    functions = as_functions(TOOLS)
    assert [f["name"] for f in functions] == ["lookup", "apply_patch", "find", "note", "local_shell", "shell"]
    assert functions[1]["parameters"] == CUSTOM_PARAMETERS and "start: /.+/" in functions[1]["description"]
    assert functions[0] is LOOKUP


@pytest.mark.parametrize(("made", "shown"), [
    (call("apply_patch", {"input": "*** patch"}), {"type": "custom_tool_call", "name": "apply_patch", "input": "*** patch"}),
    (call("apply_patch", "not json"), {"type": "custom_tool_call", "name": "apply_patch", "input": "not json"}),
    (call("find", {"q": "Ada"}), {"type": "function_call", "name": "find", "arguments": '{"q":"Ada"}', "namespace": "crm"}),
    (call("note", {"input": "hi"}), {"type": "custom_tool_call", "name": "note", "input": "hi", "namespace": "crm"}),
    (call("local_shell", {"command": ["ls"]}), {"type": "local_shell_call", "action": {"type": "exec", "env": {}, "command": ["ls"]}}),
    (call("shell", {"commands": ["pwd"], "timeout_ms": 5}), {"type": "shell_call", "action": {"commands": ["pwd"], "timeout_ms": 5}}),
])
def test_a_call_is_shown_in_the_clients_form_and_read_back_as_the_same_call(
        made: dict[str, Any], shown: dict[str, Any]) -> None:
    kinds = catalog(TOOLS)
    kept = client_call(made, kinds)
    assert kept["client_item"] == {"call_id": "c1", **shown}
    assert not streams_as_function(made["name"], kinds)
    # what a client resends: the shown item, with the fields it adds (an id, a status, empty ones)
    resent = {**kept["client_item"], "id": "fc_x", "status": "completed"}
    if resent["type"] == "local_shell_call":
        resent["action"] = {**resent["action"], "timeout_ms": None, "working_directory": None}
    assert canonical_item(function_form(resent)) == canonical_item(kept)
    assert orjson.loads(kept["arguments"])  # JSON for the provider it is replayed to


def test_a_plain_function_call_stays_as_it_is() -> None:
    kinds = catalog(TOOLS)
    made = call("lookup", {})
    assert client_call(made, kinds) is made and streams_as_function("lookup", kinds)
    assert streams_as_function("unknown", kinds)


def test_a_name_two_namespaces_share_is_qualified_for_the_provider_only() -> None:
    tools = [*TOOLS, {"type": "namespace", "name": "billing", "tools": [{**LOOKUP, "name": "find"}]}]
    assert [f["name"] for f in as_functions(tools)] == [
        "lookup", "apply_patch", "crm__find", "note", "local_shell", "shell", "billing__find"]
    kinds = catalog(tools)
    kept = client_call(call("billing__find", {"q": "x"}), kinds)
    assert (kept["client_item"]["name"], kept["client_item"]["namespace"]) == ("find", "billing")
    resent = {**kept["client_item"], "id": "fc_1"}
    assert function_form(resent, provider_names(tools))["name"] == "billing__find"
