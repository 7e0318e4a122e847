"""An exchange's token counts are the provider's (its reply's usage), so they add up to the
conversation's totals; KSI's own count of what the exchange costs in a later turn's history is
shown apart (`history_tokens`, the index's numbers) and survives an export and import."""

from __future__ import annotations

from typing import Any

import pytest

from ksi_common.records import read_index
from tests.conftest import complete

pytestmark = pytest.mark.backends


async def test_exchange_counts_agree_with_the_replies_usage(daemon: Any, client: Any) -> None:
    usages = [(await complete(client, model="echo/x", prompt=prompt, conversation_id="tok", create=n == 0))["usage"]
              for n, prompt in enumerate(("hello there friend", "and a second, longer question now", "third"))]
    shown = await client.request("conversation:show", {"conversation_id": "tok"})
    exchanges = shown["exchanges"]
    assert [(x["tokens_in"], x["tokens_out"]) for x in exchanges] == \
        [(u["prompt_tokens"], u["completion_tokens"]) for u in usages]
    assert [x["reply"]["usage"] for x in exchanges] == usages
    assert shown["conversation"]["tokens_in"] == sum(x["tokens_in"] for x in exchanges)
    assert shown["conversation"]["tokens_out"] == sum(x["tokens_out"] for x in exchanges)
    history = [(x["history_tokens"]["in"], x["history_tokens"]["out"]) for x in exchanges]
    assert history != [(x["tokens_in"], x["tokens_out"]) for x in exchanges]  # two different counts
    if daemon.settings.storage == "jsonl":
        assert history == [(e.tokens_in, e.tokens_out) for e in read_index(daemon.layout.index_file("tok"))]
    exported = await client.request("conversation:export", {"conversation_id": "tok", "format": "json"})
    imported = await client.request("conversation:import", {"data": exported["content"], "new_id": "tok-copy"})
    again = (await client.request("conversation:show", {"conversation_id": imported["conversation_id"]}))["exchanges"]
    assert [(x["history_tokens"]["in"], x["history_tokens"]["out"]) for x in again] == history
    assert [(x["tokens_in"], x["tokens_out"]) for x in again] == [(x["tokens_in"], x["tokens_out"]) for x in exchanges]
