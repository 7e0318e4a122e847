"""A damaged calibration store never stops the daemon: a warning, every model from 1.0, and the
learning starts again; the ratios kept stay bounded however many model names requests bring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from structlog.testing import capture_logs

from ksi_common.postgres_reader import init_connection
from ksi_daemon.services.completion.calibration import MODELS_KEPT, Calibration, NoCalibrationStore
from tests.conftest import complete, connected, running_daemon
from tests.test_calibration import DENSE, count_like, dense_settings, talk

DAMAGED_FILES: dict[str, bytes] = {
    "samples that are text": orjson.dumps({"v": 1, "models": {DENSE: {"ratio": 1.6, "samples": "many"}}}),
    "samples that are a list": orjson.dumps({"v": 1, "models": {DENSE: {"ratio": 1.6, "samples": [3]}}}),
    "a ratio that is text": orjson.dumps({"v": 1, "models": {DENSE: {"ratio": "wide", "samples": 3}}}),
    "the file a list": orjson.dumps([{"ratio": 1.6}]),
    "models a list": orjson.dumps({"v": 1, "models": [DENSE]}),
    "not JSON": b'{"v": 1, "models": {',
}


def calibration_file(root: Path) -> Path:
    return root / "var" / "state" / "calibration.json"


@pytest.mark.parametrize("form", list(DAMAGED_FILES))
async def test_a_damaged_file_is_a_warning_and_learning_starts_again(short_tmp: Path, stub: Any, form: str) -> None:
    path = calibration_file(short_tmp)
    path.parent.mkdir(parents=True)
    path.write_bytes(DAMAGED_FILES[form])
    with capture_logs() as logs:
        async with running_daemon(short_tmp, **dense_settings(stub)) as daemon:
            assert daemon.completion.calibration.ratio(DENSE) == 1.0
            stub.prompt_tokens = count_like(daemon, 1.6)
            results, failures = await talk(daemon, 3, "again")
            learned = daemon.completion.calibration.ratio(DENSE)
    assert failures == [] and len(results) == 3
    assert [e for e in logs if e["event"] in ("calibration_file_unreadable", "calibration_entries_damaged")]
    assert 1.5 < learned < 1.7
    # the damaged file is replaced by what was learned since
    saved = orjson.loads(path.read_bytes())["models"][DENSE]
    assert saved["ratio"] == round(learned, 5) and saved["samples"] == 3


async def test_a_directory_in_the_files_place_is_left_alone(short_tmp: Path) -> None:
    path = calibration_file(short_tmp)
    (path / "inside").mkdir(parents=True)
    with capture_logs() as logs:
        async with running_daemon(short_tmp) as daemon, connected(daemon) as client:
            assert (await client.request("system:health"))["status"] == "healthy"
            daemon.completion.calibration.tighten("echo/default")  # something to save at stop
            assert (await complete(client, prompt="still here"))["content"]
    events = {e["event"]: e for e in logs}
    assert "calibration_file_unreadable" in events
    assert "Is a directory" in events["calibration_not_saved"]["error"]
    assert "service_stop_failed" not in events
    assert (path / "inside").is_dir()


@pytest.mark.parametrize("document", [[1.6, 3], "1.6", {DENSE: [1.6]}, {DENSE: {"ratio": 1.6, "samples": "x"}}])
async def test_a_damaged_postgres_document_is_a_warning(short_tmp: Path, pg_url: str, document: Any) -> None:
    async with running_daemon(short_tmp, storage="postgres", database_url=pg_url):
        pass  # makes the schema
    conn = await asyncpg.connect(pg_url)
    try:
        await init_connection(conn)
        await conn.execute("INSERT INTO ksi_calibration (ratios) VALUES ($1::json) "
                           "ON CONFLICT (id) DO UPDATE SET ratios = EXCLUDED.ratios", document)
    finally:
        await conn.close()
    with capture_logs() as logs:
        async with running_daemon(short_tmp, storage="postgres", database_url=pg_url) as daemon, \
                connected(daemon) as client:
            assert daemon.completion.calibration.ratio(DENSE) == 1.0
            assert (await complete(client, prompt="still here"))["content"]
    assert [e for e in logs if e["event"] in ("calibration_document_unreadable", "calibration_entries_damaged")]


async def test_the_models_kept_are_bounded_and_the_most_recently_taught() -> None:
    calibration = Calibration(NoCalibrationStore())
    for n in range(MODELS_KEPT + 50):
        calibration.observe(f"openai/model-{n}", 100, 150)
    calibration.observe("openai/model-0", 100, 200)  # dropped, then taught again: the newest
    kept = calibration.snapshot()
    assert len(kept) == MODELS_KEPT
    assert "openai/model-0" in kept and "openai/model-1" not in kept and f"openai/model-{MODELS_KEPT + 49}" in kept


async def test_a_file_with_too_many_models_keeps_the_last_ones(short_tmp: Path) -> None:
    path = calibration_file(short_tmp)
    path.parent.mkdir(parents=True)
    models = {f"openai/model-{n}": {"ratio": 1.5, "samples": 2, "tightened": 0} for n in range(MODELS_KEPT * 4)}
    path.write_bytes(orjson.dumps({"v": 1, "models": models}))
    async with running_daemon(short_tmp) as daemon:
        kept = daemon.completion.calibration.snapshot()
    assert list(kept) == list(models)[-MODELS_KEPT:]
    assert len(orjson.loads(path.read_bytes())["models"]) == MODELS_KEPT
