"""Identifiers that become file names: validation and model-slugged response ids."""

from __future__ import annotations

import os
import re
from functools import lru_cache

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


@lru_cache(maxsize=1024)  # every request's response id is slugged from its model: a few names
def model_slug(model: str) -> str:
    """`ollama/qwen3:4b` -> `ollama-qwen3-4b`: every unsafe run becomes one `-`."""
    slug = _UNSAFE_RUN.sub("-", model).strip("-")[:SLUG_MAX].rstrip("-")
    return slug or "model"


def random_hex(length: int) -> str:
    """`length` random hex digits (a uuid4 costs a Python object to make and fixes one digit)."""
    return os.urandom((length + 1) // 2).hex()[:length]


def new_response_id(model: str) -> str:
    return f"{model_slug(model)}-{random_hex(12)}"


def new_id(prefix: str, length: int = 12) -> str:
    return f"{prefix}{random_hex(length)}"
