"""Shell completion through click's own protocol, as the shell runs it: a real `ksi` process."""

from __future__ import annotations

from pathlib import Path

from ksi_common.client import KsiClient
from tests.conftest import complete, running_daemon
from tests.test_cli_ask import Run, clean_env


async def completing(root: Path, words: str) -> Run:
    import asyncio
    import sys

    env = {**clean_env(), "_KSI_COMPLETE": "bash_complete", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1))}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ksi_cli", cwd=root, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return Run(process.returncode or 0, out.decode(), err.decode())


def values(run: Run) -> list[str]:
    return [line.split(",", 1)[1] for line in run.out.splitlines() if "," in line]


async def test_events_conversations_and_agents_complete(short_tmp: Path) -> None:
    sock, var = str(short_tmp / "d.sock"), str(short_tmp / "var")
    async with running_daemon(short_tmp) as daemon, KsiClient(daemon.settings.socket) as client:
        await complete(client, prompt="hi", conversation_id="conv-complete-me", create=True, model="echo/c")
        await client.request("agent:spawn", {"agent_id": "agent-complete-me", "model": "echo/c"})
        events = values(await completing(short_tmp, f"ksi send --socket {sock} system:he"))
        assert events == ["system:health", "system:help"]
        assert "conv-complete-me" in values(await completing(short_tmp, f"ksi ask --var-dir {var} --cid conv-"))
        assert "conv-complete-me" in values(await completing(short_tmp, f"ksi conversation show --var-dir {var} conv-"))
        assert values(await completing(short_tmp, f"ksi chat --var-dir {var} agent-c")) == ["agent-complete-me"]
    assert "daemon" in values(await completing(short_tmp, "ksi da"))
