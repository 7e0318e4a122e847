"""`ksi doctor` on var dirs built with damage: what it reports, what --repair fixes (and what it
never touches), and that it refuses to repair under a running daemon."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from ksi_cli.doctor import truncate_torn_tail
from ksi_cli.main import cli
from ksi_common import doctor as checks
from ksi_common.layout import VarLayout
from ksi_common.locate import Location
from ksi_common.records import read_index
from tests.conftest import connected, running_daemon


@pytest.fixture(autouse=True)
def owner_only_umask() -> Iterator[None]:
    """Var dirs built by hand here are owner-only, as the daemon makes them (loose modes are a
    finding of their own, tested in test_privacy.py)."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def lines(*records: dict[str, Any]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def user(text: str) -> dict[str, Any]:
    return {"v": 1, "type": "user", "content": text}


def answer(text: str) -> dict[str, Any]:
    return {"v": 1, "type": "assistant", "content": text, "model": "echo/x"}


def entry(n: int, response_id: str) -> dict[str, Any]:
    return {"v": 1, "n": n, "response_id": response_id, "tokens_in": 1, "tokens_out": 1}


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def damaged_var(root: Path) -> VarLayout:
    """A var dir with one of every problem the doctor knows."""
    layout = VarLayout(root / "var")
    for directory in (layout.responses_dir, layout.conversations_dir, layout.state_dir, layout.consortium_dir):
        directory.mkdir(parents=True)
    layout.run_dir.mkdir(parents=True)
    layout.run_dir.chmod(0o777)
    layout.pid_file.write_text(f"{dead_pid()}\n")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(layout.default_socket))
    stale.close()  # the file stays, nobody listens
    responses = {
        "ok-1": lines(user("a"), answer("A")),
        "no-answer-3": lines(user("c")),
        "ok-4": lines(user("d"), answer("D")),
        "torn-5": lines(user("e")) + b'{"v": 1, "type": "assistant", "content": "cut',
        "orphan-6": lines(user("f"), answer("F")),
        "failed-7": lines(user("g"), {"v": 1, "type": "error", "code": "timeout"}),
        "member-8": lines({**user("h"), "run_id": "run-1"}, {**answer("H"), "run_id": "run-1", "role": "member"}),
    }
    for response_id, data in responses.items():
        layout.response_file(response_id).write_bytes(data)
    layout.index_file("c1").write_bytes(lines(entry(1, "ok-1"), entry(2, "missing-2"), entry(3, "no-answer-3")))
    layout.index_file("c2").write_bytes(lines(entry(1, "ok-4")) + b'{"v": 1, "n": 2, "response_id": "torn-5"')
    layout.requests_file.write_bytes(lines({"request_id": "r1", "status": "queued"}) + b'{"request_id": "r1", "st')
    return layout


def doctor(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["doctor", "--json", *args])
    return result.exit_code, json.loads(result.output)


def kinds(findings: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((f["kind"], Path(f["path"]).name) for f in findings)


def test_doctor_reports_every_kind_of_damage(short_tmp: Path) -> None:
    layout = damaged_var(short_tmp)
    code, report = doctor("--var-dir", str(layout.root))
    assert code == 1 and report["ok"] is False
    assert kinds(report["problems"]) == [
        ("dangling_entry", "c1.jsonl"), ("dangling_entry", "c1.jsonl"),
        ("run_dir_permissions", "run"),
        ("stale_pid", "daemon.pid"), ("stale_socket", "daemon.sock"),
        ("torn_tail", "c2.jsonl"), ("torn_tail", "requests.jsonl"), ("torn_tail", "torn-5.jsonl"),
    ]
    dangling = {f["extra"]["response_id"]: f["extra"]["reason"] for f in report["problems"]
                if f["kind"] == "dangling_entry"}
    assert dangling == {"missing-2": "missing", "no-answer-3": "no_assistant"}
    # not referenced by an index, and neither a failure nor a consortium member: reported, not a problem
    assert kinds(report["orphans"]) == [("orphan_response", "orphan-6.jsonl"), ("orphan_response", "torn-5.jsonl")]
    assert report["counts"]["responses"] == 7


def test_repair_fixes_what_is_safe_and_deletes_no_response(short_tmp: Path) -> None:
    layout = damaged_var(short_tmp)
    responses_before = sorted(p.name for p in layout.responses_dir.iterdir())
    code, report = doctor("--var-dir", str(layout.root), "--repair")
    assert kinds(report["repaired"]) == [
        ("run_dir_permissions", "run"), ("stale_pid", "daemon.pid"), ("stale_socket", "daemon.sock"),
        ("torn_tail", "c2.jsonl"), ("torn_tail", "requests.jsonl"), ("torn_tail", "torn-5.jsonl"),
    ]
    # dangling entries cannot be repaired safely: still reported, still exit 1
    assert code == 1 and kinds(report["problems"]) == [("dangling_entry", "c1.jsonl")] * 2
    assert stat.S_IMODE(layout.run_dir.stat().st_mode) == 0o700
    assert not layout.pid_file.exists() and not layout.default_socket.exists()
    assert sorted(p.name for p in layout.responses_dir.iterdir()) == responses_before
    assert layout.index_file("c2").read_bytes() == lines(entry(1, "ok-4"))
    assert [e.response_id for e in read_index(layout.index_file("c1"))] == ["ok-1", "missing-2", "no-answer-3"]
    assert layout.response_file("torn-5").read_bytes() == lines(user("e"))
    assert layout.requests_file.read_bytes() == lines({"request_id": "r1", "status": "queued"})
    # a second repair has nothing left to do
    code, again = doctor("--var-dir", str(layout.root), "--repair")
    assert again["repaired"] == [] and code == 1


def test_clean_var_dir_exits_zero(short_tmp: Path) -> None:
    layout = VarLayout(short_tmp / "var")
    layout.responses_dir.mkdir(parents=True)
    layout.conversations_dir.mkdir(parents=True)
    layout.run_dir.mkdir(mode=0o700)
    layout.response_file("ok-1").write_bytes(lines(user("a"), answer("A")))
    layout.index_file("c").write_bytes(lines(entry(1, "ok-1")))
    code, report = doctor("--var-dir", str(layout.root))
    assert code == 0 and report["ok"] is True and report["problems"] == [] and report["orphans"] == []
    assert report["counts"]["index_entries"] == 1


async def test_clean_after_a_real_daemon_and_refuses_repair_while_it_runs(short_tmp: Path) -> None:
    async with running_daemon(short_tmp, socket_path=None) as daemon:
        async with connected(daemon) as client:
            ack = await client.request("completion:async", {"prompt": "hi", "model": "echo/x"})
            await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 30})
        layout = daemon.layout
        (index,) = layout.conversations_dir.glob("*.jsonl")
        with open(index, "ab") as handle:
            handle.write(b'{"v": 1, "n": 2, "resp')  # as a crash would leave it
        code, report = doctor("--var-dir", str(layout.root))
        assert code == 1 and kinds(report["problems"]) == [("torn_tail", index.name)]
        # the daemon holds the lock and answers on its socket: no repair under its feet
        result = CliRunner().invoke(cli, ["doctor", "--json", "--var-dir", str(layout.root), "--repair"])
        assert result.exit_code == 1
        assert json.loads(result.output)["error"]["code"] == "daemon_running"
        assert index.read_bytes().endswith(b'"resp')
        # the same from another process, which sees the lock held
        other = subprocess.run([sys.executable, "-m", "ksi_cli", "doctor", "--json", "--var-dir", str(layout.root),
                                "--socket", str(short_tmp / "nothing.sock"), "--repair"],
                               capture_output=True, text=True, timeout=30, cwd=short_tmp)
        assert other.returncode == 1 and json.loads(other.stderr)["error"]["code"] == "daemon_running"
    code, report = doctor("--var-dir", str(layout.root), "--repair")
    assert code == 0 and report["repaired"][0]["kind"] == "torn_tail"
    assert report["counts"]["index_entries"] == 1 and report["orphans"] == []


def test_missing_var_dir_is_an_error(short_tmp: Path) -> None:
    result = CliRunner().invoke(cli, ["doctor", "--json", "--var-dir", str(short_tmp / "nope")])
    assert result.exit_code == 1 and json.loads(result.output)["error"]["code"] == "var_dir_missing"


def test_pretty_report_names_problems_and_orphans(short_tmp: Path) -> None:
    from ksi_cli.doctor import _print_report

    layout = damaged_var(short_tmp)
    runner = CliRunner()
    with runner.isolation() as (out, _err, *_rest):
        _print_report(checks.check(layout.root), [], Location(layout.root, layout.run_dir / "daemon.sock"))
    text = out.getvalue().decode()
    assert "torn_tail" in text and "(--repair fixes it)" in text and "orphan-6.jsonl" in text
    assert "not checked here" not in text  # the conversations were checked: they are these files


def test_with_conversations_in_a_database_the_report_says_what_it_did_not_check(short_tmp: Path) -> None:
    layout = VarLayout(short_tmp / "var")
    layout.run_dir.mkdir(parents=True, mode=0o700)
    env = {"KSI_STORAGE": "postgres", "KSI_DATABASE_URL": "postgresql://ksi:hunter2@db.example:5432/ksi"}
    machine = CliRunner().invoke(cli, ["doctor", "--json", "--var-dir", str(layout.root)], env=env)
    assert machine.exit_code == 0 and json.loads(machine.output)["storage"] == "postgres"
    from ksi_cli.doctor import _print_report

    runner = CliRunner()
    with runner.isolation() as (out, _err, *_rest):  # what a person sees on a terminal
        _print_report(checks.check(layout.root), [], Location(layout.root, layout.run_dir / "daemon.sock",
                                                              storage="postgres", database_url=env["KSI_DATABASE_URL"]))
    text = out.getvalue().decode()
    assert "conversations and agents are in the database" in text and "not checked here" in text
    assert "hunter2" not in text + machine.output


def test_truncate_torn_tail_keeps_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"a\n" + b"z" * 200_000)
    assert truncate_torn_tail(path) == 200_000 and path.read_bytes() == b"a\n"
    path.write_bytes(b"no newline at all")
    truncate_torn_tail(path)
    assert path.read_bytes() == b""
    assert not os.path.getsize(path)
