"""Where everything lives under the var directory; one place so readers and writers agree."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class VarLayout:
    root: Path

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
        return self.logs_dir / "responses"

    @property
    def conversations_dir(self) -> Path:
        return self.logs_dir / "conversations"

    @property
    def consortium_dir(self) -> Path:
        return self.logs_dir / "consortium"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def conversation_meta_dir(self) -> Path:
        return self.state_dir / "conversations"

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

    def response_file(self, response_id: str) -> Path:
        return self.responses_dir / f"{response_id}.jsonl"

    def index_file(self, conversation_id: str) -> Path:
        return self.conversations_dir / f"{conversation_id}.jsonl"

    def summaries_file(self, conversation_id: str) -> Path:
        return self.summaries_dir / f"{conversation_id}.jsonl"

    def meta_file(self, conversation_id: str) -> Path:
        return self.conversation_meta_dir / f"{conversation_id}.json"

    @property
    def http_token_file(self) -> Path:
        return self.state_dir / "http_token"

    def client_state_file(self) -> Path:
        return self.state_dir / "client.json"
