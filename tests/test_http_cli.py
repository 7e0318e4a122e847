"""`ksi daemon start --http` and `ksi http token`, as real processes."""

from __future__ import annotations

import re
import socket

import httpx

from tests.test_cli import Place, clean_env, force_stop, place, started_pid  # noqa: F401 (fixture)


def test_daemon_start_with_http_and_the_printed_token(place: Place) -> None:
    result = place.ksi("daemon", "start", *place.where, "--http", "127.0.0.1:0")
    pid = started_pid(result)
    try:
        match = re.search(r"http://127\.0\.0\.1:(\d+)", result.stdout)
        assert match, result.stdout
        token = place.ksi("http", "token", "--var-dir", str(place.var_dir))
        assert token.returncode == 0, token.stderr
        printed = token.stdout.strip()
        assert printed == (place.var_dir / "state" / "http_token").read_text().strip()
        base = match.group(0)
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {printed}"}).status_code == 200
        assert httpx.get(f"{base}/v1/models").status_code == 401
    finally:
        place.ksi("daemon", "stop", *place.where)
        force_stop(pid)


def test_explicit_token_wins_and_a_public_bind_without_one_is_refused(place: Place) -> None:
    env = clean_env(KSI_HTTP_TOKEN="explicit-token-123456")
    assert place.ksi("http", "token", "--var-dir", str(place.var_dir), env=env).stdout.strip() == "explicit-token-123456"
    refused = place.ksi("daemon", "start", *place.where, "--http", "0.0.0.0:0")
    assert refused.returncode != 0
    assert "explicit token" in refused.stderr + refused.stdout
    assert not (place.var_dir / "state" / "http_token").exists()


def test_a_taken_http_port_is_a_clear_error_and_leaves_no_socket(place: Place) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = place.ksi("daemon", "start", *place.where, "--http", f"127.0.0.1:{port}")
    assert refused.returncode == 2  # the daemon's own exit code, as docs/troubleshooting.md says
    said = refused.stderr + refused.stdout
    assert "exited with code 2" in said and f"cannot serve HTTP on http://127.0.0.1:{port}" in said
    assert "Traceback" not in said
    assert not place.socket.exists()  # the socket opens last: nobody was told the daemon had started
    result = place.ksi("daemon", "start", *place.where, "--http", "127.0.0.1:0")  # a free port: it starts
    pid = started_pid(result)
    try:
        assert re.search(r"http://127\.0\.0\.1:(\d+)", result.stdout), result.stdout
    finally:
        place.ksi("daemon", "stop", *place.where)
        force_stop(pid)
