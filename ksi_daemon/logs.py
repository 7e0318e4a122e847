"""structlog set-up: JSON lines to a size-rotated file, readable lines on a terminal."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path
from typing import Any

import structlog

from ksi_daemon.redaction import Redactor

_SECRET_KEYS = ("api_key", "authorization", "password", "secret", "token")


def _mask_secrets(_logger: object, _name: str, event: dict) -> dict:
    for key in event:
        lowered = key.lower()
        if any(word in lowered for word in _SECRET_KEYS) and not lowered.startswith("tokens"):
            event[key] = "***"
    return event


def _hide_secret_values(redactor: Redactor) -> structlog.types.Processor:
    """Mask known secret values wherever they appear: messages, fields, formatted tracebacks."""

    def processor(_logger: object, _name: str, event: dict) -> dict:
        return redactor.scrub(event)

    return processor


class DaemonLogFile(logging.handlers.RotatingFileHandler):
    """The daemon's rotating log file. A record it cannot write (a full disk, an I/O error) is
    dropped with one line on stderr when the failures begin and one when writing works again,
    instead of logging's own traceback on stderr for every record."""

    def __init__(self, filename: Path, max_bytes: int, backups: int) -> None:
        super().__init__(filename, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self.dropped = 0  # records lost since the writes began to fail
        self._failed = False  # set by handleError during the current emit

    def emit(self, record: logging.LogRecord) -> None:
        self._failed = False
        super().emit(record)  # calls handleError instead of raising
        if not self._failed and self.dropped:
            sys.stderr.write(f"ksi: the daemon log is written again; {self.dropped} records were lost\n")
            self.dropped = 0

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        self._failed = True
        self.dropped += 1
        if self.dropped == 1:
            error = sys.exc_info()[1]
            sys.stderr.write(f"ksi: cannot write the daemon log {self.baseFilename}: {error}; "
                             "records are dropped until it can be written\n")


def configure_logging(
    log_file: Path, level: str, max_bytes: int, backups: int, console: bool,
    redactor: Redactor | None = None,
) -> None:
    """Route structlog through stdlib logging to the rotating JSON file (and the console)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    hide = _hide_secret_values(redactor or Redactor())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _mask_secrets,
    ]
    def formatter(renderer: Any) -> logging.Formatter:
        """One chain for every handler; only the last step, how a record is written, differs."""
        return structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                hide,  # after the traceback is text, so it is masked too
                renderer,
            ],
        )

    file_handler = DaemonLogFile(log_file, max_bytes, backups)
    file_handler.setFormatter(formatter(structlog.processors.JSONRenderer()))
    handlers: list[logging.Handler] = [file_handler]
    if console:
        console_handler = logging.StreamHandler(sys.stderr)
        console_handler.setFormatter(formatter(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())))
        handlers.append(console_handler)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("LiteLLM", "litellm", "httpx", "httpcore", "openai", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
