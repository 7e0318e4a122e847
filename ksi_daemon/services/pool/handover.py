"""A request as the pool keeps it: written whole at its acceptance, so another daemon of the pool
can run it (the same request id, response id and conversation) should the daemon that accepted it
die."""

from __future__ import annotations

from typing import Any

from ksi_common.timefmt import utc_now
from ksi_daemon.context import EventContext
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.completion.requests import RequestState


def request_record(state: RequestState) -> dict[str, Any]:
    """Everything another daemon needs to run the request as this one would have."""
    return {
        "v": 1, "request_id": state.request_id, "conversation_id": state.conversation_id, "model": state.model,
        "agent_id": state.agent_id, "from_agent": state.from_agent, "response_id": state.response_id,
        "created": state.created, "request": state.request.model_dump(mode="json", exclude_defaults=True),
        "context": {**state.context.to_wire(), "depth": state.context.depth, "chain_id": state.context.chain_id},
        # its input is its conversation's pending input (these ids): another daemon must not add
        # them before it again, nor add input pended after its admission
        **({"takes_pending": list(state.takes_pending)} if state.takes_pending else {}),
        # images admission took out of its files: references to the stored blobs, never their bytes
        **({"images": state.images} if state.images else {}),
    }


def adopted_state(record: dict[str, Any]) -> RequestState:
    """The request of `record`, queued again on this daemon."""
    wire = record.get("context") or {}
    context = EventContext(event_id=str(wire.get("event_id") or ""), correlation_id=wire.get("correlation_id"),
                           parent_event_id=wire.get("parent_event_id"), agent_id=wire.get("agent_id"),
                           depth=int(wire.get("depth") or 0), chain_id=wire.get("chain_id")).child()
    return RequestState(
        request_id=record["request_id"], conversation_id=record["conversation_id"], model=record["model"],
        request=CompletionAsync.model_validate(record["request"]), context=context, agent_id=record.get("agent_id"),
        from_agent=record.get("from_agent"), created=record.get("created") or utc_now(),
        response_id=record.get("response_id"), takes_pending=_taken_ids(record.get("takes_pending")),
        images=list(record.get("images") or []),
    )


def _taken_ids(recorded: Any) -> tuple[str, ...]:
    """The pending ids a record names; a record of a daemon that wrote only `true` names none (its
    request adds the pending input before its own, as that daemon would have on restart)."""
    return tuple(str(i) for i in recorded) if isinstance(recorded, list) else ()
