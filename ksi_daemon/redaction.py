"""The secret values this daemon knows (credentials in its environment and settings), and a
redactor that hides them in any text before it is logged, stored or sent to a client."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

from ksi_common.dburl import url_password
from ksi_common.settings import Settings

# variable names that hold credentials: OPENAI_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...
_CREDENTIAL_NAME = re.compile(r"API_?KEY|_KEY$|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# shorter values are too likely to be ordinary words ("dummy", "true") to be masked everywhere
MIN_SECRET_LENGTH = 8
MASK = "***"


def known_secrets(settings: Settings | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """Credential values from the environment, the settings' own key and the per-model key variables."""
    environ = os.environ if environ is None else environ
    values = [value for name, value in environ.items() if _CREDENTIAL_NAME.search(name)]
    if settings is not None:
        if settings.api_key is not None:
            values.append(settings.api_key.get_secret_value())
        if settings.http_token is not None:
            values.append(settings.http_token.get_secret_value())
        for model in settings.models.values():
            if model.api_key_env and environ.get(model.api_key_env):
                values.append(environ[model.api_key_env])
        if settings.database_url is not None:
            password = url_password(settings.database_url.get_secret_value())
            if password:
                values += [password, quote(password, safe="")]  # as given and as written in the URL
    return values


class Redactor:
    """Replaces every known secret value in a text (or in the strings of a structure) by `***`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        unique = sorted({s for s in secrets if s and len(s) >= MIN_SECRET_LENGTH}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, unique))) if unique else None

    def __call__(self, text: str) -> str:
        if self._pattern is None or not text:
            return text
        return self._pattern.sub(MASK, text)

    def scrub(self, value: Any) -> Any:
        """`value` with secrets hidden in every string it holds (dicts, lists and tuples walked)."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {key: self.scrub(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.scrub(item) for item in value)
        return value
