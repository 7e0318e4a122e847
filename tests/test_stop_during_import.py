"""`ksi daemon stop` right after a start does not wait for litellm's background import: the daemon
closes everything and exits while the import is still under way (the real CLI and daemon)."""

from __future__ import annotations

import json

from tests.test_cli import Place, clean_env, force_stop, place, started_pid, wait_gone  # noqa: F401  (fixture)


def test_a_stop_during_the_litellm_import_does_not_wait_for_it(place: Place) -> None:  # noqa: F811
    preloading = {k: v for k, v in clean_env().items() if k != "KSI_LITELLM_PRELOAD"}
    pid = started_pid(place.ksi("daemon", "start", *place.where, env=preloading))
    try:
        assert (place.health() or {}).get("litellm_loaded") is False  # the import runs now
        stopped = place.ksi("daemon", "stop", *place.where, env=preloading)
        assert stopped.returncode == 0 and f"daemon stopped (pid {pid})" in stopped.stdout
        assert wait_gone(pid)
    finally:
        force_stop(pid)
    events = [json.loads(line)["event"] for line in place.var_dir.joinpath("logs", "daemon", "daemon.log")
              .read_text().splitlines()]
    assert "daemon_stopped" in events  # a whole shutdown: work drained, files flushed and closed
    assert "litellm_loaded" not in events  # and the process did not live on until the import ended
    assert not (place.var_dir / "run" / "daemon.pid").exists()
    assert "Traceback" not in (place.var_dir / "logs" / "daemon" / "stderr.log").read_text()
    again = place.ksi("daemon", "start", *place.where)  # the lock was released
    started_pid(again)
    place.ksi("daemon", "stop", *place.where)
