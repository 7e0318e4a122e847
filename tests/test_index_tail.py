"""The index tail reader: the newest exchanges that fit a token budget, read from the file's end,
and a forward read (numbering by position) when a legacy bare-id line is met on the way."""

from __future__ import annotations

from pathlib import Path

import orjson

from ksi_common.records import read_index_tail


def write_index(path: Path, lines: list[dict[str, object] | str]) -> Path:
    path.write_bytes(b"".join((orjson.dumps(line) if isinstance(line, dict) else line.encode()) + b"\n"
                              for line in lines))
    return path


def line(n: int, tokens: int, **more: object) -> dict[str, object]:
    return {"n": n, "response_id": f"r{n}", "tokens_in": tokens, "tokens_out": 0, **more}


def test_the_newest_exchanges_that_fit_oldest_first(tmp_path: Path) -> None:
    index = write_index(tmp_path / "c.jsonl", [line(1, 50), line(2, 30), line(3, 20), line(4, 10)])
    entries, total = read_index_tail(index, 60)
    assert [e.n for e in entries] == [2, 3, 4] and total == 4
    assert read_index_tail(index, 5) == ([], 4)  # nothing fits: the count still says how many there are


def test_feedback_lines_cost_nothing_and_are_left_out(tmp_path: Path) -> None:
    index = write_index(tmp_path / "c.jsonl", [line(1, 10), line(2, 10), line(3, 999, is_feedback=True)])
    entries, total = read_index_tail(index, 25)
    assert [e.n for e in entries] == [1, 2] and total == 3


def test_an_empty_index_has_no_tail(tmp_path: Path) -> None:
    assert read_index_tail(write_index(tmp_path / "c.jsonl", []), 100) == ([], 0)


def test_a_legacy_line_within_reach_numbers_the_whole_file_by_position(tmp_path: Path) -> None:
    index = write_index(tmp_path / "c.jsonl", ["old-response", line(2, 10), line(3, 10)])
    entries, total = read_index_tail(index, 100)
    assert [(e.n, e.response_id) for e in entries] == [(1, "old-response"), (2, "r2"), (3, "r3")]
    assert total == 3


def test_a_legacy_line_beyond_the_budget_is_never_read(tmp_path: Path) -> None:
    index = write_index(tmp_path / "c.jsonl", ["old-response", line(2, 40), line(3, 10)])
    entries, total = read_index_tail(index, 15)
    assert [e.n for e in entries] == [3] and total == 3
