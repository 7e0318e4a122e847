"""Numbers have upper bounds where they enter (events, settings, the CLI), NaN never travels as
null, and a NUL byte in a path is a validation_error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from ksi_cli.main import cli
from ksi_common.client import KsiClient
from ksi_common.errors import KsiError
from ksi_common.settings import Settings
from ksi_daemon.daemon import Daemon
from tests.conftest import complete


async def refused(client: KsiClient, event: str, data: dict[str, Any]) -> KsiError:
    with pytest.raises(KsiError) as caught:
        await client.request(event, data)
    return caught.value


@pytest.mark.parametrize(("event", "data", "field"), [
    ("conversation:update", {"conversation_id": "c", "ttl": 1e12}, "ttl"),
    ("conversation:update", {"conversation_id": "c", "turn_cap": 10**13}, "turn_cap"),
    ("completion:async", {"conversation_id": "c", "prompt": "hi", "timeout": 1e12}, "timeout"),
    ("completion:async", {"conversation_id": "c", "prompt": "hi", "max_tokens": 10**15}, "max_tokens"),
    ("completion:wait", {"request_id": "req-x", "timeout": 1e12}, "timeout"),
    ("agent:send_message", {"agent_id": "a", "message": "hi", "wait": 1e12}, "wait"),
    ("completion:async", {"conversation_id": "c", "prompt": "hi", "files": ["/tmp/a\x00/etc/passwd"]}, "files.0"),
])
async def test_out_of_range_values_are_refused(daemon: Daemon, client: KsiClient, event: str,
                                               data: dict[str, Any], field: str) -> None:
    await complete(client, prompt="first", model="echo/x", conversation_id="c", create=True)
    await client.request("agent:spawn", {"agent_id": "a", "model": "echo/x"})
    meta_before = daemon.layout.meta_file("c").read_bytes()
    error = await refused(client, event, data)
    assert error.code == "validation_error"
    assert field in error.details["fields"]
    assert daemon.layout.meta_file("c").read_bytes() == meta_before
    listing = await client.request("conversation:list", {})
    assert {c["conversation_id"] for c in listing["conversations"]} >= {"c", "a"}


async def test_a_ttl_saved_before_the_bound_does_not_break_listing(daemon: Daemon, client: KsiClient) -> None:
    await complete(client, prompt="first", model="echo/x", conversation_id="old", create=True)
    path = daemon.layout.meta_file("old")
    meta = orjson.loads(path.read_bytes())
    path.write_bytes(orjson.dumps({**meta, "ttl": 1e12}))
    daemon.cache.forget("old")
    listing = await client.request("conversation:list", {})
    assert [c["conversation_id"] for c in listing["conversations"]] == ["old"]
    assert listing["conversations"][0]["expires_at"] is None
    result = CliRunner().invoke(cli, ["conversations", "--json", "--var-dir", str(daemon.layout.root)])
    assert result.exit_code == 0, result.output
    assert "old" in result.output


@pytest.mark.parametrize("args", [
    ["--ttl", "NaN"], ["--ttl", "Infinity"], ["--ttl", "-Infinity"], ["--ttl", "1e400"],
    ["--turn-cap", "1" + "0" * 30], ["--ttl=NaN"],
])
def test_cli_refuses_numbers_json_cannot_carry(short_tmp: Path, args: list[str]) -> None:
    # no daemon listens: a payload that were sent would exit 3 (unreachable), a refused one exits 2
    result = CliRunner().invoke(cli, ["send", "--socket", str(short_tmp / "none.sock"),
                                      "conversation:update", "--conversation-id", "c", *args])
    assert result.exit_code == 2, result.output


@pytest.mark.parametrize("args", [
    ["--data", '{"conversation_id": "c", "ttl": NaN}'],
    ["--timeout", "nan"], ["--timeout", "inf"], ["--timeout", "-1"], ["--timeout", "1e30"],
])
def test_cli_refuses_bad_payloads_and_timeouts(short_tmp: Path, args: list[str]) -> None:
    result = CliRunner().invoke(cli, ["send", "--socket", str(short_tmp / "none.sock"), *args,
                                      "conversation:update", "--conversation-id", "c"])
    assert result.exit_code == 2, result.output


def test_cli_still_sends_ordinary_numbers(short_tmp: Path) -> None:
    result = CliRunner().invoke(cli, ["send", "--socket", str(short_tmp / "none.sock"), "--timeout", "2.5",
                                      "conversation:update", "--conversation-id", "c", "--ttl", "3600"])
    assert result.exit_code == 3, result.output


@pytest.mark.parametrize("values", [
    {"default_ttl": float("inf")}, {"default_ttl": 1e12}, {"request_timeout": float("nan")},
    {"request_timeout": 1e12},
])
def test_settings_have_bounds(values: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Settings(_env_file=None, **values)


def test_settings_bounds_hold_for_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSI_DEFAULT_TTL", "inf")
    with pytest.raises(ValidationError):
        Settings(_env_file=None)
    monkeypatch.setenv("KSI_DEFAULT_TTL", json.dumps(86400))
    assert Settings(_env_file=None).default_ttl == 86400
