"""Small edges of the `ksi` command line: a misspelt command gets a suggestion, `--help` says where
the var dir really is, a quoted value keeps its quotes, an unknown response is not found, and a
path outside the allowed roots names the setting that allows it."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from ksi_cli.main import COMMANDS, cli
from ksi_common.errors import KsiError
from ksi_daemon.services.completion.file_roots import FileRoots
from tests.test_cli import Place, parse_event_args, place  # noqa: F401  (fixture)


@pytest.mark.parametrize(("typed", "meant"), [("sned", "send"), ("chta", "chat"), ("confg", "config")])
def test_a_misspelt_command_gets_a_suggestion(place: Place, typed: str, meant: str) -> None:  # noqa: F811
    result = place.ksi(typed)
    assert result.returncode == 2
    assert f"No such command '{typed}'. (Did you mean '{meant}'?)" in result.stderr


def every_option_help() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    context = click.Context(cli)

    def walk(command: click.Command, path: str) -> None:
        found.extend((f"{path} {p.name}", p.help or "") for p in command.params if isinstance(p, click.Option))
        if isinstance(command, click.Group):
            for name in command.list_commands(context):
                sub = command.get_command(context, name)
                if sub is not None:
                    walk(sub, f"{path} {name}")

    for name in COMMANDS:
        command = cli.get_command(context, name)
        assert command is not None
        walk(command, name)
    return found


def test_no_help_text_says_the_var_dir_defaults_to_a_var_dir_here() -> None:
    helps = every_option_help()
    assert any(name.endswith("var_dir") for name, _ in helps)
    for name, text in helps:
        assert "./var" not in text, name
        if name.endswith(" var_dir"):
            assert "per-user" in text or "KSI_VAR_DIR" in text, (name, text)


def test_a_quoted_value_keeps_its_quotes_and_json_still_parses() -> None:
    assert parse_event_args(["--prompt", '"x"']) == {"prompt": '"x"'}
    assert parse_event_args(["--prompt", 'say "hi"', "--n", "42", "--flag", "--list", "[1, 2]"]) == \
        {"prompt": 'say "hi"', "n": 42, "flag": True, "list": [1, 2]}


def test_an_unknown_response_is_not_found(place: Place) -> None:  # noqa: F811
    for shown in ("echo-default-000000000000", "resp_echo-default-000000000000"):
        result = place.ksi("response", "show", "--var-dir", str(place.var_dir), shown)
        assert result.returncode == 1
        error = json.loads(result.stderr)["error"]
        assert error["code"] == "response_not_found" and error["details"]["response_id"] == shown.removeprefix("resp_")


def test_a_path_outside_the_roots_names_the_setting_that_allows_it(tmp_path: Path) -> None:
    for roots, said in (([tmp_path], f"KSI_ALLOWED_FILE_ROOTS is {tmp_path.resolve()}"),
                        ([], "KSI_ALLOWED_FILE_ROOTS is empty")):
        with pytest.raises(KsiError) as caught:
            FileRoots(roots).resolve("/etc/hostname", "files")
        assert caught.value.code == "path_not_allowed"
        assert said in caught.value.message and "ksi config set allowed_file_roots" in caught.value.message
        assert caught.value.details["setting"] == "KSI_ALLOWED_FILE_ROOTS"
