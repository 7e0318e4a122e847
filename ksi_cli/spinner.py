"""A spinner on the terminal until the first token arrives; nothing at all when not a terminal."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
INTERVAL = 0.08


class Spinner:
    """Draws on `stream` from a thread; `stop()` erases it and is safe to call more than once."""

    def __init__(self, stream: TextIO = sys.stderr, label: str = "") -> None:
        self.stream = stream
        self.label = label
        self.active = stream.isatty()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> Spinner:
        if self.active:
            self._thread = threading.Thread(target=self._spin, name="ksi-spinner", daemon=True)
            self._thread.start()
        return self

    def _spin(self) -> None:
        index = 0
        while not self._stopped.wait(INTERVAL):
            with self._lock:
                if self._stopped.is_set():
                    return
                self.stream.write(f"\r{FRAMES[index % len(FRAMES)]} {self.label}")
                self.stream.flush()
            index += 1

    def stop(self) -> None:
        if not self.active or self._stopped.is_set():
            return
        with self._lock:
            self._stopped.set()
            self.stream.write("\r\x1b[K")  # erase the spinner's line before the answer is written
            self.stream.flush()
