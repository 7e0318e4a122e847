"""Base types for event payloads, and their self-description for discover and help."""

from __future__ import annotations

import difflib
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import is_safe_id
from ksi_common.limits import MAX_MODEL_NAME


def _as_text(value: Any) -> Any:
    # `ksi send ... --prompt 42` arrives as a number; a string field takes it as text.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value


def check_safe_id(value: str) -> str:
    """An id that may become part of a file name (a conversation's, an agent's, ...)."""
    if not is_safe_id(value):
        raise ValueError("must match [A-Za-z0-9][A-Za-z0-9_.-]{0,127} without '..'")
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain a NUL byte")
    return value


def check_model_name(value: str) -> str:
    """A model name as it may be stored and sent: bounded, without NUL or other control characters."""
    if len(value) > MAX_MODEL_NAME:
        raise ValueError(f"a model name has at most {MAX_MODEL_NAME} characters ({len(value)} given)")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value):
        raise ValueError("a model name must not contain NUL or other control characters")
    return value


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


Text = Annotated[str, BeforeValidator(_as_text)]
# an id that may become part of a file name
SafeId = Annotated[str, BeforeValidator(_as_text), AfterValidator(check_safe_id)]
# a file system path: no NUL byte, which no path can hold
PathText = Annotated[str, BeforeValidator(_as_text), AfterValidator(_no_nul)]
# a model name (or a glob of them): checked where it enters, so none reaches a provider, a log or storage
ModelName = Annotated[str, BeforeValidator(_as_text), AfterValidator(check_model_name)]
# text that must hold more than white space
NonBlank = Annotated[str, BeforeValidator(_as_text), AfterValidator(_not_blank)]
# the front door a request came through, recorded on the conversation it creates
Door = Literal["cli", "http", "mcp", "llm", "agent", "console"]


class EventData(BaseModel):
    """Payload of an event; unknown fields are refused so typos do not pass silently."""

    # NaN and infinities have no JSON form; some front doors' parsers accept them all the same
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False, allow_inf_nan=False)


class NoData(EventData):
    pass


def validate(model: type[EventData], data: Any) -> EventData:
    """Validate `data`, turning pydantic's error into `validation_error` naming the fields."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        fields = {}
        for error in exc.errors(include_url=False):
            location = ".".join(str(part) for part in error["loc"]) or "data"
            fields[location] = own_words(error)
            if error["type"] == "extra_forbidden" and len(error["loc"]) == 1:  # a misspelt field, most often
                fields[location] += _closest_field(model, str(error["loc"][0]))
        raise KsiError(
            ErrorCode.VALIDATION_ERROR,
            "invalid data: " + "; ".join(f"{k}: {v}" for k, v in fields.items()),
            fields=fields,
        ) from None


def own_words(error: Any) -> str:
    """A validation error's message without pydantic's "Value error, " before a validator's own sentence."""
    message = str(error["msg"])
    if error.get("type") == "value_error":
        return message.removeprefix("Value error, ")
    return message


def _closest_field(model: type[EventData], name: str) -> str:
    """"; did you mean prompt?" for `promt`, or nothing when no field is close."""
    if len(name) > 100:
        return ""
    known = dict.fromkeys(n for field, info in model.model_fields.items() for n in (field, info.alias) if n)
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def type_name(annotation: Any) -> str:
    """A readable type: `str | None`, `list[InputMessage]`, `"user" | "system"`."""
    if annotation is type(None):
        return "None"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else getattr(origin, "__name__", "")
    return getattr(annotation, "__name__", str(annotation))


def describe_fields(model: type[EventData]) -> dict[str, dict[str, Any]]:
    """Each field's type, default, whether it is required and its description."""
    described = {}
    for name, field in model.model_fields.items():
        entry: dict[str, Any] = {
            "type": type_name(field.annotation),
            "required": field.is_required(),
            "description": field.description or "",
        }
        if not field.is_required():
            default = field.get_default(call_default_factory=True)
            entry["default"] = default if isinstance(default, str | int | float | bool | None | list | dict) else str(default)
        described[name] = entry
    return described
