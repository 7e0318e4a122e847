"""A key/value database DSN (`host=db password=...`) is shown with its password masked, as a URL
is: in `ksi config`, in the line a failed start prints, and in the daemon's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ksi_common.dburl import mask_url, mask_urls_in, url_password
from tests.test_cli_ask import ksi, where

SECRET = "s3cret-pw"


@pytest.mark.parametrize(("dsn", "shown", "password"), [
    (f"host=db port=5432 user=ksi password={SECRET} dbname=ksi",
     "host=db port=5432 user=ksi password=*** dbname=ksi", SECRET),
    (f"password={SECRET} host=db", "password=*** host=db", SECRET),
    (f"host=db password = {SECRET} dbname=ksi", "host=db password = *** dbname=ksi", SECRET),
    (f"host=db PASSWORD={SECRET}", "host=db PASSWORD=***", SECRET),
    ("host=db password='two words' dbname=ksi", "host=db password=*** dbname=ksi", "two words"),
    (r"host=db password='it\'s \\ here' dbname=ksi", "host=db password=*** dbname=ksi", "it's \\ here"),
    ("host=db password='' dbname=ksi", "host=db password=*** dbname=ksi", None),
    ("host=db user=ksi dbname=ksi", "host=db user=ksi dbname=ksi", None),
    ("host=db user=ksi passwordless=x", "host=db user=ksi passwordless=x", None),
])
def test_a_key_value_dsn_is_masked(dsn: str, shown: str, password: str | None) -> None:
    assert mask_url(dsn) == shown
    assert mask_urls_in(f'cannot connect with "{dsn}" now') == f'cannot connect with "{shown}" now'
    assert url_password(dsn) == password


def test_urls_are_masked_as_before() -> None:
    url = f"postgresql://ksi:{SECRET}@db/ksi?sslmode=require&password={SECRET}"
    assert mask_url(url) == "postgresql://ksi:***@db/ksi?sslmode=require&password=***"
    assert SECRET not in mask_urls_in(f"failed: {url}")


def no_secret_under(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


async def test_ksi_config_masks_a_key_value_dsn(short_tmp: Path) -> None:
    dsn = f"host=127.0.0.1 port=1 user=ksi password='{SECRET} x' dbname=ksi"
    run = await ksi(short_tmp, "config", *where(short_tmp), env={"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": dsn})
    assert run.code == 0, run.err
    assert json.loads(run.out)["database_url"] == "host=127.0.0.1 port=1 user=ksi password=*** dbname=ksi"
    assert SECRET not in run.out + run.err


async def test_a_failed_start_shows_the_dsn_masked(short_tmp: Path) -> None:
    dsn = f"host=127.0.0.1 port=1 user=ksi password={SECRET} dbname=ksi"
    run = await ksi(short_tmp, "daemon", "start", *where(short_tmp),
                    env={"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": dsn})
    assert run.code != 0
    assert "cannot connect to the database at host=127.0.0.1 port=1 user=ksi password=*** dbname=ksi" in run.err
    assert SECRET not in run.out + run.err
    no_secret_under(short_tmp / "var")
