"""docs/settings.md is what the settings model generates: a setting added, renamed or described
anew without regenerating it fails here, and so does one without a description."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ksi_common.settings import Settings
from ksi_common.settings_reference import COMMAND, reference, type_name, undescribed

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "settings.md"


def test_the_reference_is_what_the_model_generates() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == reference(), f"docs/settings.md is stale: run `{COMMAND}`"


def test_every_setting_has_a_description() -> None:
    assert undescribed() == [], "add a docstring under each of these fields of ksi_common/settings.py"


def test_every_setting_is_listed_by_its_variable() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    for name in Settings.model_fields:
        assert f"| `KSI_{name.upper()}` |" in text


def test_the_command_writes_the_reference() -> None:
    done = subprocess.run([sys.executable, "-m", "ksi_common.settings_reference"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference()


def test_types_read_as_a_person_says_them() -> None:
    fields = Settings.model_fields
    assert type_name(fields["storage"].annotation) == "`jsonl` or `postgres`"
    assert type_name(fields["socket_path"].annotation) == "path or unset"
    assert type_name(fields["allow_uids"].annotation) == "list of integers"
    assert type_name(fields["database_url"].annotation) == "secret or unset"
