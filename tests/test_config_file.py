"""The daemon's configuration file (`ksi.toml`): read at start under the environment and flags,
each value's origin, secrets only in an owner-only file, and `ksi config set|unset|edit` (the real
`ksi` CLI as a subprocess; no daemon is started here)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from ksi_common.config_file import CONFIG_NAME, config_path
from ksi_common.errors import KsiError
from ksi_common.settings import Settings, load_settings
from tests.test_cli import Place, clean_env, place  # noqa: F401  (fixture)


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return path


@pytest.fixture
def no_ksi_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KSI_"):
            monkeypatch.delenv(name)


def test_the_file_is_read_under_the_environment_and_flags(tmp_path: Path, no_ksi_env: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / CONFIG_NAME, 'default_model = "echo/file"\nmax_concurrency = 3\nmax_queued = 50\n'
                                  '[models."ollama/*"]\ncontext_window = 4096\n')
    monkeypatch.setenv("KSI_MAX_CONCURRENCY", "5")
    settings = load_settings(var_dir=tmp_path, max_queued=7, _env_file=None)
    assert (settings.default_model, settings.max_concurrency, settings.max_queued) == ("echo/file", 5, 7)
    assert settings.model_settings("ollama/qwen").context_window == 4096
    origins = settings.origins
    assert (origins["default_model"], origins["max_concurrency"], origins["max_queued"]) == ("file", "env", "flag")
    assert origins["models"] == "file" and origins["line_limit"] == "default"
    # what a restart keeps: what the start was given, not what the file says
    assert settings.given_at_start().values == {"max_concurrency": 5, "max_queued": 7}


def test_the_per_user_daemon_reads_its_file_from_the_xdg_config_dir(tmp_path: Path, no_ksi_env: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no marked project var/ above it
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    write(tmp_path / "config" / "ksi" / CONFIG_NAME, 'default_model = "echo/user"\n')
    settings = load_settings(_env_file=None)
    assert settings.var_dir == tmp_path / "state" / "ksi"
    assert settings.config_file == tmp_path / "config" / "ksi" / CONFIG_NAME
    assert settings.default_model == "echo/user" and settings.origins["default_model"] == "file"
    assert config_path(tmp_path / "project" / "var") == tmp_path / "project" / "var" / CONFIG_NAME


@pytest.mark.parametrize(("text", "code", "said"), [
    ("max_concurency = 3\n", "unknown_setting", "did you mean max_concurrency"),
    ('[models."echo/*"]\ncontext_windw = 5\n', "unknown_setting", "'echo/*' (set in"),
    ('[models."echo/*"]\napi_key = "sk-in-the-clear"\n', "unknown_setting", "did you mean api_key_env"),
    ('var_dir = "/elsewhere"\n', "config_file_invalid", "found from the var dir"),
    ("default_model = \n", "config_file_invalid", "not valid TOML"),
    ("max_concurrency = -3\n", "validation_error", "KSI_MAX_CONCURRENCY: Input should be greater than 0 (set in"),
])
def test_a_file_that_does_not_fit_is_refused_naming_it(tmp_path: Path, no_ksi_env: None, text: str, code: str,
                                                       said: str) -> None:
    path = write(tmp_path / CONFIG_NAME, text)
    with pytest.raises(KsiError) as caught:
        load_settings(var_dir=tmp_path, _env_file=None)
    assert caught.value.code == code
    assert said in caught.value.message and str(path) in caught.value.message


@pytest.mark.parametrize(("line", "variable"), [
    ('api_key = "sk-file-secret-4711"', "KSI_API_KEY"),
    ('http_token = "file-secret-4711-long-enough-token"', "KSI_HTTP_TOKEN"),
    ('database_url = "postgresql://ksi:file-secret-4711@db/ksi"', "KSI_DATABASE_URL"),
])
def test_a_secret_lives_only_in_an_owner_only_file(tmp_path: Path, no_ksi_env: None, line: str,
                                                   variable: str) -> None:
    path = write(tmp_path / CONFIG_NAME, line + "\n", mode=0o640)
    with pytest.raises(KsiError) as caught:
        load_settings(var_dir=tmp_path, _env_file=None)
    assert caught.value.code == "config_file_not_private"
    assert variable in caught.value.message and f"chmod 600 {path}" in caught.value.message
    assert "file-secret-4711" not in caught.value.message
    os.chmod(path, 0o600)
    view = load_settings(var_dir=tmp_path, _env_file=None).public_view()
    assert "file-secret-4711" not in json.dumps(view)


def test_a_database_url_without_a_password_is_no_secret(tmp_path: Path, no_ksi_env: None) -> None:
    write(tmp_path / CONFIG_NAME, 'database_url = "postgresql:///ksi?host=/run/postgresql"\n', mode=0o644)
    assert load_settings(var_dir=tmp_path, _env_file=None).database_url is not None


# -- ksi config, as a user runs it ---------------------------------------------------


def config_file(where: Place) -> Path:
    return where.var_dir / CONFIG_NAME


def test_config_set_writes_checked_typed_values_and_keeps_comments(place: Place) -> None:  # noqa: F811
    write(config_file(place), "# my own notes\ndefault_model = \"echo/old\"  # the old one\n")
    for key, value in (("default_model", "echo/new"), ("KSI_MAX_CONCURRENCY", "4"),
                       ("allowed-file-roots", "/srv/a:/srv/b"), ("models", '{"ollama/*": {"context_window": 4096}}'),
                       ("http_addr", "127.0.0.1:8765")):
        result = place.ksi("config", "set", "--var-dir", str(place.var_dir), key, value)
        assert result.returncode == 0, result.stderr
        assert "ksi daemon restart" in result.stdout
    text = config_file(place).read_text()
    assert "# my own notes" in text
    assert stat.S_IMODE(config_file(place).stat().st_mode) == 0o600
    settings = load_settings(var_dir=place.var_dir, _env_file=None)
    assert settings.default_model == "echo/new" and settings.max_concurrency == 4
    assert settings.allowed_file_roots == [Path("/srv/a"), Path("/srv/b")]
    assert settings.model_settings("ollama/x").context_window == 4096
    assert settings.http_addr == "127.0.0.1:8765"
    unset = place.ksi("config", "unset", "--var-dir", str(place.var_dir), "http_addr")
    assert unset.returncode == 0 and "http_addr" not in config_file(place).read_text()


@pytest.mark.parametrize(("key", "value", "code"), [
    ("max_concurency", "3", "unknown_setting"),
    ("models", '{"echo/*": {"context_windw": 1000}}', "unknown_setting"),
    ("max_concurrency", "-3", "validation_error"),
    ("models", "{not json", "validation_error"),
    ("var_dir", "/elsewhere", "config_file_invalid"),
])
def test_config_set_refuses_what_does_not_fit_and_writes_nothing(place: Place, key: str, value: str,  # noqa: F811
                                                                 code: str) -> None:
    before = write(config_file(place), 'default_model = "echo/kept"\n').read_bytes()
    result = place.ksi("config", "set", "--var-dir", str(place.var_dir), key, value)
    assert result.returncode == 2
    assert json.loads(result.stderr)["error"]["code"] == code
    assert config_file(place).read_bytes() == before


def test_a_secret_set_from_standard_input_is_never_printed(place: Place) -> None:  # noqa: F811
    import subprocess

    result = subprocess.run([sys.executable, "-m", "ksi_cli", "config", "set", "--var-dir", str(place.var_dir),
                             "api_key", "-"], input="sk-typed-secret-4711\n", cwd=place.root, env=clean_env(),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "sk-typed-secret-4711" not in result.stdout + result.stderr and "not shown" in result.stdout
    assert stat.S_IMODE(config_file(place).stat().st_mode) == 0o600
    shown = place.ksi("config", "show", "--origin", "--var-dir", str(place.var_dir), "--socket", str(place.socket))
    assert shown.returncode == 0, shown.stderr
    assert "sk-typed-secret-4711" not in shown.stdout
    answer = json.loads(shown.stdout)
    assert answer["settings"]["api_key"] == "***" and answer["origins"]["api_key"] == "file"


def test_config_show_origin_says_where_each_value_came_from(place: Place) -> None:  # noqa: F811
    write(config_file(place), 'default_model = "echo/file"\nmax_queued = 50\n')
    result = place.ksi("config", "show", "--origin", "--var-dir", str(place.var_dir), "--socket", str(place.socket),
                       env=clean_env(KSI_MAX_QUEUED="60"))
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["config_file"] == str(config_file(place))
    assert answer["settings"]["default_model"] == "echo/file" and answer["origins"]["default_model"] == "file"
    assert answer["settings"]["max_queued"] == 60 and answer["origins"]["max_queued"] == "env"
    assert answer["origins"]["line_limit"] == "default"


def test_config_show_origin_names_the_environment_for_a_var_dir_it_gave(place: Place) -> None:  # noqa: F811
    by_env = place.ksi("config", "show", "--origin", env=clean_env(KSI_VAR_DIR=str(place.var_dir)))
    assert by_env.returncode == 0, by_env.stderr
    answer = json.loads(by_env.stdout)
    assert answer["settings"]["var_dir"] == str(place.var_dir)
    assert (answer["origins"]["var_dir"], answer["origins"]["socket_path"]) == ("env", "default")
    by_flag = place.ksi("config", "show", "--origin", "--var-dir", str(place.var_dir))
    assert json.loads(by_flag.stdout)["origins"]["var_dir"] == "flag"


def test_config_edit_opens_a_file_naming_every_setting_and_checks_it(place: Place) -> None:  # noqa: F811
    editor = place.root / "editor.sh"
    write(editor, '#!/bin/sh\nprintf \'max_queued = 77\\n\' >> "$1"\n', mode=0o700)
    result = place.ksi("config", "edit", "--var-dir", str(place.var_dir), env=clean_env(EDITOR=str(editor),
                                                                                     VISUAL=""))
    assert result.returncode == 0, result.stderr
    text = config_file(place).read_text()
    for name in Settings.model_fields:
        if name != "var_dir":
            assert f"# {name} =" in text, name
    assert load_settings(var_dir=place.var_dir, _env_file=None).max_queued == 77
    write(editor, '#!/bin/sh\nprintf \'max_queued = -1\\n\' >> "$1"\n', mode=0o700)
    again = place.ksi("config", "edit", "--var-dir", str(place.var_dir), env=clean_env(EDITOR=str(editor), VISUAL=""))
    assert again.returncode == 1 and "config_file_invalid" in again.stderr  # a key written twice is not TOML


def test_the_cli_finds_the_daemon_where_the_file_puts_its_socket(place: Place) -> None:  # noqa: F811
    elsewhere = place.root / "elsewhere.sock"
    write(config_file(place), f'socket_path = "{elsewhere}"\n')
    status = place.ksi("daemon", "status", "--var-dir", str(place.var_dir))
    assert status.returncode == 3
    assert f"nothing answers at {elsewhere}" in status.stderr
