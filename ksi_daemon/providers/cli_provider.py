"""The `claude` and `gemini` CLIs as providers: each keeps its own session per conversation.

Their calls go through the litellm adapter, which hands them to the CLI's custom handler
(cli_session.py); what the daemon must know of them, that they keep a session and take no
tools, images or options from a request, is said here.
"""

from __future__ import annotations

import shutil
from typing import Any

from ksi_daemon.providers.base import ModelAbilities, Provider, ProviderCall, ProviderReply
from ksi_daemon.providers.model_faults import missing_command

# model prefix -> the program its calls run
CLI_PROGRAMS = {"claude-cli/": "claude", "gemini-cli/": "gemini"}


class CLISessionProvider:
    """One CLI program: resumed with only the new input, else seeded with the rebuilt history."""

    keeps_session = True
    takes_slot = True
    # the CLI wraps the prompt in its own system prompt and tools and counts cached tokens apart:
    # its usage is no count of the prompt the daemon built
    calibrated = False

    def __init__(self, program: str, calls: Provider) -> None:
        self.program = program
        self.calls = calls  # the litellm adapter (rate limited), which routes the model to the CLI
        self._found = False

    async def check(self, model: str, _inline: dict[str, Any] | None) -> None:
        """Refuse a model whose program is not on PATH (`provider_unavailable`), before it is queued."""
        if self._found:  # found once: a program removed later fails its call instead
            return
        if shutil.which(self.program) is None:
            raise missing_command(self.program, model)
        self._found = True

    async def abilities(self, model: str) -> ModelAbilities:
        # the CLI is sent text alone, keeps its own sampling and runs its own tools, if any
        return ModelAbilities(response_schema=False, function_calling=False, vision=False, pdf_input=False,
                              options=False, because=f"runs the {self.program} CLI")

    async def complete(self, call: ProviderCall) -> ProviderReply:
        return await self.calls.complete(call)


def cli_providers(calls: Provider) -> dict[str, CLISessionProvider]:
    """Each CLI's provider by the prefix of its models' names."""
    return {prefix: CLISessionProvider(program, calls) for prefix, program in CLI_PROGRAMS.items()}
