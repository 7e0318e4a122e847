"""The README stays true: every `ksi` command in its code blocks exists and parses, every event it
sends is one the daemon knows, and every `--help` excerpt is what the CLI prints."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
from click.testing import CliRunner

from ksi_cli.main import cli
from ksi_common.client import KsiClient

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
HELP_WIDTH = 100


def blocks() -> list[str]:
    return BLOCK.findall(README.read_text(encoding="utf-8"))


def ksi_commands() -> list[list[str]]:
    """Each `ksi ...` (or `.venv/bin/ksi ...`) command of the shell blocks, as words."""
    found = []
    for block in blocks():
        if block.startswith("$ "):
            continue  # a help excerpt, checked below
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
            if not line or line.startswith("#"):
                continue
            for part in re.split(r"\s*(?:&&|\|\|?|;)\s*", line):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue  # not shell (JSON, Python)
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                    words.pop(0)  # VAR=value before the command
                if words and words[0] in ("ksi", ".venv/bin/ksi"):
                    found.append([w.strip("[]") for w in words[1:]])  # `[--repair]`: optional, shown
    return found


def parse(words: list[str]) -> tuple[list[str], list[str]]:
    """Resolve `words` through the command tree, parsing each level's options; (command path, rest)."""
    command: click.Command = cli
    context = command.make_context("ksi", list(words), resilient_parsing=False)
    path: list[str] = []
    while isinstance(command, click.Group):
        rest = [*context._protected_args, *context.args]
        if not rest:
            break
        name, rest = rest[0], rest[1:]
        sub = command.get_command(context, name)
        assert sub is not None, f"ksi {' '.join(words)}: no command {name!r}"
        path.append(name)
        command, context = sub, sub.make_context(name, rest, parent=context)
    return path, [*context.params.get("words", ())] if path == ["send"] else []


def test_the_readme_has_commands_to_check() -> None:
    commands = ksi_commands()
    assert len(commands) > 30
    assert ["daemon", "start"] in commands


def test_every_readme_command_exists_and_parses() -> None:
    for words in ksi_commands():
        try:
            parse(words)
        except click.ClickException as exc:
            raise AssertionError(f"README: `ksi {shlex.join(words)}`: {exc.format_message()}") from None


async def test_every_event_the_readme_sends_exists(client: KsiClient) -> None:
    known = set((await client.request("system:discover"))["events"])
    for words in ksi_commands():
        path, _rest = parse(words)
        if path in (["send"], ["help"]):
            event = next(w for w in words[1:] if not w.startswith("-") and ":" in w)
            assert event in known, f"README: `ksi {shlex.join(words)}`: no event {event}"


def test_help_excerpts_match_the_cli() -> None:
    excerpts = [block for block in blocks() if block.startswith("$ ksi ") and block.split("\n", 1)[0].endswith("--help")]
    assert excerpts, "the README shows at least one --help"
    for block in excerpts:
        first, expected = block.split("\n", 1)
        words = shlex.split(first[2:])[1:]
        shown = CliRunner().invoke(cli, words, prog_name="ksi", terminal_width=HELP_WIDTH, color=False)
        assert shown.exit_code == 0, shown.output
        actual = "\n".join(line.rstrip() for line in shown.output.strip("\n").splitlines())
        assert actual == expected.strip("\n"), f"README excerpt of `{first[2:]}` differs from the CLI:\n{actual}"
