"""`ksi doctor` finds exchange numbers that repeat or go back, and `--repair` fixes what is safe:
a line repeated whole is dropped, and a conversation no fork points into is renumbered."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from ksi_cli.main import cli
from ksi_common.layout import VarLayout
from ksi_common.records import read_index


@pytest.fixture(autouse=True)
def owner_only_umask() -> Iterator[None]:
    old = os.umask(0o077)
    yield
    os.umask(old)


def lines(*records: dict[str, Any]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def entry(n: int, response_id: str) -> dict[str, Any]:
    return {"v": 1, "n": n, "response_id": response_id, "tokens_in": 1, "tokens_out": 1}


def var_with_bad_numbering(root: Path) -> VarLayout:
    layout = VarLayout(root / "var")
    for directory in (layout.responses_dir, layout.conversations_dir, layout.conversation_meta_dir):
        directory.mkdir(parents=True)
    for rid in ("r1", "r2", "r3", "r4", "p1", "p2"):
        layout.response_file(rid).write_bytes(lines({"v": 1, "type": "user", "content": rid},
                                                    {"v": 1, "type": "assistant", "content": rid.upper()}))
    layout.index_file("twice").write_bytes(lines(entry(1, "r1"), entry(1, "r2"), entry(2, "r3")))
    layout.index_file("copied").write_bytes(lines(entry(1, "r4"), entry(1, "r4")))
    layout.index_file("parent").write_bytes(lines(entry(1, "p1"), entry(1, "p2")))
    layout.meta_file("child").write_bytes(orjson.dumps({"v": 1, "conversation_id": "child",
                                                        "parent_id": "parent", "fork_at": 1}))
    return layout


def doctor(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["doctor", "--json", *args])
    return result.exit_code, json.loads(result.output)


def test_repeated_and_backward_numbers_are_reported_and_repaired(short_tmp: Path) -> None:
    layout = var_with_bad_numbering(short_tmp)
    code, report = doctor("--var-dir", str(layout.root))
    found = {Path(p["path"]).stem: p for p in report["problems"] if p["kind"] == "index_numbering"}
    assert code == 1 and set(found) == {"twice", "copied", "parent"}
    assert found["twice"]["extra"]["not_increasing"] == [1] and found["twice"]["repairable"]
    assert found["copied"]["extra"]["repeated"] == [1] and found["copied"]["repairable"]
    assert found["parent"]["repairable"] is False  # a fork shares its exchange 1
    code, report = doctor("--var-dir", str(layout.root), "--repair")
    assert sorted(Path(r["path"]).stem for r in report["repaired"]) == ["copied", "twice"]
    assert [(e.n, e.response_id) for e in read_index(layout.index_file("twice"))] == [(1, "r1"), (2, "r2"), (3, "r3")]
    assert [(e.n, e.response_id) for e in read_index(layout.index_file("copied"))] == [(1, "r4")]
    assert [(e.n, e.response_id) for e in read_index(layout.index_file("parent"))] == [(1, "p1"), (1, "p2")]
    assert [Path(p["path"]).stem for p in report["problems"]] == ["parent"]
    assert code == 1
