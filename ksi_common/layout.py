"""Where everything lives under the var directory; one place so readers and writers agree."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class VarLayout:
    root: Path
    # the directories a file of every exchange lives in, joined once (each join costs microseconds)
    _responses: Path = field(init=False, repr=False, compare=False)
    _conversations: Path = field(init=False, repr=False, compare=False)
    _conversation_meta: Path = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_responses", self.root / "logs" / "responses")
        object.__setattr__(self, "_conversations", self.root / "logs" / "conversations")
        object.__setattr__(self, "_conversation_meta", self.root / "state" / "conversations")

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def default_socket(self) -> Path:
        return self.run_dir / "daemon.sock"

    @property
    def pid_file(self) -> Path:
        return self.run_dir / "daemon.pid"

    @property
    def kept_settings_file(self) -> Path:
        """The settings the running daemon was given by its start (flags, environment), which a restart keeps."""
        return self.run_dir / "settings.json"

    @property
    def lock_file(self) -> Path:
        return self.run_dir / "daemon.lock"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def daemon_log(self) -> Path:
        return self.logs_dir / "daemon" / "daemon.log"

    @property
    def responses_dir(self) -> Path:
        return self._responses

    @property
    def conversations_dir(self) -> Path:
        return self._conversations

    @property
    def consortium_dir(self) -> Path:
        return self.logs_dir / "consortium"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def conversation_meta_dir(self) -> Path:
        return self._conversation_meta

    @property
    def agents_dir(self) -> Path:
        return self.state_dir / "agents"

    @property
    def consortia_dir(self) -> Path:
        return self.state_dir / "consortia"

    @property
    def summaries_dir(self) -> Path:
        return self.logs_dir / "summaries"

    @property
    def calibration_file(self) -> Path:
        return self.state_dir / "calibration.json"

    @property
    def requests_file(self) -> Path:
        return self.state_dir / "requests.jsonl"

    @property
    def exchange_log_dir(self) -> Path:
        return self.state_dir / "exchange-log"

    @property
    def blobs_dir(self) -> Path:
        """Content-addressed bytes: `blobs/sha256/<first two hex digits>/<sha256>`."""
        return self.root / "blobs" / "sha256"

    def blob_file(self, sha256: str) -> Path:
        return self.blobs_dir / sha256[:2] / sha256

    def response_file(self, response_id: str) -> Path:
        return self._responses / f"{response_id}.jsonl"

    def index_file(self, conversation_id: str) -> Path:
        return self._conversations / f"{conversation_id}.jsonl"

    def pending_import_file(self, conversation_id: str) -> Path:
        """The index of an import, hidden until its metadata exists (then the next start moves it in)."""
        return self._conversations / f".{conversation_id}.jsonl.importing"

    def summaries_file(self, conversation_id: str) -> Path:
        return self.summaries_dir / f"{conversation_id}.jsonl"

    def meta_file(self, conversation_id: str) -> Path:
        return self._conversation_meta / f"{conversation_id}.json"

    @property
    def http_token_file(self) -> Path:
        return self.state_dir / "http_token"

    def client_state_file(self) -> Path:
        return self.state_dir / "client.json"


# A project-local var dir is recognised by this file, so every command run anywhere below the
# project finds the same daemon (as git finds .git); `ksi daemon start` writes it.
MARKER_NAME = ".ksi-var"


def user_var_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user var dir: `$XDG_STATE_HOME/ksi`, else `~/.local/state/ksi`."""
    env = os.environ if environ is None else environ
    state_home = env.get("XDG_STATE_HOME") or ""
    base = Path(state_home) if os.path.isabs(state_home) else Path.home() / ".local" / "state"
    return base / "ksi"


def find_var_dir(start: Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """A marked `var/` in `start` (default: the working directory) or one of its parents, else the per-user one."""
    here = (start or Path.cwd()).absolute()
    for directory in (here, *here.parents):
        candidate = directory / "var"
        if (candidate / MARKER_NAME).is_file():
            return candidate
    return user_var_dir(environ)


def mark_var_dir(root: Path) -> None:
    """Create `root` (owner-only) with its marker, so commands run below its parent find it."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    marker = root / MARKER_NAME
    if not marker.exists():
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write('{"v": 1, "what": "KSI var directory"}\n')
