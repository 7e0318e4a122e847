"""Every setting of the daemon, resolved once at start and passed down."""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    EnvSettingsSource,
    NoDecode,
    SettingsConfigDict,
    SettingsError,
)

from ksi_common.config_file import config_path, is_secret, read_config
from ksi_common.dburl import mask_url
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.http_token import weakness
from ksi_common.kept_settings import KeptSettings
from ksi_common.layout import VarLayout, find_var_dir
from ksi_common.limits import MAX_TIMEOUT, MAX_TTL
from ksi_common.storage_backends import DEFAULT_STORAGE, STORAGE_NAMES

# where a setting's value came from, highest first: a later place is used only for what the
# earlier ones leave unset (a setting is replaced whole, a table such as `models` too)
ORIGINS = ("flag", "env", ".env", "kept", "file")
DEFAULT_ORIGIN = "default"

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

    # each field's docstring: its reference text; a name no field has is refused (a typo in a
    # model's table would otherwise be dropped in silence, and a key written there kept in the clear)
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    api_base: str | None = None
    """The provider's base URL for these models (a local server, a proxy)."""
    api_key_env: str | None = None
    """The environment variable holding these models' key."""
    context_window: int | None = Field(default=None, gt=0)
    """The model's context window in tokens, where litellm does not know it."""
    output_reserve: int | None = Field(default=None, ge=0)
    """Tokens of the window kept for the answer."""
    max_concurrency: int | None = Field(default=None, gt=0)  # calls at once, over every daemon of the pool
    """Calls of these models at once, over every daemon of the pool."""
    # calls and tokens (prompt and answer) per rolling minute, over every daemon of the pool; a call
    # beyond them fails with rate_limited and the seconds until the window has room
    requests_per_minute: int | None = Field(default=None, gt=0)
    """Calls of these models per rolling minute, over every daemon; more fail with `rate_limited`."""
    tokens_per_minute: int | None = Field(default=None, gt=0)
    """Tokens (prompt and answer) of these models per rolling minute, over every daemon."""
    # provider options a request may set for this model although they pick a host or credentials
    # (base_url, extra_headers, ...); none by default, so a request cannot send a key elsewhere
    allow_options: list[str] = Field(default_factory=list)
    """Options that pick a host or credentials (`base_url`, `extra_headers`, ...) a request may set."""
    summariser: str | None = None  # the model that summarises this model's long conversations; "off"
    """The model that summarises these models' long conversations; `off`: none."""
    summary_temperature: float | None = Field(default=None, ge=0)  # this model as a summariser (None: 0)
    """Temperature when this model summarises; default 0."""
    # what the model can do, where litellm's model list does not know it (a local or new model);
    # None: ask litellm, and pass the option on when it does not know either (a JSON schema, tools
    # and images are refused only for a model known not to take them)
    supports_response_schema: bool | None = None
    """Whether the model follows a JSON schema; unset: litellm's model list says."""
    supports_vision: bool | None = None
    """Whether the model sees images; unset: litellm's model list says."""
    supports_pdf_input: bool | None = None
    """Whether the model reads PDF documents (sent as file parts); unset: litellm's model list says."""
    supports_function_calling: bool | None = None
    """Whether the model calls tools; unset: litellm's model list says."""
    supports_web_search: bool | None = None
    """Whether the model searches the web itself (`web_search_options`): a Responses `web_search`
    tool is then passed on to it; unset: as litellm's model list says, refused when it does not say so."""
    supports_custom_tools: bool = False
    """Whether the model's chat API takes `custom` tools as they are (OpenAI's GPT-5 models do);
    for an `openai/` model they are then sent in that form, else as a function of one string."""
    cache_placement: Literal["on", "off"] = "on"
    """Whether KSI places prompt-cache markers itself (Anthropic `cache_control`, OpenAI `prompt_cache_key`);
    a client's own are always kept."""
    cache_ttl: Literal["5m", "1h"] = "5m"
    """How long the Anthropic breakpoints on the system prompt and the newest stored summary keep
    their prefix cached; `1h` outlives a pause between turns but costs twice the input price to write."""
    cache_slots: int | None = Field(default=None, gt=0)
    """For a llama.cpp-style local server: its slot count. Each request then asks it to keep the
    prompt cached (`cache_prompt`) in the slot of its conversation (`id_slot`, the same for every turn)."""
    drop_hosted_tools: list[str] = Field(default_factory=list)
    """Hosted tool types (`web_search`, `file_search`, ...) the Responses door leaves out of a request
    to this model instead of refusing it (Codex sends `web_search` with every request)."""


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
        env_prefix="KSI_", env_file=".env", env_file_encoding="utf-8", extra="ignore", allow_inf_nan=False,
        use_attribute_docstrings=True,  # each field's docstring: its text in docs/settings.md
    )

    # found as every `ksi` command finds it: a marked project `var/` upward, else the per-user one
    var_dir: Path = Field(default_factory=find_var_dir)
    """Where the daemon keeps its socket, logs and state; default: a marked project `var/` found
    upward from the working directory, else `$XDG_STATE_HOME/ksi`."""
    socket_path: Path | None = None
    """The daemon's Unix socket; default: `run/daemon.sock` in the var dir."""
    default_model: str = "echo/default"
    """The model of a request that names none."""
    line_limit: int = Field(default=1024 * 1024, gt=0)
    """Bytes one request may take: a socket line, an HTTP body, a console form."""
    push_queue_size: int = Field(default=1000, gt=0)
    """Pushed events held for a subscriber that reads slowly; past it new ones are dropped and counted."""
    max_inflight_per_connection: int = Field(default=256, gt=0)
    """Requests one connection may have running at once."""
    # client connections of every door together (Unix socket and HTTP); more are answered
    # too_many_connections and closed (and the limit stays below what the process may open, with
    # room for files, the database pool and provider sockets, so accept never runs out of descriptors)
    max_connections: int = Field(default=1000, gt=0)
    """Client connections of every door together; more are refused with `too_many_connections`."""
    allow_uids: Annotated[list[int], NoDecode] = Field(default_factory=list)  # 1001,1002 or JSON
    """Other user ids the Unix socket answers, besides the daemon's own user."""
    shutdown_timeout: float = Field(default=10.0, ge=0, le=MAX_TIMEOUT)
    """Seconds a stop waits for running work to finish before cancelling it."""

    # completions
    max_concurrency: int = Field(default=8, gt=0)
    """Provider calls this daemon makes at once."""
    max_queued: int = Field(default=10_000, gt=0)
    """Requests waiting for a slot; more are refused with `overloaded`."""
    request_timeout: float = Field(default=120.0, gt=0, le=MAX_TIMEOUT)
    """Seconds one provider call may take."""
    retry_attempts: int = Field(default=3, ge=1)
    """Tries of a provider call that failed for a reason worth retrying."""
    retry_base_delay: float = Field(default=0.5, ge=0, le=MAX_TIMEOUT)
    """Seconds before the first retry; doubled at each further one."""
    retry_max_delay: float = Field(default=30.0, ge=0, le=MAX_TIMEOUT)
    """Longest wait between two retries, in seconds."""
    circuit_failures: int = Field(default=5, gt=0)
    """Failures in a row that open a model's circuit (its requests then fail at once)."""
    circuit_reset: float = Field(default=30.0, gt=0, le=MAX_TIMEOUT)
    """Seconds an open circuit waits before it lets one request try again."""
    default_context_window: int = Field(default=8192, gt=0)
    """Context window in tokens of a model whose window neither litellm nor `KSI_MODELS` knows."""
    default_output_reserve: int = Field(default=1024, ge=0)
    """Tokens of the window kept for the answer when `KSI_MODELS` sets no `output_reserve`."""
    models: dict[str, ModelSettings] = Field(default_factory=dict)
    """Settings per model, by glob pattern on the model name (the keys are listed below)."""
    model_aliases: dict[str, str] = Field(default_factory=dict)
    """Other names for models, so a client that can only name its vendor's models (`claude-sonnet-*`)
    reaches another one: exact names first, then the longest glob, as `models` are chosen."""
    active_conversations: int = Field(default=1000, gt=0)
    """Conversations kept in memory; the least recently used beyond it are read again from storage."""
    finished_requests_kept: int = Field(default=10_000, gt=0)
    """Finished requests whose result `completion:wait` and `completion:status` can still return."""
    max_response_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    """Bytes of one provider answer read at most; a longer one fails the call."""
    fsync: Literal["always", "never"] = "always"
    """`always`: an exchange is acknowledged once it is on disk; `never`: left to the kernel."""
    storage: Literal[STORAGE_NAMES] = DEFAULT_STORAGE  # the backend, by name (ksi_common.storage_backends)
    """The storage backend: JSONL files in the var dir, or a PostgreSQL database."""
    database_url: SecretStr | None = None  # postgresql://... for storage=postgres; never shown unmasked
    """The PostgreSQL URL (`postgresql://user:password@host:port/db`) when `KSI_STORAGE=postgres`; shown masked."""
    litellm_preload: bool = True
    """Import litellm in the background at start, so the first request does not wait for it."""
    # daemons sharing a database: each records itself in it every interval; one whose last record
    # is older than the timeout (default three intervals) is shown stale by the others
    heartbeat_interval: float = Field(default=2.0, gt=0, le=MAX_TIMEOUT)
    """Seconds between two heartbeats of a daemon sharing the database."""
    heartbeat_timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT)
    """Seconds without a heartbeat after which a daemon is stale and its work taken over; default: 3 intervals."""
    # seconds a daemon holds a conversation's turn or a call slot without renewing it (renewed every
    # third of it while held); a daemon paused or cut off longer loses them to the other daemons
    pool_lease: float = Field(default=30.0, gt=0, le=MAX_TIMEOUT)
    """Seconds a conversation's turn or a call slot stays held without renewal."""
    # provider calls at once over every daemon sharing the database (None: only each daemon's own
    # max_concurrency); a model's own max_concurrency holds over all of them in any case
    pool_max_concurrency: int | None = Field(default=None, gt=0)
    """Provider calls at once over every daemon sharing the database; unset: no bound for the pool."""
    cli_timeout: float = Field(default=300.0, gt=0, le=MAX_TIMEOUT)
    """Seconds one call of a `claude-cli/` or `gemini-cli/` model may take."""

    # conversations
    default_ttl: float | None = Field(default=None, gt=0, le=MAX_TTL)
    """Seconds a new conversation lives after its last activity; unset: for ever."""
    allowed_file_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)  # /a:/b or JSON
    """Directories whose files a request may attach; none by default."""
    files_budget_share: float = Field(default=0.5, gt=0, le=1)
    """Share of a turn's history budget that attached files may take."""
    max_image_bytes: int = Field(default=20 * 1024 * 1024, gt=0)  # one image of a request, stored once by hash
    """Bytes of one image or PDF of a request at most; more is refused with `image_too_large`."""
    max_fork_depth: int = Field(default=32, gt=0)
    """Forks of forks a conversation may sit under."""
    pending_match_window: float = Field(default=120.0, ge=0, le=MAX_TIMEOUT)
    """Seconds after a conversation's newest pending input was added during which a request naming
    no conversation may continue it by resending that input; 0: only requests naming it."""
    # compaction: a summary of the exchanges a long history leaves out (None: the conversation's
    # own model; "off": only the note saying how many were left out)
    summariser: str | None = None
    """The model that summarises left-out exchanges; unset: the conversation's own model; `off`: none."""
    compaction_step: int = Field(default=4, ge=1)  # summarise this many exchanges ahead, so once per step turns
    """Exchanges a summary chunk reaches ahead, so compaction runs about once per this many turns."""
    history_step: int = Field(default=4, ge=1)  # the window's start moves by this many exchanges
    """Exchanges the history window's start moves by when the budget leaves older ones out, so
    requests between two moves extend each other and a provider's prompt cache holds; 1: one at a time."""
    summary_max_tokens: int = Field(default=512, gt=0)  # one summariser answer at most
    """Tokens of one summariser answer at most."""
    summary_share: float = Field(default=0.3, gt=0, le=0.8)  # of a turn's history budget, for summaries
    """Share of a turn's history budget kept for summaries."""
    summary_max_levels: int = Field(default=3, ge=1)  # merges of merges, at most this deep
    """How deep summaries of summaries may be merged."""
    pins_share: float = Field(default=0.3, gt=0, le=0.8)  # of a turn's history budget, for pinned exchanges
    """Share of a turn's history budget that pinned exchanges may take; past it pinning is refused."""
    summary_retry_delay: float = Field(default=30.0, gt=0)
    """Seconds before a failed summary is tried again; doubled after each failure."""
    summary_retry_max_delay: float = Field(default=600.0, gt=0)
    """Longest wait before a failed summary is tried again, in seconds."""
    # learn per model how the provider's prompt token counts compare to the daemon's estimates
    calibration: bool = True
    """Learn per model how the provider's token counts compare to the daemon's estimates."""

    # agents
    profiles_dir: Path | None = None
    """A directory of agent profiles (YAML or Markdown); they win over the shipped ones of the same name."""
    max_event_depth: int = Field(default=3, ge=0)
    """How deep events emitted by agents may trigger further agent turns."""
    max_events_per_chain: int = Field(default=64, gt=0)  # events agents emit in one chain, at every depth
    """Events agents may emit in one chain, at every depth together."""

    # logging
    log_level: str = "INFO"
    """Lowest level written to the daemon's log (`DEBUG`, `INFO`, `WARNING`, `ERROR`)."""
    log_max_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    """Size of the daemon's log file before it is rotated."""
    log_backups: int = Field(default=5, ge=0)
    """Rotated log files kept."""

    # credentials the daemon itself reads; never echoed back
    api_key: SecretStr | None = None
    """A secret masked in every log and reply; no provider reads it (each reads its own, e.g. `OPENAI_API_KEY`)."""

    # the HTTP front (OpenAI-compatible API, MCP, console): off unless an address is given
    http_addr: str | None = None  # [HOST:]PORT; HOST defaults to 127.0.0.1
    """`[HOST:]PORT` of the HTTP front (OpenAI API, MCP, console); unset: no HTTP. HOST defaults to 127.0.0.1."""
    http_token: SecretStr | None = None  # else generated into the var dir on first start
    """The HTTP bearer token (16 characters or more); unset: one generated into the var dir at the first start."""
    # seconds a connection may take to send a request's head (from connecting, or from the first
    # byte of the next request), and may stay idle between requests: then it is closed
    http_head_timeout: float = Field(default=10.0, gt=0, le=MAX_TIMEOUT)
    """Seconds an HTTP connection may take to send a request's head; a late one gets 408."""
    http_keepalive_timeout: float = Field(default=5.0, gt=0, le=MAX_TIMEOUT)
    """Seconds an idle kept-alive HTTP connection stays open."""
    http_body_timeout: float = Field(default=60.0, gt=0, le=MAX_TIMEOUT)
    """Seconds a request's body may take to arrive whole, from its head on; a late one gets 408."""

    # where each setting came from (ORIGINS), filled by load_settings
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)

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

    def aliased(self, model: str) -> str:
        """The model `model` names through `model_aliases` (itself when no alias matches)."""
        if model in self.model_aliases:
            return self.model_aliases[model]
        matches = [pattern for pattern in self.model_aliases if fnmatch.fnmatchcase(model, pattern)]
        return self.model_aliases[max(matches, key=len)] if matches else model

    @cached_property
    def resolved_models(self) -> ModelOverrides:
        # a plain attribute once computed: pydantic's private attributes are found through its
        # __getattr__, four Python calls per read, and a completion reads this about ten times
        return ModelOverrides(self.models)

    @property
    def origins(self) -> dict[str, str]:
        """Each setting's origin: flag, env, .env, kept (by a restart), file or default."""
        return {name: self._origins.get(name, DEFAULT_ORIGIN) for name in type(self).model_fields}

    @property
    def config_file(self) -> Path:
        """The configuration file this daemon reads (which may not exist)."""
        return config_path(self.var_dir)

    def given_at_start(self) -> KeptSettings:
        """What this start was given (flags, environment, .env, kept), for a restart to keep:
        values JSON-ready, secrets by name only."""
        given = {name for name, origin in self.origins.items() if origin in ("flag", "env", ".env", "kept")}
        given -= {"var_dir", "socket_path"}  # the restart finds the daemon through them: given again
        values = self.model_dump(mode="json", include=given)
        for name in given:
            if isinstance(secret := getattr(self, name), SecretStr):  # a database URL without a password is kept
                values[name] = secret.get_secret_value()
        secrets = tuple(sorted(name for name in given if is_secret(name, values[name])))
        return KeptSettings({name: value for name, value in values.items()
                             if value is not None and name not in secrets}, secrets)

    def public_view(self) -> dict:
        """The effective settings with secrets masked, for `ksi config` and health."""
        view = self.model_dump(mode="json")
        view["api_key"] = "***" if self.api_key else None
        view["http_token"] = "***" if self.http_token else None
        view["database_url"] = mask_url(self.database_url.get_secret_value()) if self.database_url else None
        view["socket_path"] = str(self.socket)
        return view


def load_settings(kept: Mapping[str, object] | None = None, **overrides: object) -> Settings:
    """Settings from `overrides` (flags), the environment, `.env`, `kept` (what a restart keeps),
    the configuration file and the defaults, in that order. A value that does not fit is a
    KsiError naming each variable on one line (values left out: one may be a secret) and the
    file when it came from there."""
    env_file = overrides.pop("_env_file", ".env")  # None: no .env file (tests)
    layers: dict[str, Mapping[str, object]] = {"flag": overrides}
    try:
        dotenv = DotEnvSettingsSource(Settings, env_file=env_file)() if env_file else {}  # type: ignore[arg-type]
        environment = EnvSettingsSource(Settings)()
    except SettingsError as exc:  # a value that is not even parsed (KSI_MODELS that is not JSON)
        _refuse_unparsed(exc)
    # the daemon loads .env into its environment: a value found in both, alike, came from .env
    layers["env"] = {k: v for k, v in environment.items() if k not in dotenv or dotenv[k] != v}
    layers[".env"] = dotenv
    layers["kept"] = dict(kept or {})
    var_dir = next((layer["var_dir"] for layer in layers.values() if "var_dir" in layer), None)
    path = config_path(Path(str(var_dir)).expanduser() if var_dir is not None else find_var_dir())
    layers["file"] = _known_settings(read_config(path), path)
    merged: dict[str, object] = {}
    origins: dict[str, str] = {}
    for origin in reversed(ORIGINS):
        merged.update(layers[origin])
        origins.update(dict.fromkeys(layers[origin], origin))
    try:
        settings = Settings(_env_file=None, **merged)  # type: ignore[arg-type]
    except ValidationError as exc:
        refuse_unknown_model_settings(exc, _where(("models",), origins, path))
        fields = {_variable(e["loc"]): _with_form(e["loc"], e["msg"]) + _where(e["loc"], origins, path)
                  for e in exc.errors()}
        problems = "; ".join(f"{name}: {message}" for name, message in fields.items())
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"invalid settings: {problems}", fields=fields) from None
    settings._origins = origins
    return settings


def _refuse_unparsed(exc: SettingsError) -> NoReturn:
    named = re.search(r'field "(\w+)"', str(exc))
    if named is None:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"invalid settings: {exc}") from None
    name = _variable((named.group(1),))
    message = _with_form((named.group(1),), "not valid JSON")
    raise KsiError(ErrorCode.VALIDATION_ERROR, f"invalid settings: {name}: {message}",
                   fields={name: message}) from None


def _known_settings(values: dict[str, object], path: Path) -> dict[str, object]:
    """The file's settings, refused when one is no setting at all (a typo would go unnoticed)."""
    for name in values:
        if name not in Settings.model_fields:
            raise unknown_setting(name, f" in {path}")
    return values


def refuse_unknown_model_settings(exc: ValidationError, where: str = "") -> None:
    """A name no model setting has, in a model's table: refused as any unknown setting is."""
    for error in exc.errors():
        if error["type"] == "extra_forbidden" and len(error["loc"]) == 3 and error["loc"][0] == "models":
            _, pattern, name = error["loc"]
            raise unknown_setting(str(name), f" in the table of models {pattern!r}{where}",
                                  known=list(ModelSettings.model_fields)) from None


def unknown_setting(name: str, where: str = "", known: list[str] | None = None) -> KsiError:
    """The error for a name no setting has, with the closest names (of `known`: every setting)."""
    known = list(Settings.model_fields) if known is None else known
    similar = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(similar)}?" if similar else "; `ksi config show` lists every setting"
    return KsiError(ErrorCode.UNKNOWN_SETTING, f"no setting is called {name!r}{where}{hint}",
                    setting=name, similar=similar)


def _where(loc: tuple[int | str, ...], origins: Mapping[str, str], path: Path) -> str:
    origin = origins.get(str(loc[0])) if loc else None
    if origin == "file":
        return f" (set in {path})"
    if origin == "kept":
        return " (kept from the previous start; `ksi daemon restart --reset` drops it)"
    return ""


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
