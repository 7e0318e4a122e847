"""Secrets never leave the process: not in var/ (logs, responses, state), not in replies or
pushed events, not in system:health, `ksi config` or conversation exports — not even when a
provider's error message echoes the key back."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ksi_common.client import KsiClient
from tests.stub_openai import Reply, StubOpenAI
from tests.test_crash import REPO, DaemonProcess, daemon_env

OPENAI_SECRET = "sk-secret-XYZ"
KSI_SECRET = "sk-secret-ABC"
SECRETS = (OPENAI_SECRET, KSI_SECRET)
TIMEOUT = 60.0


def leaks(text: str | bytes) -> list[str]:
    raw = text.encode() if isinstance(text, str) else text
    return [s for s in SECRETS if s.encode() in raw]


def unauthorized(key: str) -> Reply:
    """A 401 whose message quotes the key, as OpenAI's does."""
    return Reply(status=401, body=json.dumps({"error": {
        "message": f"Incorrect API key provided: {key}. You can find your API key at https://x.invalid.",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}))


async def test_secrets_appear_nowhere(short_tmp: Path) -> None:
    frames: list[dict[str, Any]] = []
    async with StubOpenAI() as stub:
        env = daemon_env(stub.api_base, OPENAI_API_KEY=OPENAI_SECRET, KSI_API_KEY=KSI_SECRET,
                         KSI_LOG_LEVEL="DEBUG", KSI_RETRY_ATTEMPTS="1")
        daemon = DaemonProcess(short_tmp, env)
        await daemon.start()
        try:
            async with KsiClient(daemon.socket) as client, KsiClient(daemon.socket) as watcher:
                await watcher.request("monitor:subscribe", {"patterns": ["*"]})

                async def ask(**data: Any) -> dict[str, Any]:
                    ack = await client.send_frame("completion:async", data)
                    frames.append(ack)
                    reply = await client.send_frame(
                        "completion:wait", {"request_id": ack["data"]["request_id"], "timeout": TIMEOUT})
                    frames.append(reply)
                    return reply

                ok = await ask(prompt="hello", conversation_id="talk", create=True)
                assert ok["data"]["content"] == "stub answer to: hello"
                stub.enqueue(unauthorized(OPENAI_SECRET))
                failed = await ask(prompt="again", conversation_id="talk")
                assert failed["error"]["code"] == "provider_error"
                assert failed["error"]["details"].get("status") == 401
                # the same through a streamed call, and a key the user typed in the prompt is theirs to keep
                stub.enqueue(unauthorized(OPENAI_SECRET))
                streamed = await ask(prompt="stream", conversation_id="talk", stream=True)
                assert streamed["error"]["code"] == "provider_error"
                frames.append(await client.send_frame("system:health"))
                discovered = await client.send_frame("system:discover")
                frames.append(discovered)
                if "conversation:export" in discovered["data"]["events"]:
                    for fmt in ("markdown", "json", "jsonl"):
                        frames.append(await client.send_frame(
                            "conversation:export", {"conversation_id": "talk", "format": fmt}))
                        assert "error" not in frames[-1], frames[-1]
                await asyncio.sleep(0.2)
                while True:
                    try:
                        push = await watcher.next_push(timeout=0.2)
                    except TimeoutError:
                        break
                    if push is None:
                        break
                    frames.append(push)
        finally:
            await daemon.stop()

    assert any(f.get("event") == "completion:error" and f.get("push") for f in frames)
    for frame in frames:
        assert not leaks(json.dumps(frame)), frame
    # nothing on disk: logs (the daemon ran at DEBUG), responses, state, the journal, stderr
    written = [p for p in short_tmp.rglob("*") if p.is_file()]
    assert any(p.name == "daemon.log" for p in written)
    for path in written:
        assert not leaks(path.read_bytes()), f"{path} holds a secret"
    # what was recorded about the failure is still useful
    log_text = (daemon.var / "logs" / "daemon" / "daemon.log").read_text()
    assert "Incorrect API key provided" in log_text or any(
        "Incorrect API key provided" in p.read_text() for p in (daemon.var / "logs" / "responses").glob("*.jsonl"))


def test_ksi_config_masks_secrets(short_tmp: Path) -> None:
    env = daemon_env("http://127.0.0.1:9/v1", OPENAI_API_KEY=OPENAI_SECRET, KSI_API_KEY=KSI_SECRET)
    for args in (["config", "--json"], ["config"]):
        shown = subprocess.run([sys.executable, "-m", "ksi_cli", *args], cwd=short_tmp, env=env,
                               capture_output=True, text=True, timeout=30)
        assert shown.returncode == 0, shown.stderr
        assert not leaks(shown.stdout + shown.stderr)
    assert json.loads(subprocess.run([sys.executable, "-m", "ksi_cli", "config", "--json"], cwd=short_tmp,
                                     env=env, capture_output=True, text=True, timeout=30).stdout)["api_key"] == "***"
    assert REPO.exists()


def test_ksi_config_masks_the_database_password(short_tmp: Path) -> None:
    env = daemon_env("http://127.0.0.1:9/v1", KSI_STORAGE="postgres",
                     KSI_DATABASE_URL="postgresql://ksi:pg-s3cret@db.example:5432/ksi?password=pg-s3cret")
    shown = subprocess.run([sys.executable, "-m", "ksi_cli", "config", "--json"], cwd=short_tmp, env=env,
                           capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert "pg-s3cret" not in shown.stdout + shown.stderr
    view = json.loads(shown.stdout)
    assert view["storage"] == "postgres"
    assert view["database_url"] == "postgresql://ksi:***@db.example:5432/ksi?password=***"


def test_the_database_password_is_a_known_secret() -> None:
    from ksi_common.settings import Settings
    from ksi_daemon.redaction import Redactor, known_secrets

    settings = Settings(_env_file=None, storage="postgres",
                        database_url="postgresql://ksi:pg%40s3cret-word@db.example/ksi")
    redact = Redactor(known_secrets(settings, environ={}))
    assert redact("connect failed: postgresql://ksi:pg%40s3cret-word@db.example/ksi as pg@s3cret-word") == \
        "connect failed: postgresql://ksi:***@db.example/ksi as ***"


def test_redactor_masks_every_known_value() -> None:
    from ksi_common.settings import Settings
    from ksi_daemon.redaction import Redactor, known_secrets

    environ = {"OPENAI_API_KEY": OPENAI_SECRET, "HF_TOKEN": "hf-secret-123456", "HOME": "/home/someone-long",
               "MY_KEY": "short", "KSI_MODELS": "{}", "CUSTOM_VAR": "sk-secret-custom"}
    settings = Settings(_env_file=None, api_key=KSI_SECRET, models={"x/*": {"api_key_env": "CUSTOM_VAR"}})
    secrets = known_secrets(settings, environ)
    assert {OPENAI_SECRET, "hf-secret-123456", KSI_SECRET, "sk-secret-custom"} <= set(secrets)
    assert "/home/someone-long" not in secrets
    redact = Redactor(secrets)
    assert redact(f"key {OPENAI_SECRET} and {KSI_SECRET}.") == "key *** and ***."
    assert redact.scrub({"a": [f"x{OPENAI_SECRET}", 3], "b": (KSI_SECRET,)}) == {"a": ["x***", 3], "b": ("***",)}
    assert Redactor(["short"])("short stays") == "short stays"  # too short to mask everywhere


def test_log_processor_masks_messages_fields_and_tracebacks() -> None:
    import structlog

    from ksi_daemon.logs import _hide_secret_values
    from ksi_daemon.redaction import Redactor

    hide = _hide_secret_values(Redactor([OPENAI_SECRET]))
    try:
        raise RuntimeError(f"provider said: bad key {OPENAI_SECRET}")
    except RuntimeError:
        event = structlog.processors.format_exc_info(None, "error", {
            "event": f"call failed with {OPENAI_SECRET}", "exc_info": True, "context": {"key": OPENAI_SECRET}})
    rendered = structlog.processors.JSONRenderer()(None, "error", hide(None, "error", event))
    assert OPENAI_SECRET not in rendered
    assert "provider said: bad key ***" in rendered
