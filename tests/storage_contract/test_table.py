"""The table of backends itself: every entry's reader and storage can be built, the settings take
exactly its names, and the reader sees what the storage wrote (the `ksi` commands read that way)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ksi_common.errors import KsiError
from ksi_common.reading import open_reader
from ksi_common.settings import Settings
from ksi_common.storage_backends import STORAGE_NAMES, Backend
from ksi_daemon.storage.models import ConversationMeta
from ksi_daemon.storage.ports import Storage
from tests.conftest import make_settings
from tests.storage_contract.conftest import entry, response_lines


async def test_the_reader_reads_what_the_storage_wrote(storage: Storage, storage_settings: Settings,
                                                       contract_backend: Backend, backend_url: str | None) -> None:
    await storage.conversations.create(ConversationMeta(conversation_id="c", title="t"))
    e = entry(1)
    await storage.conversations.append_exchange("c", e, response=response_lines(e, "c"))
    reader = open_reader(contract_backend.name, storage_settings.layout, backend_url)
    try:
        assert await reader.conversation_ids() == ["c"]
        assert await reader.entries("c") == [e]
        [meta] = await reader.metas(["c"])
        assert meta is not None and meta["title"] == "t"
    finally:
        await reader.aclose()


def test_the_settings_take_the_tables_names_and_no_other(short_tmp: Path) -> None:
    assert Settings.model_fields["storage"].default == STORAGE_NAMES[0]
    with pytest.raises((KsiError, ValueError)):
        make_settings(short_tmp, storage="sqlite")
    with pytest.raises(ValueError, match=f"unknown storage 'sqlite'; one of {', '.join(STORAGE_NAMES)}"):
        open_reader("sqlite", make_settings(short_tmp).layout)


async def test_a_backend_says_what_the_table_declares(storage: Storage, contract_backend: Backend) -> None:
    assert storage.daemons.shared is contract_backend.shared
    assert storage.conversations.shared is contract_backend.shared
