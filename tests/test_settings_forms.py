"""List settings in the plain form users write (`KSI_ALLOWED_FILE_ROOTS=/a:/b`) as well as JSON,
and settings errors that name the variable and the form it expects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ksi_common.errors import KsiError
from ksi_common.settings import load_settings
from tests.test_cli import Place, clean_env, place  # noqa: F401  (fixture)


@pytest.mark.parametrize(("name", "value", "field", "expected"), [
    ("KSI_ALLOWED_FILE_ROOTS", "/srv/docs:/home/me/src", "allowed_file_roots", [Path("/srv/docs"), Path("/home/me/src")]),
    ("KSI_ALLOWED_FILE_ROOTS", '["/srv/docs", "/home/me/src"]', "allowed_file_roots",
     [Path("/srv/docs"), Path("/home/me/src")]),
    ("KSI_ALLOWED_FILE_ROOTS", "/srv/docs", "allowed_file_roots", [Path("/srv/docs")]),
    ("KSI_ALLOW_UIDS", "1001,1002", "allow_uids", [1001, 1002]),
    ("KSI_ALLOW_UIDS", "[1001, 1002]", "allow_uids", [1001, 1002]),
    ("KSI_ALLOW_UIDS", "", "allow_uids", []),
])
def test_list_settings_take_the_plain_form_and_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str,
                                                    value: str, field: str, expected: list[object]) -> None:
    monkeypatch.setenv(name, value)
    assert getattr(load_settings(var_dir=tmp_path, _env_file=None), field) == expected


@pytest.mark.parametrize(("name", "value", "form"), [
    ("KSI_ALLOWED_FILE_ROOTS", '["/srv/docs"', "directories separated by ':'"),
    ("KSI_ALLOW_UIDS", "1001,me", "user ids separated by commas"),
    ("KSI_MODELS", "{not json", "a JSON object from a model pattern"),
])
def test_a_value_that_does_not_fit_names_the_variable_and_the_form(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str, form: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(KsiError) as caught:
        load_settings(var_dir=tmp_path, _env_file=None)
    assert caught.value.code == "validation_error"
    assert name in caught.value.message and form in caught.value.message
    assert any(field.startswith(name) for field in caught.value.details["fields"])


def test_ksi_config_shows_the_plain_form_read_and_a_start_refuses_a_bad_one(place: Place) -> None:  # noqa: F811
    shown = place.ksi("config", "--json", *place.where, env=clean_env(KSI_ALLOWED_FILE_ROOTS="/srv/docs:/tmp"))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["allowed_file_roots"] == ["/srv/docs", "/tmp"]
    refused = place.ksi("daemon", "start", *place.where, env=clean_env(KSI_ALLOW_UIDS="1001;1002"))
    assert refused.returncode == 2
    assert "KSI_ALLOW_UIDS" in refused.stderr and "separated by commas" in refused.stderr
    assert not place.socket.exists()


def test_a_typo_in_a_model_table_from_the_environment_is_refused_with_the_close_name(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KSI_MODELS", '{"echo/*": {"context_windw": 1000}}')
    with pytest.raises(KsiError) as caught:
        load_settings(var_dir=tmp_path, _env_file=None)
    assert caught.value.code == "unknown_setting"
    assert "'echo/*'" in caught.value.message and caught.value.details["similar"] == ["context_window"]
