"""The settings reference, generated from the settings model: `python -m ksi_common.settings_reference
> docs/settings.md`. The file is never edited by hand; a test fails when it and the model drift."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ksi_common.settings import ModelSettings, Settings

COMMAND = "python -m ksi_common.settings_reference > docs/settings.md"
SCALAR_NAMES = {str: "text", int: "integer", float: "number", bool: "boolean", Path: "path", SecretStr: "secret"}

HEADER = f"""# Settings reference

<!-- Generated from ksi_common/settings.py by `{COMMAND}`. Do not edit: change the model, then run it. -->

Each setting of the daemon has a name below, which is also its environment variable.
The daemon reads its settings once, when it starts; [configuration.md](configuration.md) says where
they may be kept and which source wins. The environment (or a `.env` file in the directory the
daemon starts in) always works. A value that does not fit stops the start with one line naming
the setting. Lists take the form you would write in a shell (`/a:/b`, `1001,1002`) or JSON.
Secrets are never shown: `ksi config` masks them. A bound after a type (`> 0`, `<= 1`) is checked.

## Daemon settings

"""


def type_name(annotation: Any) -> str:
    """A type as a reader of the docs says it: `integer`, `path or unset`, `` `jsonl` or `postgres` ``."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(arguments[0])
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in arguments if a is not type(None)]
        unset = " or unset" if type(None) in arguments else ""
        return " or ".join(named) + unset
    if origin is Literal:
        return " or ".join(f"`{value}`" for value in arguments)
    if origin is list:
        return f"list of {type_name(arguments[0])}s"
    if origin is dict:
        return "JSON object"
    return SCALAR_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def bounds(field: FieldInfo) -> str:
    """The field's numeric bounds as written after its type: `> 0`, `>= 0, <= 1`."""
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    found = [f"{sign} {getattr(rule, name)}" for rule in field.metadata for name, sign in signs.items()
             if getattr(rule, name, None) is not None]
    return f" ({', '.join(found)})" if found else ""


def default_text(field: FieldInfo) -> str:
    if field.default_factory in (list, dict):
        return "`[]`" if field.default_factory is list else "`{}`"
    if field.default_factory is not None:
        return "see the description"  # found when the daemon starts (the var dir)
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def one_line(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def table(model: type[BaseModel], heading: str, name_of: typing.Callable[[str], str]) -> list[str]:
    lines = [f"| {heading} | Type | Default | What it does |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        kind = type_name(field.annotation) + bounds(field)
        lines.append(f"| `{name_of(name)}` | {kind} | {default_text(field)} "
                     f"| {one_line(field.description)} |")
    return lines


def reference() -> str:
    """The whole of docs/settings.md."""
    lines = [*table(Settings, "Setting", lambda name: f"KSI_{name.upper()}")]
    lines += ["", "## Keys of a `KSI_MODELS` entry", "",
              "`KSI_MODELS` maps a glob pattern on the model name to these keys. The most specific "
              "pattern wins: the exact name first, then the longest pattern.", "",
              "```bash", """KSI_MODELS='{"ollama/*": {"api_base": "http://127.0.0.1:11434", "context_window": 32768}}'""",
              "```", ""]
    lines += table(ModelSettings, "Key", lambda name: name)
    return HEADER + "\n".join(lines) + "\n"


def undescribed() -> list[str]:
    """Settings without a description: each needs a docstring under its field."""
    return [name for model in (Settings, ModelSettings) for name, field in model.model_fields.items()
            if not one_line(field.description)]


if __name__ == "__main__":
    print(reference(), end="")
