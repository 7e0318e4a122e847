"""A typo gets a suggestion: an unknown event name (requested, or subscribed to with `ksi
monitor -e`), a namespace (`ksi discover agentt`, `ksi monitor -n`), a misspelt field of an
event's data. The real `ksi` CLI against an in-process daemon, and the socket itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ksi_common.errors import KsiError
from tests.conftest import connected, running_daemon
from tests.test_cli_ask import ksi, where


async def test_the_cli_suggests_the_event_or_namespace_meant(short_tmp: Path) -> None:
    async with running_daemon(short_tmp):
        monitor = await ksi(short_tmp, "monitor", "-e", "completion:reslt", *where(short_tmp))
        spaces = await ksi(short_tmp, "monitor", "-n", "agentt", *where(short_tmp))
        discover = await ksi(short_tmp, "discover", "agentt", *where(short_tmp))
        field = await ksi(short_tmp, "send", *where(short_tmp)[2:], "completion:async", "--promt", "hi")
        event = await ksi(short_tmp, "send", *where(short_tmp)[2:], "system:helth")
    for run in (monitor, spaces, discover, field, event):
        assert run.code == 1, run.err
        assert "Traceback" not in run.err
    assert json.loads(monitor.err)["error"]["code"] == "unknown_event"
    assert "did you mean completion:result" in monitor.err
    assert "did you mean agent:*?" in spaces.err
    assert "no events in the namespace 'agentt'; did you mean agent?" in discover.err
    assert json.loads(field.err)["error"]["code"] == "validation_error"
    assert "promt: Extra inputs are not permitted; did you mean prompt?" in field.err
    assert "did you mean system:health" in event.err


async def test_known_events_and_namespaces_are_still_subscribed(short_tmp: Path) -> None:
    async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
        # names only ever emitted count as known, as do namespaces and every requested event
        for patterns in (["completion:result", "completion:chunk", "conversation:changed"], ["agent:*"], ["*"],
                         ["system:health"], ["conversation:summarised"]):
            reply = await client.request("monitor:subscribe", {"patterns": patterns})
            assert reply["status"] == "subscribed"
        with pytest.raises(KsiError) as caught:
            await client.request("monitor:subscribe", {"patterns": ["completion:*", "completion:reslt"]})
        assert caught.value.code == "unknown_event"
        assert caught.value.details["similar"][0] == "completion:result"
        with pytest.raises(KsiError) as nested:
            await client.request("completion:async", {"prompt": "hi", "modle": "echo/demo"})
        assert nested.value.code == "validation_error"
        assert nested.value.details["fields"]["modle"].endswith("did you mean model?")
        listed = await client.request("conversation:list", {})
    assert listed["total"] == 0  # a refused request wrote nothing
