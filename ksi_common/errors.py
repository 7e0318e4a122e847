"""The one error type of KSI: a stable code, a message and structured details."""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNKNOWN_EVENT = "unknown_event"
    VALIDATION_ERROR = "validation_error"
    AGENT_NOT_FOUND = "agent_not_found"
    AGENT_EXISTS = "agent_exists"
    AGENT_TERMINATED = "agent_terminated"
    PROFILE_NOT_FOUND = "profile_not_found"
    CONVERSATION_NOT_FOUND = "conversation_not_found"
    CONVERSATION_EXPIRED = "conversation_expired"
    CONVERSATION_FULL = "conversation_full"
    CONVERSATION_ARCHIVED = "conversation_archived"
    CONTEXT_WINDOW_EXCEEDED = "context_window_exceeded"
    PROVIDER_ERROR = "provider_error"
    PROVIDER_UNAVAILABLE = "provider_unavailable"
    RATE_LIMITED = "rate_limited"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL_ERROR = "internal_error"
    REQUEST_NOT_FOUND = "request_not_found"
    CONSORTIUM_NOT_FOUND = "consortium_not_found"
    PATH_NOT_ALLOWED = "path_not_allowed"
    FORK_CYCLE = "fork_cycle"
    OVERLOADED = "overloaded"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    DAEMON_RESTART = "daemon_restart"
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    RESPONSE_NOT_FOUND = "response_not_found"
    PREVIOUS_RESPONSE_IN_PROGRESS = "previous_response_in_progress"  # continued after a response still running
    RESPONSE_NOT_DELETABLE = "response_not_deletable"
    UNAUTHORIZED = "unauthorized"  # HTTP: a missing or wrong bearer token
    TOO_MANY_LOGIN_ATTEMPTS = "too_many_login_attempts"  # HTTP: wrong console login codes past their rate
    NOT_FOUND = "not_found"  # HTTP: no such route
    METHOD_NOT_ALLOWED = "method_not_allowed"
    STORAGE_UNAVAILABLE = "storage_unavailable"
    STORAGE_ERROR = "storage_error"
    STORAGE_FULL = "storage_full"  # no space (or quota) left where the backend writes
    STORAGE_SYMLINK = "storage_symlink"  # a file or directory of the var dir is a symbolic link: never followed
    CONVERSATION_EXISTS = "conversation_exists"
    CROSS_SITE_REQUEST = "cross_site_request"  # HTTP: a browser session's change sent from another page
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # HTTP: a body in a type the route does not read; an image not PNG, JPEG, GIF or WebP
    MODEL_NOT_FOUND = "model_not_found"  # no provider answers to the name (KSI's words, closest names)
    API_KEY_MISSING = "api_key_missing"  # the provider needs a key the daemon's environment lacks
    PINS_OVER_BUDGET = "pins_over_budget"  # pinned exchanges would take more than their share of a turn
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a request option KSI refuses rather than drop (tools, n > 1)
    IMAGE_TOO_LARGE = "image_too_large"  # an image of a request over KSI_MAX_IMAGE_BYTES
    IMAGE_NOT_STORED = "image_not_stored"  # an imported image names bytes this daemon's blob store lacks
    # exchange items a document (an import) holds
    UNKNOWN_ITEM_TYPE = "unknown_item_type"  # an item (or message part) of a type KSI does not know
    UNKNOWN_CALL_ID = "unknown_call_id"  # a function_call_output for a call no earlier exchange made
    DUPLICATE_CALL_ID = "duplicate_call_id"  # two calls with one id, or one call answered twice
    CALL_NOT_OPEN = "call_not_open"  # abandoning a call the conversation does not wait for
    TURN_IN_PROGRESS = "turn_in_progress"  # a change refused while a request is queued or running on the conversation
    ARGUMENTS_NOT_JSON = "arguments_not_json"  # a function_call's arguments are not JSON text
    HISTORY_MISMATCH = "history_mismatch"  # a client-held history contradicts the conversation it names
    ITEM_NOT_FOUND = "item_not_found"  # an item_reference naming no stored item the request may see
    RESPONSE_NOT_CANCELLABLE = "response_not_cancellable"  # only a queued or running background response is
    STREAM_NOT_FOUND = "stream_not_found"  # a response whose events are not kept (not background, or long ended)
    STARTING_AFTER_OUT_OF_RANGE = "starting_after_out_of_range"  # past the last event of an ended stream
    LEASE_LOST = "lease_lost"  # a daemon paused past its conversation's lease: another took the turn over
    # the configuration file (ksi.toml)
    CONFIG_FILE_INVALID = "config_file_invalid"  # not TOML, unreadable, or setting what locates it (var_dir)
    CONFIG_FILE_NOT_PRIVATE = "config_file_not_private"  # it holds a secret while other users may read it
    UNKNOWN_SETTING = "unknown_setting"  # a name no setting has (with the closest names)
    # client-side only
    DAEMON_UNREACHABLE = "daemon_unreachable"
    VAR_DIR_INVALID = "var_dir_invalid"  # the var dir named is a file (or other non-directory)


class KsiError(Exception):
    """A failure the user should see: `code` is stable, `details` is structured."""

    def __init__(self, code: ErrorCode | str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = str(code)
        self.message = message
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}

    @classmethod
    def from_wire(cls, error: dict[str, Any]) -> KsiError:
        return cls(
            error.get("code", ErrorCode.INTERNAL_ERROR),
            error.get("message", ""),
            **(error.get("details") or {}),
        )

    def __repr__(self) -> str:
        return f"KsiError({self.code!r}, {self.message!r})"
