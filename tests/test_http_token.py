"""The HTTP token: weak explicit tokens refused where they are set, the token file written whole
(a full disk stops the start in one line instead of locking the front out), and `ksi http token`
never printing a token the daemon would refuse."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ksi_common import doctor, http_token
from ksi_common.errors import KsiError
from ksi_common.layout import VarLayout
from ksi_common.settings import load_settings
from tests.conftest import running_http_daemon
from tests.test_cli import TIMEOUT, Place, clean_env, force_stop, place, started_pid  # noqa: F401 (fixture)
from tests.test_disk_full import SIZE, fill

WEAK = ["", "x", "1234", "short-token-15c", "a" * 40, "sixteen chars with spaces"]


@pytest.mark.parametrize("value", WEAK)
def test_a_weak_explicit_token_is_a_settings_error_naming_the_variable(value: str, short_tmp: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSI_HTTP_TOKEN", value)
    with pytest.raises(KsiError) as caught:
        load_settings(var_dir=short_tmp / "var", http_addr="0.0.0.0:0")
    assert caught.value.code == "validation_error"
    assert list(caught.value.details["fields"]) == ["KSI_HTTP_TOKEN"]
    assert caught.value.message.startswith("invalid settings: KSI_HTTP_TOKEN: ")
    if value:
        assert value not in caught.value.message  # the value may be a secret: never echoed


def test_a_sixteen_character_token_is_taken(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KSI_HTTP_TOKEN", "0123456789abcdef")
    settings = load_settings(var_dir=short_tmp / "var", http_addr="0.0.0.0:0")
    assert settings.http_token is not None and settings.http_token.get_secret_value() == "0123456789abcdef"


@pytest.mark.parametrize("value", ["", "1234"])
def test_a_daemon_with_a_weak_token_does_not_start_and_says_so_in_one_line(value: str, place: Place) -> None:
    env = clean_env(KSI_HTTP_TOKEN=value)
    started = subprocess.run([sys.executable, "-m", "ksi_daemon", "--quiet", *place.where, "--http", "0.0.0.0:0"],
                             env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=place.root)
    assert started.returncode == 2, started.stderr
    assert started.stderr.count("\n") == 1 and "KSI_HTTP_TOKEN" in started.stderr, started.stderr
    assert not place.socket.exists()
    assert not (place.var_dir / "state" / "http_token").exists()
    shown = place.ksi("config", "--json", *place.where, env=env)
    error = json.loads(shown.stderr)["error"]
    assert shown.returncode == 1 and error["code"] == "validation_error"
    assert list(error["details"]["fields"]) == ["KSI_HTTP_TOKEN"]
    refused = place.ksi("http", "token", "--var-dir", str(place.var_dir), env=env)
    assert refused.returncode == 1 and refused.stdout == "" and "KSI_HTTP_TOKEN" in refused.stderr


@pytest.mark.parametrize("content", ["", "\n", "ksi-cut", "\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"])
async def test_an_empty_or_damaged_token_file_is_replaced_at_start(content: str, short_tmp: Path) -> None:
    layout = VarLayout(short_tmp / "var")
    layout.state_dir.mkdir(parents=True, mode=0o700)
    layout.http_token_file.write_text(content)
    layout.http_token_file.chmod(0o600)
    report = doctor.check(layout.root)
    assert [p.kind for p in report.problems if p.kind != "loose_permissions"] == ["http_token_unusable"]
    async with running_http_daemon(short_tmp, http_token=None) as served:
        assert http_token.weakness(served.token) is None
        assert layout.http_token_file.read_text() == served.token + "\n"
        assert stat.S_IMODE(layout.http_token_file.stat().st_mode) == 0o600
        async with httpx.AsyncClient(base_url=served.base_url) as http:
            reply = await http.get("/v1/models", headers={"Authorization": f"Bearer {served.token}"})
            assert reply.status_code == 200
    assert not [p for p in doctor.check(layout.root).problems if p.kind == "http_token_unusable"]
    assert sorted(p.name for p in layout.state_dir.iterdir() if p.name.startswith(".http_token")) == []


@pytest.fixture
def full_state_dir(short_tmp: Path) -> Iterator[Path]:
    """The var dir's state directory (where the token file lives) on a 4 MiB tmpfs of its own,
    so the daemon's log, elsewhere in the var dir, can still be written."""
    state = VarLayout(short_tmp / "var").state_dir
    state.mkdir(parents=True, mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0700", "tmpfs", str(state)], check=True)
    try:
        yield state
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def test_a_start_on_a_full_disk_is_one_line_and_leaves_no_made_up_token(full_state_dir: Path, short_tmp: Path,
                                                                        place: Place) -> None:
    var_dir = short_tmp / "var"
    where = ["--var-dir", str(var_dir), "--socket", str(short_tmp / "d.sock")]
    layout = VarLayout(var_dir)
    layout.http_token_file.write_text("")  # what a full disk left the last time
    filler = fill(full_state_dir, 0)
    started = subprocess.run([sys.executable, "-m", "ksi_daemon", "--quiet", *where, "--http", "127.0.0.1:0"],
                             env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=place.root)
    assert started.returncode == 2, started.stderr
    assert "Traceback" not in started.stderr
    assert started.stderr == (f"ksi-daemon: cannot write the HTTP token file {layout.http_token_file}: "
                         "No space left on device\n"), started.stderr
    assert not (short_tmp / "d.sock").exists()
    # no token is made up: not by a start, not by `ksi http token`
    printed = place.ksi("http", "token", *where)
    assert printed.returncode == 1 and printed.stdout == "", printed
    assert "storage_full" in printed.stderr and "No space left on device" in printed.stderr
    assert layout.http_token_file.read_text() == ""
    assert [f.name for f in layout.state_dir.iterdir() if f.name.startswith(".http_token")] == []
    assert not (var_dir / "logs" / "daemon" / "daemon.log").read_text().count("Traceback")
    report = doctor.check(var_dir, short_tmp / "d.sock")
    unusable = [p for p in report.problems if p.kind == "http_token_unusable"]
    assert len(unusable) == 1 and unusable[0].extra == {"empty": True}
    # space returns: the next start writes a token, and `ksi http token` prints that one
    filler.unlink()
    result = place.ksi("daemon", "start", *where, "--http", "127.0.0.1:0")
    pid = started_pid(result)
    try:
        token = place.ksi("http", "token", *where)
        assert token.returncode == 0, token.stderr
        assert token.stdout.strip() == layout.http_token_file.read_text().strip()
        health = place.ksi("send", "--json", "--socket", str(short_tmp / "d.sock"), "system:health")
        base = json.loads(health.stdout)["http"]
        ok = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {token.stdout.strip()}"})
        assert ok.status_code == 200
    finally:
        place.ksi("daemon", "stop", *where)
        force_stop(pid)


def test_ksi_http_token_never_prints_a_token_the_daemon_refuses(place: Place) -> None:
    daemon_env = clean_env(KSI_HTTP_TOKEN="the-daemon-own-token-0123")
    result = place.ksi("daemon", "start", *place.where, "--http", "127.0.0.1:0", env=daemon_env)
    pid = started_pid(result)
    try:
        # a token file from an earlier run, while this daemon uses its explicit token
        stale = http_token.load_or_create(VarLayout(place.var_dir))
        refused = place.ksi("http", "token", *place.where)
        assert refused.returncode == 1 and refused.stdout == "", refused
        assert "unauthorized" in refused.stderr and stale not in refused.stderr
        console = place.ksi("console", "--no-browser", *place.where)
        assert console.returncode == 1 and console.stdout == ""
        same = place.ksi("http", "token", *place.where, env=daemon_env)
        assert same.returncode == 0 and same.stdout.strip() == "the-daemon-own-token-0123"
    finally:
        place.ksi("daemon", "stop", *place.where)
        force_stop(pid)


async def test_without_a_daemon_ksi_http_token_writes_the_token_the_next_start_uses(short_tmp: Path) -> None:
    process = subprocess.run([sys.executable, "-m", "ksi_cli", "http", "token", "--var-dir", str(short_tmp / "var"),
                              "--socket", str(short_tmp / "d.sock")],
                             env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=short_tmp)
    assert process.returncode == 0, process.stderr
    printed = process.stdout.strip()
    assert stat.S_IMODE(os.stat(short_tmp / "var" / "state" / "http_token").st_mode) == 0o600
    async with running_http_daemon(short_tmp, http_token=None) as served:
        assert served.token == printed
