"""Shell completion of what only the daemon or the var dir knows: event names, conversation
and agent ids. Click completes commands and options by itself (`_KSI_COMPLETE=bash_source ksi`)."""

from __future__ import annotations

from typing import Any

import click
from click.shell_completion import CompletionItem

from ksi_common.events import SYSTEM_DISCOVER


def _location(ctx: click.Context) -> Any:
    from ksi_common.locate import locate

    params: dict[str, Any] = {}
    context: click.Context | None = ctx
    while context is not None:  # --var-dir / --socket may sit on this command or a parent
        params = {**context.params, **params}
        context = context.parent
    return locate(params.get("var_dir"), params.get("socket_path"))


def events(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    from ksi_common import oneshot
    from ksi_common.errors import KsiError

    try:
        known = oneshot.request(_location(ctx).socket, SYSTEM_DISCOVER, timeout=1.0)["events"]
    except KsiError:
        return []
    return [CompletionItem(name, help=description) for name, description in known.items()
            if name.startswith(incomplete)]


def conversations(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    directory = _location(ctx).layout.conversations_dir
    if not directory.is_dir():
        return []
    return [CompletionItem(path.stem) for path in sorted(directory.glob(f"{incomplete}*.jsonl"))]


def agents(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    directory = _location(ctx).layout.agents_dir
    if not directory.is_dir():
        return []
    return [CompletionItem(path.stem) for path in sorted(directory.glob(f"{incomplete}*.json"))]
