"""Faults of a model's configuration, in KSI's words: a name no provider answers to (with the
closest names), a key the daemon lacks, a CLI program missing from its PATH.

None of them is retried or counts against a provider's circuit: the next attempt would meet the
same configuration.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from ksi_common.errors import ErrorCode
from ksi_daemon.providers.base import ProviderFailure

CLOSEST = 3
MAX_NAME_SEARCHED = 200  # a longer name is no typo of a model's: no search through thousands of names


def closest_names(model: str, own: Iterable[str], others: Iterable[str] = ()) -> list[str]:
    """Up to three known names nearest to `model`, best first: this daemon's own (default,
    configured, built-in) when one is close, else any other."""
    if len(model) > MAX_NAME_SEARCHED:
        return []
    for names in (own, [*own, *others]):
        close = difflib.get_close_matches(model, list(dict.fromkeys(names)), n=CLOSEST, cutoff=0.6)
        if close:
            return close
    return []


def unknown_model(model: str, own: Iterable[str], others: Iterable[str] = (),
                  provider_said: str | None = None) -> ProviderFailure:
    """`model_not_found`, naming the closest names and where the usable ones are listed."""
    suggestions = closest_names(model, list(own), others)
    shown = model if len(model) <= MAX_NAME_SEARCHED else model[:MAX_NAME_SEARCHED] + "..."
    hint = f"; did you mean {' or '.join(suggestions)}?" if suggestions else ""
    details: dict[str, object] = {"model": shown, "suggestions": suggestions}
    if provider_said:
        details["provider_message"] = provider_said
    said = ("the provider answered that it has no model" if provider_said  # its words are in the details
            else "no provider answers to the model")
    return ProviderFailure(
        ErrorCode.MODEL_NOT_FOUND,
        f"{said} {shown!r}{hint} (`ksi models` lists the default, configured and built-in models; "
        "`ksi models PATTERN` searches the names litellm knows)",
        **details)


def missing_key(model: str, variables: list[str]) -> ProviderFailure:
    """`api_key_missing`, naming the variable the daemon needs and where it reads it from."""
    named = " or ".join(variables) if variables else "the provider's API key variable"
    return ProviderFailure(
        ErrorCode.API_KEY_MISSING,
        f"{model} needs {named}, which the daemon does not have: the daemon reads its own environment "
        "(the one `ksi daemon start` ran in) or the .env file of the directory it was started from; "
        "set it there and run `ksi daemon restart`",
        model=model, variables=variables)


def missing_command(binary: str, model: str) -> ProviderFailure:
    """`provider_unavailable` for a CLI provider whose program is not on the daemon's PATH."""
    return ProviderFailure(
        ErrorCode.PROVIDER_UNAVAILABLE,
        f"{model} runs the `{binary}` program, which is not on the daemon's PATH; install it, or start "
        "the daemon from an environment whose PATH has it (`ksi daemon restart`)",
        model=model, binary=binary, reason="command_missing")
