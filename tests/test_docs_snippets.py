"""The manual stays true: every code block of README.md and docs/*.md is run or checked, as its
fence says (docs/development.md, "The docs are tested").

- `bash` and `python` blocks run, in order per page, against a daemon the test starts on a fresh
  var dir, serving HTTP, with the echo model; `127.0.0.1:8765` stands for that daemon's address.
- `needs-provider`, `setup` and `example` blocks are checked: bash by `bash -n`, Python compiled.
- Every `ksi` command of every shell block parses, and every event it sends exists.
- `json` blocks parse; a `$ ksi ... --help` block is what the CLI prints.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ksi_cli.main import cli
from ksi_common.client import KsiClient
from tests.test_cli import clean_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.S | re.M)
CHECKED_ONLY = {"needs-provider", "setup", "example"}
DOC_PORT = "8765"  # the address the pages use; each run serves on a free port instead
HELP_WIDTH = 100
BLOCK_TIMEOUT = 180.0


@dataclass(frozen=True)
class Block:
    page: Path
    language: str
    marks: frozenset[str]
    text: str

    @property
    def runnable(self) -> bool:
        return self.language in ("bash", "python") and not self.marks & CHECKED_ONLY

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}: {self.text.splitlines()[0][:60] if self.text else ''}"


def blocks(page: Path) -> list[Block]:
    return [Block(page, language, frozenset(marks.split()), text)
            for language, marks, text in FENCE.findall(page.read_text(encoding="utf-8"))]


def every_block() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def ksi_commands(block: Block) -> list[list[str]]:
    """Each `ksi ...` (or `.venv/bin/ksi ...`) command of a shell block, as words."""
    found = []
    for line in block.text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"\s*(?:&&|\|\|?|;)\s*", line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue  # not a whole command (a quote spanning parts)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words.pop(0)  # VAR=value before the command
            if words and words[0] in ("ksi", ".venv/bin/ksi"):
                found.append([w.strip("[]") for w in words[1:] if "$(" not in w])
    return found


def parse(words: list[str]) -> list[str]:
    """Resolve `words` through the command tree, parsing each level's options; the command path."""
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
    return path


SHELL_BLOCKS = [block for block in every_block() if block.language == "bash"]


def test_the_pages_have_blocks_of_every_kind() -> None:
    found = every_block()
    assert sum(block.runnable for block in found) > 20
    assert any(block.language == "python" and block.runnable for block in found)
    assert {mark for block in found for mark in block.marks} >= CHECKED_ONLY
    assert ["daemon", "start"] in [words for block in SHELL_BLOCKS for words in ksi_commands(block)]


def test_every_block_says_its_language() -> None:
    assert [block.where() for block in every_block() if not block.language] == []


def test_every_mark_is_known() -> None:
    unknown = [(block.where(), sorted(block.marks - CHECKED_ONLY)) for block in every_block()
               if block.marks - CHECKED_ONLY]
    assert unknown == []


def test_every_ksi_command_exists_and_parses() -> None:
    for block in SHELL_BLOCKS:
        for words in ksi_commands(block):
            try:
                parse(words)
            except click.ClickException as exc:
                raise AssertionError(f"{block.where()}: `ksi {shlex.join(words)}`: {exc.format_message()}") from None


async def test_every_event_the_pages_send_exists(client: KsiClient) -> None:
    known = set((await client.request("system:discover"))["events"])
    for block in SHELL_BLOCKS:
        for words in ksi_commands(block):
            if parse(words) in (["send"], ["help"]):
                event = next(w for w in words[1:] if not w.startswith("-") and ":" in w)
                assert event in known, f"{block.where()}: `ksi {shlex.join(words)}`: no event {event}"


def test_shell_blocks_are_valid_bash() -> None:
    for block in SHELL_BLOCKS:
        done = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{block.where()}: {done.stderr}"


def test_python_blocks_compile() -> None:
    for block in (b for b in every_block() if b.language == "python"):
        try:  # a fragment may await at its top level, as in a notebook or an async REPL
            compile(block.text, block.where(), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as exc:
            raise AssertionError(f"{block.where()}: {exc}") from None


def test_json_blocks_parse() -> None:
    for block in (b for b in every_block() if b.language == "json"):
        try:
            json.loads(block.text)
        except ValueError as exc:
            raise AssertionError(f"{block.where()}: {exc}") from None


def test_help_excerpts_match_the_cli() -> None:
    excerpts = [b.text for b in every_block() if b.text.startswith("$ ksi ") and
                b.text.split("\n", 1)[0].endswith("--help")]
    assert excerpts, "the docs show at least one --help"
    for text in excerpts:
        first, expected = text.split("\n", 1)
        words = shlex.split(first[2:])[1:]
        shown = CliRunner().invoke(cli, words, prog_name="ksi", terminal_width=HELP_WIDTH, color=False)
        assert shown.exit_code == 0, shown.output
        actual = "\n".join(line.rstrip() for line in shown.output.strip("\n").splitlines())
        assert actual == expected.strip("\n"), f"the excerpt of `{first[2:]}` differs from the CLI:\n{actual}"


# -- running the pages --------------------------------------------------------------------------

RUN_PAGES = [page for page in PAGES if any(block.runnable for block in blocks(page))]


@dataclass
class Place:
    root: Path
    env: dict[str, str]
    port: str

    def ksi(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(Path(sys.executable).parent / "ksi"), *args], capture_output=True, text=True,
                              env=self.env, cwd=self.root / "work", timeout=120)


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@pytest.fixture
def place() -> Iterator[Place]:
    """A fresh var dir, home and working directory, and a daemon serving HTTP on a free port."""
    root = Path(tempfile.mkdtemp(prefix="ksi-docs-", dir="/tmp"))
    for name in ("work", "home", "state", "llm"):
        (root / name).mkdir()
    bin_dir = str(Path(sys.executable).parent)
    env = clean_env(KSI_VAR_DIR=str(root / "var"), HOME=str(root / "home"), XDG_STATE_HOME=str(root / "state"),
                    LLM_USER_PATH=str(root / "llm"), PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                    NO_COLOR="1")
    served = Place(root, env, _free_port())
    started = served.ksi("daemon", "start", "--http", f"127.0.0.1:{served.port}")
    assert started.returncode == 0, started.stderr + started.stdout
    try:
        yield served
    finally:
        served.ksi("daemon", "stop")
        shutil.rmtree(root, ignore_errors=True)


def run_block(block: Block, place: Place) -> subprocess.CompletedProcess[str]:
    text = block.text.replace(f"127.0.0.1:{DOC_PORT}", f"127.0.0.1:{place.port}")
    if block.language == "bash":
        command = ["bash", "-e", "-o", "pipefail", "-c", text]  # a failure mid-pipe fails the block
    else:
        command = [sys.executable, "-c", text]
    return subprocess.run(command, capture_output=True, text=True, env=place.env, cwd=place.root / "work",
                          timeout=BLOCK_TIMEOUT)


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(page.relative_to(ROOT)) for page in RUN_PAGES])
def test_the_runnable_blocks_of_a_page_run(page: Path, place: Place) -> None:
    for block in (b for b in blocks(page) if b.runnable):
        done = run_block(block, place)
        assert done.returncode == 0, f"{block.where()} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


# -- links ----------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """A heading's anchor as the Markdown renderer makes it: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_every_local_link_reaches_its_page_and_heading() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, heading = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (heading and linked.suffix == ".md" and heading not in anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


# -- short sentences ----------------------------------------------------------------------------

MAX_WORDS = 40


def sentences(page: Path) -> Iterator[str]:
    """The prose of a page, sentence by sentence: code blocks, tables and comments left out,
    inline code counted as one word."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*- )", text):
        if paragraph.lstrip().startswith(("|", "<!--")):
            continue
        prose = re.sub(r"`[^`]*`", "CODE", " ".join(paragraph.split()))
        yield from re.split(r"(?<=[.!?])\s+", prose)


def test_no_sentence_of_the_manual_passes_forty_words() -> None:
    long = [f"{page.relative_to(ROOT)}: {sentence[:80]}..." for page in PAGES
            for sentence in sentences(page) if len(sentence.split()) > MAX_WORDS]
    assert long == []
