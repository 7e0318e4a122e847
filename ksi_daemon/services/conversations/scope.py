"""Whom a conversation is for, as the matching of a client-held history sees it.

Matching is by content, so two programs (or two users behind one app) sending the same canned
opening would continue each other's conversation. A request names whom it is for with the fields
clients already send for that: its agent (`agent_id`), and the provider options `user` and
`safety_identifier` (the Responses and chat `user`, the Responses `safety_identifier`). A
conversation keeps the scope of the request that made it in its metadata (`scope`; forks keep
their parent's), and a history matches only conversations of exactly the same scope: one naming
nobody only those stored for nobody. A conversation stored before scopes were kept is an agent's
when its metadata names one, else nobody's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ksi_daemon.storage.models import ConversationMeta

SCOPE_OPTIONS = ("user", "safety_identifier")  # provider options that name the end user

Scope = dict[str, str]


def request_scope(agent_id: str | None, options: Mapping[str, Any]) -> Scope:
    """The scope a request names (empty: nobody)."""
    scope: Scope = {"agent_id": agent_id} if agent_id else {}
    for name in SCOPE_OPTIONS:
        value = options.get(name)
        if value is not None and str(value):
            scope[name] = str(value)
    return scope


def stored_scope(meta: ConversationMeta) -> Scope:
    """The scope a conversation was stored for."""
    if meta.scope is not None:
        return dict(meta.scope)
    return {"agent_id": meta.agent_id} if meta.agent_id else {}

