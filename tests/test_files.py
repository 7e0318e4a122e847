"""Files attached to completions: allowed roots, what is stored (references, never content),
and what the model is sent (each file once, fresh, changed/missing marked, within budget)."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from ksi_common.errors import KsiError
from ksi_daemon.services.completion.attachments import FOOTER, HEADER, Attachments
from tests.conftest import complete, connected, running_daemon, stub_settings


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def sent_input(stub: Any) -> str:
    """The last user message of the last call: the files block, then the new input."""
    return stub.messages()[-1]["content"]


def snapshot(var: Path) -> dict[str, bytes]:
    skip = ("run/", "logs/daemon/", "state/requests.jsonl")
    return {str(p.relative_to(var)): p.read_bytes() for p in sorted(var.rglob("*"))
            if p.is_file() and not str(p.relative_to(var)).startswith(skip)}


@pytest.fixture
def files_root(short_tmp: Path) -> Path:
    root = short_tmp / "allowed"
    root.mkdir()
    return root


async def test_each_file_once_fresh_with_changes_and_gaps_marked(short_tmp: Path, files_root: Path, stub: Any) -> None:
    stub.answer = lambda _messages: "ok"
    a, b = files_root / "a.txt", files_root / "b.txt"
    a.write_text("alpha version one")
    b.write_text("bravo content")
    async with running_daemon(short_tmp, allowed_file_roots=[files_root], **stub_settings(stub)) as daemon, \
            connected(daemon) as client:
        first = await complete(client, prompt="look at a", files=[str(a), str(a)], conversation_id="f", create=True)
        block = sent_input(stub)
        assert block.startswith(HEADER) and block.endswith(f"{FOOTER}\n\nlook at a")
        assert block.count(f"----- {a} -----\nalpha version one\n----- end of {a} -----") == 1
        assert first["history"]["files_embedded"] == 1

        # what is stored: the raw input and the file's reference, never its content
        lines = read_jsonl(daemon.layout.response_file(first["response_id"]))
        assert lines[0]["content"] == "look at a"
        assert lines[0]["files"] == [{"path": str(a), "size": 17,
                                      "sha256": hashlib.sha256(b"alpha version one").hexdigest()}]
        assert b"alpha version one" not in daemon.layout.response_file(first["response_id"]).read_bytes()

        await complete(client, prompt="now b", files=[str(b)], conversation_id="f")
        sent = sent_input(stub)
        assert sent.count("alpha version one") == 1 and sent.count("bravo content") == 1
        assert sent.index(str(a)) < sent.index(str(b))  # in the order of their newest reference
        assert "changed since attached" not in sent
        assert stub.messages()[0] == {"role": "user", "content": "look at a"}  # history turns stay raw

        a.write_text("alpha version two")
        await complete(client, prompt="again", conversation_id="f")
        sent = sent_input(stub)
        assert f"----- {a} (changed since attached) -----\nalpha version two\n" in sent
        assert "alpha version one" not in sent

        b.unlink()
        fourth = await complete(client, prompt="and b?", conversation_id="f")
        assert f"----- {b} (missing) -----" in sent_input(stub)
        assert fourth["history"]["files_missing"] == 1

        # the newest reference wins: attached again, a is current, not "changed"
        await complete(client, prompt="a once more", files=[str(a)], conversation_id="f")
        sent = sent_input(stub)
        assert sent.count(f"----- {a}") == 1 and "changed since attached" not in sent
        assert "alpha version two" in sent

    # after a restart the references come back from the response files
    async with running_daemon(short_tmp, allowed_file_roots=[files_root], **stub_settings(stub)) as daemon, \
            connected(daemon) as client:
        a.write_text("alpha version three")
        await complete(client, prompt="after restart", conversation_id="f")
        sent = sent_input(stub)
        assert f"{a} (changed since attached)" in sent and f"{b} (missing)" in sent


async def test_paths_outside_the_roots_are_refused(short_tmp: Path, files_root: Path, stub: Any) -> None:
    outside = short_tmp / "outside.txt"
    outside.write_text("secret")
    inside = files_root / "in.txt"
    inside.write_text("fine")
    (files_root / "escape").symlink_to(outside)
    (files_root / "alias").symlink_to(inside)
    (files_root / "sub").mkdir()
    cases = {
        str(outside): "path_not_allowed",
        str(files_root / "escape"): "path_not_allowed",  # a symlink leaving the root
        f"{files_root}/../outside.txt": "path_not_allowed",
        f"{files_root}/../outside-and-missing.txt": "path_not_allowed",
        "/etc/passwd": "path_not_allowed",
        "in.txt": "validation_error",  # relative paths are refused: the daemon's cwd is not the client's
        str(files_root / "missing.txt"): "validation_error",
        str(files_root / "sub"): "validation_error",
    }
    async with running_daemon(short_tmp, allowed_file_roots=[files_root], **stub_settings(stub)) as daemon, \
            connected(daemon) as client:
        await complete(client, prompt="start", conversation_id="p", create=True)
        before = snapshot(daemon.layout.root)
        for path, code in cases.items():
            for target in ({"conversation_id": "p"}, {"conversation_id": "brand-new", "create": True}):
                with pytest.raises(KsiError) as caught:
                    await client.request("completion:async", {"prompt": "read it", "files": [str(inside), path], **target})
                assert caught.value.code == code, path
                if code == "validation_error":
                    assert "files.1" in caught.value.details["fields"]
        assert snapshot(daemon.layout.root) == before  # nothing logged, no conversation created
        calls = len(stub.requests)
        result = await complete(client, prompt="via alias", files=[str(files_root / "alias")], conversation_id="p")
        assert len(stub.requests) == calls + 1
        stored = read_jsonl(daemon.layout.response_file(result["response_id"]))[0]["files"]
        assert stored[0]["path"] == str(inside.resolve())  # the resolved path is what is recorded

    # no roots configured: no file is allowed at all
    async with running_daemon(short_tmp, **stub_settings(stub)) as daemon, connected(daemon) as client:
        with pytest.raises(KsiError) as caught:
            await client.request("completion:async", {"prompt": "x", "files": [str(inside)]})
        assert caught.value.code == "path_not_allowed"


async def test_files_over_the_budget_are_listed_as_omitted(short_tmp: Path, files_root: Path, stub: Any) -> None:
    stub.answer = lambda _messages: "ok"
    small = files_root / "small.txt"
    small.write_text("small and useful")
    big = files_root / "big.txt"
    big.write_text(" ".join(f"word{i}" for i in range(3000)))  # read, counted, too many tokens
    huge = files_root / "huge.bin.txt"
    huge.write_bytes(b"z" * 400_000)  # too large to be worth reading at all
    models = {"openai/stub-small": {"api_base": stub.api_base, "context_window": 4000, "output_reserve": 500}}
    async with running_daemon(short_tmp, allowed_file_roots=[files_root],
                              **stub_settings(stub, models=models)) as daemon, connected(daemon) as client:
        result = await complete(client, model="openai/stub-small", prompt="summarise",
                                files=[str(huge), str(big), str(small)], conversation_id="b", create=True)
        sent = sent_input(stub)
        assert "small and useful" in sent
        assert f"----- {big} (omitted to fit the token budget: about" in sent and "word2999" not in sent
        assert f"----- {huge} (omitted to fit the token budget: 400000 bytes) -----" in sent
        assert (result["history"]["files_embedded"], result["history"]["files_omitted"]) == (1, 2)
        assert result["history"]["files_tokens"] <= (4000 - 500) * 0.5
        # omitted files are still recorded with size and hash, so later turns can tell changes
        stored = {f["path"]: f for f in read_jsonl(daemon.layout.response_file(result["response_id"]))[0]["files"]}
        assert stored[str(huge)]["size"] == 400_000
        assert stored[str(huge)]["sha256"] == hashlib.sha256(b"z" * 400_000).hexdigest()


async def test_files_take_their_share_and_history_gets_the_rest(short_tmp: Path, files_root: Path, stub: Any) -> None:
    stub.answer = lambda _messages: "ok"
    doc = files_root / "doc.txt"
    doc.write_text(" ".join(f"fact{i}" for i in range(250)))
    models = {"openai/stub-small": {"api_base": stub.api_base, "context_window": 2600, "output_reserve": 400}}
    async with running_daemon(short_tmp, allowed_file_roots=[files_root], summariser="off", calibration=False,
                              **stub_settings(stub, models=models)) as daemon, connected(daemon) as client:
        for i in range(20):
            await complete(client, model="openai/stub-small", prompt=" ".join(["talk"] * 100) + f" {i}",
                           conversation_id="h", create=True)
        without = await complete(client, model="openai/stub-small", prompt="no file", conversation_id="h")
        with_file = await complete(client, model="openai/stub-small", prompt="with file", files=[str(doc)],
                                   conversation_id="h")
    assert with_file["history"]["files_embedded"] == 1
    assert without["history"]["exchanges_sent"] < without["history"]["exchanges_total"]  # history is cut...
    assert with_file["history"]["exchanges_sent"] < without["history"]["exchanges_sent"]  # ...more for the file
    assert with_file["history"]["tokens_sent"] + with_file["history"]["files_tokens"] <= 2600 - 400


async def test_reading_and_counting_run_in_a_worker_thread(files_root: Path) -> None:
    doc = files_root / "doc.txt"
    doc.write_text("content " * 1000)
    threads: list[bool] = []

    def count(text: str) -> int:
        threads.append(threading.current_thread() is threading.main_thread())
        return len(text) // 4

    attachments = Attachments([files_root], count)
    assert await attachments.check([str(doc)]) == [str(doc.resolve())]
    attached = await attachments.embed([], [str(doc)], 100_000)
    assert attached.notes[0].status == "embedded" and threads and not any(threads)
