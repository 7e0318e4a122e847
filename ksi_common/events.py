"""Every event name of the bus, and the shapes of some events the daemon emits on its own.

The one place a name is spelt: the daemon's services register and emit these, the doors, the CLI,
MCP and the `llm` plugin send them. It imports nothing of the daemon, so the client path may
import it; a test fails on an event-name literal written anywhere else.
"""

from __future__ import annotations

from typing import Any, TypedDict

# -- system -----------------------------------------------------------------
SYSTEM_HEALTH = "system:health"  # answered even while the daemon shuts down
SYSTEM_DISCOVER = "system:discover"
SYSTEM_HELP = "system:help"
SYSTEM_CONFIG = "system:config"
SYSTEM_CLUSTER = "system:cluster"
SYSTEM_SHUTDOWN = "system:shutdown"

# -- monitor ----------------------------------------------------------------
MONITOR_SUBSCRIBE = "monitor:subscribe"
MONITOR_UNSUBSCRIBE = "monitor:unsubscribe"
# written by the socket door itself to a subscriber that fell behind, never on the bus
MONITOR_OVERFLOW = "monitor:overflow"

# -- completion: requested --------------------------------------------------
COMPLETION_ASYNC = "completion:async"
COMPLETION_WAIT = "completion:wait"
COMPLETION_STATUS = "completion:status"
COMPLETION_CANCEL = "completion:cancel"
COMPLETION_CHUNKS = "completion:chunks"
COMPLETION_MODELS = "completion:models"
# -- completion: emitted, never requested -----------------------------------
COMPLETION_RESULT = "completion:result"  # the result data of a finished request
COMPLETION_ERROR = "completion:error"  # CompletionFailure
COMPLETION_CANCELLED = "completion:cancelled"  # CompletionFailure
COMPLETION_CHUNK = "completion:chunk"  # {request_id, conversation_id, index, text, tool_call or reasoning}

# -- conversation -----------------------------------------------------------
CONVERSATION_LIST = "conversation:list"
CONVERSATION_SHOW = "conversation:show"
CONVERSATION_STATS = "conversation:stats"
CONVERSATION_FORK = "conversation:fork"
CONVERSATION_ABANDON_CALLS = "conversation:abandon_calls"
CONVERSATION_APPEND = "conversation:append"
CONVERSATION_IMPORT = "conversation:import"
CONVERSATION_EXPORT = "conversation:export"
CONVERSATION_UPDATE = "conversation:update"
CONVERSATION_ARCHIVE = "conversation:archive"
CONVERSATION_DELETE = "conversation:delete"
CONVERSATION_PIN = "conversation:pin"
CONVERSATION_UNPIN = "conversation:unpin"
CONVERSATION_PEND = "conversation:pend"
CONVERSATION_CHANGED = "conversation:changed"  # emitted: ConversationChanged
CONVERSATION_SENT = "conversation:sent"  # emitted when a pended input went out with a turn
CONVERSATION_SUMMARISED = "conversation:summarised"  # emitted when a summary was stored
RESPONSE_SHOW = "response:show"
RESPONSE_DELETE = "response:delete"

# -- agent ------------------------------------------------------------------
AGENT_SPAWN = "agent:spawn"
AGENT_SEND_MESSAGE = "agent:send_message"
AGENT_INFO = "agent:info"
AGENT_LIST = "agent:list"
AGENT_PROFILES = "agent:profiles"
AGENT_RESET = "agent:reset"
AGENT_TERMINATE = "agent:terminate"

# -- consortium -------------------------------------------------------------
CONSORTIUM_LIST = "consortium:list"
CONSORTIUM_SAVE = "consortium:save"
CONSORTIUM_REMOVE = "consortium:remove"
CONSORTIUM_RUNS = "consortium:runs"
CONSORTIUM_TRACE = "consortium:trace"


class CompletionFailure(TypedDict):
    """The data of completion:error and completion:cancelled."""

    request_id: str
    conversation_id: str
    agent_id: str | None
    code: str
    message: str
    details: dict[str, Any]


class ConversationChanged(TypedDict):
    """The data of conversation:changed."""

    conversation_id: str
    change: str


def completion_result(*, request_id: str, response_id: str, conversation_id: str, agent_id: str | None,
                      model: str | None, content: str | None, output: list[dict[str, Any]],
                      finish_reason: str | None, usage: dict[str, Any], cost: float | None,
                      history: dict[str, Any], attempts: int, duration_ms: float | None, exchange: int | None,
                      turns_left: int | None = None, recovered: bool = False) -> dict[str, Any]:
    """The data of completion:result (and of a successful completion:wait), built here alone for a
    turn just run and for one recovered from storage after a restart or a takeover. `turns_left` is
    how many more exchanges the conversation's cap allows (None: no cap, or not known when
    recovered); `recovered` says the answer was read back from storage, not run here."""
    return {"request_id": request_id, "response_id": response_id, "conversation_id": conversation_id,
            "agent_id": agent_id, "model": model, "content": content, "output": output,
            "finish_reason": finish_reason, "usage": usage, "cost": cost, "history": history,
            "attempts": attempts, "duration_ms": duration_ms, "exchange": exchange,
            "turns_left": turns_left, "recovered": recovered}
