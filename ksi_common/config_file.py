"""The daemon's configuration file, `ksi.toml`: where it lives, reading it, changing one setting.

A project daemon's file is inside its var dir; the per-user daemon's is in the XDG config
directory, where a user keeps configuration. Settings are written by their names in the
settings model (`default_model = "echo/default"`), one top-level key each.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ksi_common.dburl import url_password
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.layout import user_var_dir
from ksi_common.privacy import FILE_MODE, private_dir

CONFIG_NAME = "ksi.toml"
# settings that hold a credential: allowed in the file only while no other user may read it
SECRET_SETTINGS = ("api_key", "http_token", "database_url")
# the file is found from these, so it cannot set them
LOCATING_SETTINGS = ("var_dir",)


def user_config_dir(environ: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CONFIG_HOME/ksi`, else `~/.config/ksi`."""
    env = os.environ if environ is None else environ
    config_home = env.get("XDG_CONFIG_HOME") or ""
    base = Path(config_home) if os.path.isabs(config_home) else Path.home() / ".config"
    return base / "ksi"


def config_path(var_dir: Path, environ: Mapping[str, str] | None = None) -> Path:
    """The configuration file of the daemon of `var_dir`."""
    if var_dir.absolute() == user_var_dir(environ).absolute():
        return user_config_dir(environ) / CONFIG_NAME
    return var_dir / CONFIG_NAME


def is_secret(name: str, value: Any) -> bool:
    """Whether `value` of setting `name` is a credential (a database URL only when it has a password)."""
    if name not in SECRET_SETTINGS or value in (None, ""):
        return False
    return name != "database_url" or bool(url_password(str(value)))


def read_config(path: Path) -> dict[str, Any]:
    """The settings written in `path` ({} when there is none), refused when it cannot be trusted."""
    try:
        info = os.stat(path)
        text = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # a var dir that is a file is reported where it is used
        return {}
    except OSError as exc:
        raise KsiError(ErrorCode.CONFIG_FILE_INVALID, f"cannot read {path}: {exc.strerror or exc}",
                       path=str(path)) from None
    import tomllib  # only when there is a file: every `ksi` command looks for one

    try:
        values = tomllib.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KsiError(ErrorCode.CONFIG_FILE_INVALID, f"{path} is not valid TOML: {exc}", path=str(path)) from None
    for name in LOCATING_SETTINGS:
        if name in values:
            raise KsiError(ErrorCode.CONFIG_FILE_INVALID,
                           f"{path} sets {name}, but the file is found from the var dir: set KSI_VAR_DIR "
                           "or --var-dir instead and remove the line", path=str(path), setting=name)
    secrets = [f"KSI_{name.upper()}" for name, value in values.items() if is_secret(name, value)]
    mode = stat.S_IMODE(info.st_mode)
    if secrets and mode & 0o077:
        raise KsiError(ErrorCode.CONFIG_FILE_NOT_PRIVATE,
                       f"{path} holds {', '.join(secrets)} but other users may read it (mode {mode:o}); "
                       f"run: chmod 600 {path}", path=str(path), mode=f"{mode:o}", settings=secrets)
    return values


def write_setting(path: Path, name: str, value: Any) -> None:
    """Set (or, with None, remove) one setting in `path`, keeping the rest of the file and its
    comments; the file is replaced whole and is owner-only (0600)."""
    import tomlkit  # only `ksi config set` writes the file

    document = tomlkit.parse(path.read_text(encoding="utf-8")) if path.exists() else tomlkit.document()
    if value is None:
        document.pop(name, None)
    else:
        document[name] = value
    private_dir(path.parent)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(tomlkit.dumps(document))
        os.chmod(temporary, FILE_MODE)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def template(defaults: Mapping[str, Any]) -> str:
    """A file that sets nothing and names every setting with its default, commented out."""
    import tomlkit

    lines = ["# KSI daemon settings. Uncomment a line to set it; the environment (KSI_*) and",
             "# command-line flags override this file for one start. Restart the daemon to apply.", ""]
    for name, value in defaults.items():
        if name in LOCATING_SETTINGS:
            continue
        if value is None:
            lines.append(f"# {name} =   (unset)")
        elif isinstance(value, dict):  # a table, as a one-line example
            lines.append(f'# {name} = {{ "ollama/*" = {{ api_base = "http://127.0.0.1:11434" }} }}')
        else:
            lines.append(f"# {tomlkit.dumps({name: value}).strip()}")
    return "\n".join(lines) + "\n"
