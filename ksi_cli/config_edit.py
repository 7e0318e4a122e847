"""Changing the configuration file one setting at a time, each value checked against the settings
model before anything is written."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from ksi_common.config_file import LOCATING_SETTINGS, config_path, is_secret, template, write_setting
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.kept_settings import forget_kept
from ksi_common.locate import Location
from ksi_common.settings import Settings, refuse_unknown_model_settings, unknown_setting


class GivenOnly(Settings):
    """The settings model reading only what it is given: a value is checked alone, whatever this
    shell's environment holds."""

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def setting_name(key: str) -> str:
    """`KSI_DEFAULT_MODEL`, `default-model` or `default_model` -> `default_model`; refused when no
    setting has that name, or when it is one that locates the file."""
    name = key.strip().lower().replace("-", "_")
    name = name.removeprefix("ksi_")
    if name not in Settings.model_fields:
        raise unknown_setting(key)
    if name in LOCATING_SETTINGS:
        raise KsiError(ErrorCode.CONFIG_FILE_INVALID, f"{name} cannot be set in the configuration file: the file "
                       f"is found from it (set KSI_{name.upper()} or --{name.replace('_', '-')} instead)",
                       setting=name)
    return name


def checked_value(name: str, raw: str, var_dir: Path) -> Any:
    """`raw` as the setting takes it, in the form the file keeps (a number, a list, a table);
    a value that does not fit is refused naming the setting and what it expects."""
    from ksi_common.settings import EXPECTED_FORM

    candidates: list[Any] = [raw]
    try:
        candidates.append(json.loads(raw))  # a table (models) or a JSON list is written as JSON
    except ValueError:
        pass
    problem = ""
    for candidate in candidates:
        try:
            settings = GivenOnly(var_dir=var_dir, **{name: candidate})  # type: ignore[arg-type]
        except ValidationError as exc:
            refuse_unknown_model_settings(exc)
            problem = problem or "; ".join(e["msg"] for e in exc.errors())
            continue
        return _stored_form(settings, name)
    form = EXPECTED_FORM.get(name)
    raise KsiError(ErrorCode.VALIDATION_ERROR, f"KSI_{name.upper()}: {problem}" + (f"; expected {form}" if form else ""),
                   setting=name)


def _stored_form(settings: Settings, name: str) -> Any:
    value = getattr(settings, name)
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    # as written: nested defaults left out, and TOML has no null
    written = settings.model_dump(mode="json", include={name}, exclude_defaults=True)
    return written[name] if name in written else settings.model_dump(mode="json", include={name})[name]


def set_setting(location: Location, key: str, raw: str) -> str:
    """Write one setting; what to tell the user (a secret's value never in it)."""
    name = setting_name(key)
    value = checked_value(name, raw, location.var_dir)
    path = config_path(location.var_dir)
    write_setting(path, name, value)
    forget_kept(location.layout.kept_settings_file, name)  # the file's value applies at the restart
    shown = "(a secret, not shown)" if is_secret(name, value) else json.dumps(value, ensure_ascii=False)
    return f"{name} = {shown} in {path}" + _applies(name)


def unset_setting(location: Location, key: str) -> str:
    name = setting_name(key)
    path = config_path(location.var_dir)
    write_setting(path, name, None)
    forget_kept(location.layout.kept_settings_file, name)
    return f"{name} removed from {path}" + _applies(name)


def _applies(name: str) -> str:
    variable = f"KSI_{name.upper()}"
    said = "; a running daemon applies it at `ksi daemon restart`"
    if os.environ.get(variable) is not None:
        said += f"\nnote: {variable} in this shell's environment overrides the file for what this shell starts"
    return said


def ensure_file(location: Location) -> Path:
    """The configuration file, made (owner-only) with every setting commented out when there is none."""
    path = config_path(location.var_dir)
    if not path.exists():
        from ksi_common.privacy import FILE_MODE, private_dir

        defaults = Settings.model_construct().model_dump(mode="json")
        private_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(template(defaults))
    return path
