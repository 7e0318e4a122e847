"""Every setting of the daemon, resolved once at start and passed down."""

from __future__ import annotations

import fnmatch
import json
import os
import re
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from ksi_common.dburl import mask_url
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.http_token import weakness
from ksi_common.layout import VarLayout, find_var_dir
from ksi_common.limits import MAX_TIMEOUT, MAX_TTL


RESOLVED_KEPT = 1024  # model names whose overrides are remembered (see ModelOverrides)

# the form a setting takes, for the error that names a value that does not fit it
EXPECTED_FORM = {
    "allowed_file_roots": "directories separated by ':' as in PATH (/srv/docs:/home/me/src), or a JSON list",
    "allow_uids": "user ids separated by commas (1001,1002), or a JSON list",
    "models": 'a JSON object from a model pattern to its settings, e.g. {"ollama/*": {"api_base": '
              '"http://127.0.0.1:11434"}}',
}


def plain_list(value: Any, separator: str) -> Any:
    """A list setting as users write it: `a<separator>b`, or a JSON list (`[...]`)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError("not a JSON list") from None
    return [part.strip() for part in text.split(separator) if part.strip()]


class ModelSettings(BaseModel):
    """Per-model overrides, chosen by a glob pattern on the model name."""

    api_base: str | None = None
    api_key_env: str | None = None
    context_window: int | None = Field(default=None, gt=0)
    output_reserve: int | None = Field(default=None, ge=0)
    max_concurrency: int | None = Field(default=None, gt=0)  # calls at once, over every daemon of the pool
    # calls and tokens (prompt and answer) per rolling minute, over every daemon of the pool; a call
    # beyond them fails with rate_limited and the seconds until the window has room
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    # provider options a request may set for this model although they pick a host or credentials
    # (base_url, extra_headers, ...); none by default, so a request cannot send a key elsewhere
    allow_options: list[str] = Field(default_factory=list)
    summariser: str | None = None  # the model that summarises this model's long conversations; "off"
    summary_temperature: float | None = Field(default=None, ge=0)  # this model as a summariser (None: 0)
    # what the model can do, where litellm's model list does not know it (a local or new model);
    # None: ask litellm, and pass the option on when it does not know either (a JSON schema, tools
    # and images are refused only for a model known not to take them)
    supports_response_schema: bool | None = None
    supports_vision: bool | None = None
    supports_function_calling: bool | None = None


class ModelOverrides:
    """Each model name's overrides, remembered: a completion asks about its model about ten
    times, and matching every pattern each time was a visible share of the daemon's own CPU."""

    __slots__ = ("models", "_found")

    def __init__(self, models: dict[str, ModelSettings]) -> None:
        self.models = models
        self._found: dict[str, ModelSettings] = {}

    def __len__(self) -> int:
        return len(self._found)

    def get(self, model: str) -> ModelSettings:
        found = self._found.get(model)
        if found is None:
            if len(self._found) >= RESOLVED_KEPT:  # names come from requests: kept bounded
                self._found.clear()
            found = self._found[model] = self._most_specific(model)
        return found

    def _most_specific(self, model: str) -> ModelSettings:
        if model in self.models:
            return self.models[model]
        matches = [p for p in self.models if fnmatch.fnmatchcase(model, p)]
        if not matches:
            return ModelSettings()
        return self.models[max(matches, key=len)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KSI_", env_file=".env", env_file_encoding="utf-8", extra="ignore", allow_inf_nan=False
    )

    # found as every `ksi` command finds it: a marked project `var/` upward, else the per-user one
    var_dir: Path = Field(default_factory=find_var_dir)
    socket_path: Path | None = None
    default_model: str = "echo/default"
    line_limit: int = Field(default=1024 * 1024, gt=0)
    push_queue_size: int = Field(default=1000, gt=0)
    max_inflight_per_connection: int = Field(default=256, gt=0)
    # client connections of every door together (Unix socket and HTTP); more are answered
    # too_many_connections and closed (and the limit stays below what the process may open, with
    # room for files, the database pool and provider sockets, so accept never runs out of descriptors)
    max_connections: int = Field(default=1000, gt=0)
    allow_uids: Annotated[list[int], NoDecode] = Field(default_factory=list)  # 1001,1002 or JSON
    shutdown_timeout: float = Field(default=10.0, ge=0, le=MAX_TIMEOUT)

    # completions
    max_concurrency: int = Field(default=8, gt=0)
    max_queued: int = Field(default=10_000, gt=0)
    request_timeout: float = Field(default=120.0, gt=0, le=MAX_TIMEOUT)
    retry_attempts: int = Field(default=3, ge=1)
    retry_base_delay: float = Field(default=0.5, ge=0, le=MAX_TIMEOUT)
    retry_max_delay: float = Field(default=30.0, ge=0, le=MAX_TIMEOUT)
    circuit_failures: int = Field(default=5, gt=0)
    circuit_reset: float = Field(default=30.0, gt=0, le=MAX_TIMEOUT)
    default_context_window: int = Field(default=8192, gt=0)
    default_output_reserve: int = Field(default=1024, ge=0)
    models: dict[str, ModelSettings] = Field(default_factory=dict)
    active_conversations: int = Field(default=1000, gt=0)
    finished_requests_kept: int = Field(default=10_000, gt=0)
    max_response_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    fsync: Literal["always", "never"] = "always"
    storage: Literal["jsonl", "postgres"] = "jsonl"  # the backend, by name (ksi_daemon.storage.backends)
    database_url: SecretStr | None = None  # postgresql://... for storage=postgres; never shown unmasked
    litellm_preload: bool = True
    # daemons sharing a database: each records itself in it every interval; one whose last record
    # is older than the timeout (default three intervals) is shown stale by the others
    heartbeat_interval: float = Field(default=2.0, gt=0, le=MAX_TIMEOUT)
    heartbeat_timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT)
    # seconds a daemon holds a conversation's turn or a call slot without renewing it (renewed every
    # third of it while held); a daemon paused or cut off longer loses them to the other daemons
    pool_lease: float = Field(default=30.0, gt=0, le=MAX_TIMEOUT)
    # provider calls at once over every daemon sharing the database (None: only each daemon's own
    # max_concurrency); a model's own max_concurrency holds over all of them in any case
    pool_max_concurrency: int | None = Field(default=None, gt=0)
    cli_timeout: float = Field(default=300.0, gt=0, le=MAX_TIMEOUT)

    # conversations
    default_ttl: float | None = Field(default=None, gt=0, le=MAX_TTL)
    allowed_file_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)  # /a:/b or JSON
    files_budget_share: float = Field(default=0.5, gt=0, le=1)
    max_image_bytes: int = Field(default=20 * 1024 * 1024, gt=0)  # one image of a request, stored once by hash
    max_fork_depth: int = Field(default=32, gt=0)
    # seconds after a conversation's newest pending input was added during which a request naming no
    # conversation may continue it by resending that input (0: only requests naming it)
    pending_match_window: float = Field(default=120.0, ge=0, le=MAX_TIMEOUT)
    # compaction: a summary of the exchanges a long history leaves out (None: the conversation's
    # own model; "off": only the note saying how many were left out)
    summariser: str | None = None
    compaction_step: int = Field(default=4, ge=1)  # summarise this many exchanges ahead, so once per step turns
    summary_max_tokens: int = Field(default=512, gt=0)  # one summariser answer at most
    summary_share: float = Field(default=0.3, gt=0, le=0.8)  # of a turn's history budget, for summaries
    summary_max_levels: int = Field(default=3, ge=1)  # merges of merges, at most this deep
    pins_share: float = Field(default=0.3, gt=0, le=0.8)  # of a turn's history budget, for pinned exchanges
    summary_retry_delay: float = Field(default=30.0, gt=0)
    summary_retry_max_delay: float = Field(default=600.0, gt=0)
    # learn per model how the provider's prompt token counts compare to the daemon's estimates
    calibration: bool = True

    # agents
    profiles_dir: Path | None = None
    max_event_depth: int = Field(default=3, ge=0)
    max_events_per_chain: int = Field(default=64, gt=0)  # events agents emit in one chain, at every depth

    # logging
    log_level: str = "INFO"
    log_max_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    log_backups: int = Field(default=5, ge=0)

    # credentials the daemon itself reads; never echoed back
    api_key: SecretStr | None = None

    # the HTTP front (OpenAI-compatible API, MCP, console): off unless an address is given
    http_addr: str | None = None  # [HOST:]PORT; HOST defaults to 127.0.0.1
    http_token: SecretStr | None = None  # else generated into the var dir on first start
    # seconds a connection may take to send a request's head (from connecting, or from the first
    # byte of the next request), and may stay idle between requests: then it is closed
    http_head_timeout: float = Field(default=10.0, gt=0, le=MAX_TIMEOUT)
    http_keepalive_timeout: float = Field(default=5.0, gt=0, le=MAX_TIMEOUT)

    @field_validator("http_token")
    @classmethod
    def _strong_token(cls, token: SecretStr | None) -> SecretStr | None:
        # an empty or short token would guard nothing (and the message never shows the value)
        if token is not None and (reason := weakness(token.get_secret_value())) is not None:
            raise ValueError(reason)
        return token

    @field_validator("allow_uids", mode="before")
    @classmethod
    def _uids_as_written(cls, value: Any) -> Any:
        return plain_list(value, ",")

    @field_validator("allowed_file_roots", mode="before")
    @classmethod
    def _roots_as_written(cls, value: Any) -> Any:
        return plain_list(value, os.pathsep)

    @field_validator("heartbeat_timeout")
    @classmethod
    def _timeout_above_interval(cls, timeout: float | None, info: ValidationInfo) -> float | None:
        # a daemon that beats on time would be shown stale between two beats
        interval = info.data.get("heartbeat_interval")
        if timeout is not None and interval is not None and timeout <= interval:
            raise ValueError(f"must exceed KSI_HEARTBEAT_INTERVAL ({interval} s)")
        return timeout

    @property
    def heartbeat_stale_after(self) -> float:
        """Seconds without a heartbeat after which a daemon is stale."""
        return self.heartbeat_timeout if self.heartbeat_timeout is not None else 3 * self.heartbeat_interval

    @property
    def fsync_enabled(self) -> bool:
        return self.fsync == "always"

    @property
    def layout(self) -> VarLayout:
        return VarLayout(self.var_dir)

    @property
    def socket(self) -> Path:
        return self.socket_path or self.layout.default_socket

    def model_settings(self, model: str) -> ModelSettings:
        """The most specific override for `model` (exact name first, then the longest glob)."""
        overrides = self.resolved_models
        if overrides.models is not self.models:  # a copy (or an assignment) with other models
            del self.resolved_models
            overrides = self.resolved_models
        return overrides.get(model)

    @cached_property
    def resolved_models(self) -> ModelOverrides:
        # a plain attribute once computed: pydantic's private attributes are found through its
        # __getattr__, four Python calls per read, and a completion reads this about ten times
        return ModelOverrides(self.models)

    def public_view(self) -> dict:
        """The effective settings with secrets masked, for `ksi config` and health."""
        view = self.model_dump(mode="json")
        view["api_key"] = "***" if self.api_key else None
        view["http_token"] = "***" if self.http_token else None
        view["database_url"] = mask_url(self.database_url.get_secret_value()) if self.database_url else None
        view["socket_path"] = str(self.socket)
        return view


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, `.env` and `overrides`. A value that does not fit is a
    KsiError naming each variable on one line (values left out: one may be a secret), which a
    daemon start can show whole where it shows only its last line."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        fields = {_variable(error["loc"]): _with_form(error["loc"], error["msg"]) for error in exc.errors()}
        problems = "; ".join(f"{name}: {message}" for name, message in fields.items())
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"invalid settings: {problems}", fields=fields) from None
    except SettingsError as exc:  # a value that is not even parsed (KSI_MODELS that is not JSON)
        named = re.search(r'field "(\w+)"', str(exc))
        if named is None:
            raise KsiError(ErrorCode.VALIDATION_ERROR, f"invalid settings: {exc}") from None
        name = _variable((named.group(1),))
        message = _with_form((named.group(1),), "not valid JSON")
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"invalid settings: {name}: {message}",
                       fields={name: message}) from None


def _with_form(loc: tuple[int | str, ...], message: str) -> str:
    """The error's message, followed by the form the setting takes when it has a form of its own."""
    form = EXPECTED_FORM.get(str(loc[0])) if loc else None
    return f"{message}; expected {form}" if form else message


def _variable(loc: tuple[int | str, ...]) -> str:
    """`("max_concurrency",)` -> `KSI_MAX_CONCURRENCY`; a nested place keeps its path after it."""
    if not loc:
        return "settings"
    head, *rest = loc
    return ".".join([f"KSI_{str(head).upper()}", *map(str, rest)])
