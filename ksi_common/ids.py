"""Identifiers that become file names: validation and model-slugged response ids."""

from __future__ import annotations

import re
import uuid

from ksi_common.errors import ErrorCode, KsiError

_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9_-]+")
SLUG_MAX = 64


def is_safe_id(value: str) -> bool:
    return bool(_SAFE_ID.fullmatch(value)) and ".." not in value


def check_id(value: str, field: str) -> str:
    """Return `value` if it may name a file, else raise `validation_error` naming `field`."""
    if not is_safe_id(value):
        raise KsiError(
            ErrorCode.VALIDATION_ERROR,
            f"{field} must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,127}} without '..'",
            fields={field: "invalid identifier"},
        )
    return value


def model_slug(model: str) -> str:
    """`ollama/qwen3:4b` -> `ollama-qwen3-4b`: every unsafe run becomes one `-`."""
    slug = _UNSAFE_RUN.sub("-", model).strip("-")[:SLUG_MAX].rstrip("-")
    return slug or "model"


def new_response_id(model: str) -> str:
    return f"{model_slug(model)}-{uuid.uuid4().hex[:12]}"


def new_id(prefix: str, length: int = 12) -> str:
    return f"{prefix}{uuid.uuid4().hex[:length]}"
