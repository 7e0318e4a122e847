"""The daemon's log file on a full disk: records are dropped with one line on stderr when the
failures begin and one when writing works again, never logging's traceback per record."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ksi_daemon.logs import DaemonLogFile
from tests.test_disk_full import fill, small_fs  # noqa: F401 (a fixture)


def test_a_full_disk_costs_one_line_on_stderr_and_writing_resumes(small_fs: Path,  # noqa: F811
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    log_file = small_fs / "daemon.log"
    handler = DaemonLogFile(log_file, max_bytes=1 << 30, backups=1)
    logger = logging.Logger("ksi.test.full-disk")
    logger.addHandler(handler)
    try:
        logger.warning("before the disk filled")
        filler = fill(small_fs, 0)
        for n in range(200):
            logger.warning("while full %d %s", n, "x" * 2000)
        err = capfd.readouterr().err
        assert "Logging error" not in err and "Traceback" not in err
        assert err.count("cannot write the daemon log") == 1, err
        assert handler.dropped > 0

        filler.unlink()
        logger.warning("after the space came back")
        err = capfd.readouterr().err
        assert "written again" in err and "Traceback" not in err
        assert handler.dropped == 0
    finally:
        handler.close()
    text = log_file.read_text(errors="replace")
    assert "before the disk filled" in text and "after the space came back" in text
