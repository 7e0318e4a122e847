"""The rules of a tool-using turn. At admission, before anything is written: a function call's
output answers a call the conversation's newest exchange left open, and while such calls are open
nothing else may come before their outputs; tools go only to an answerer that can pass them on.
When the history is chosen: the exchange whose calls the new input answers is sent with it."""

from __future__ import annotations

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, call_ids_abandoned, call_ids_answered, function_calls
from ksi_daemon.services.completion.models import CompletionAsync
from ksi_daemon.services.conversations.history import History, open_calls
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory
from ksi_daemon.services.conversations.pending import pending_items


async def check_turn(cache: ConversationCache, memory: ConversationMemory | None, data: CompletionAsync,
                     max_depth: int) -> None:
    """Refuse (validation_error) outputs of calls that are not open, and any input while open calls
    lack outputs; `memory` None: the request starts a conversation, where no call is open. A call
    the client abandoned is open no more: its stand-in output waits in the pending input."""
    answered = call_ids_answered(data.input_items())
    made = [] if memory is None or not memory.total else await open_calls(cache, memory, max_depth)
    if made:
        abandoned = set(call_ids_abandoned(pending_items(memory.meta))) if memory is not None else set()
        made = [call for call in made if str(call["call_id"]) not in abandoned]
    check_answers(answered, made)


def check_answers(answered: list[str], made: list[Item]) -> None:
    """The new input's function call outputs (`answered`) must answer exactly the calls `made` by
    the newest exchange before it, each once; else validation_error, naming the call ids."""
    if not answered and not made:
        return
    open_ids = [str(call["call_id"]) for call in made]
    twice = sorted({call_id for call_id in answered if answered.count(call_id) > 1})
    if twice:
        raise KsiError(ErrorCode.VALIDATION_ERROR, f"calls {twice} are answered more than once",
                       fields={"input": f"more than one output for {', '.join(twice)}"}, call_ids=twice)
    unknown = [call_id for call_id in answered if call_id not in open_ids]
    if unknown:
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       f"function_call_output for {', '.join(unknown)}: no such call is open in this conversation "
                       f"(its newest exchange left {', '.join(open_ids) if open_ids else 'no call'} open)",
                       fields={"input": f"unknown call id {', '.join(unknown)}"}, call_ids=unknown, open_call_ids=open_ids)
    missing = [call_id for call_id in open_ids if call_id not in answered]
    if missing:
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       f"the conversation's newest exchange called tools whose outputs are missing: {', '.join(missing)}; "
                       "send a function_call_output for each (with input) before anything else",
                       fields={"input": f"missing outputs for {', '.join(missing)}"}, call_ids=missing)


async def check_new_conversation(cache: ConversationCache, conversation_id: str | None, data: CompletionAsync) -> None:
    """Outputs of calls sent to a conversation that does not exist yet answer nothing: refused
    before it is created."""
    answered = call_ids_answered(data.input_items())
    if answered and (conversation_id is None or await cache.get(conversation_id) is None):
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       f"function_call_output for {', '.join(answered)}: a new conversation has no open call",
                       fields={"input": f"unknown call id {', '.join(answered)}"}, call_ids=answered)


def check_called_in_history(history: History, new_input: list[Item], model: str) -> None:
    """The exchange whose calls the new input answers must be sent (a call and its output go
    together): when the budget cannot hold it, the turn does not fit."""
    answered = set(call_ids_answered(new_input))
    if not answered:
        return
    last = history.exchanges[-1] if history.exchanges else None
    made = {str(call["call_id"]) for call in function_calls(last.output)} if last is not None else set()
    if not answered <= made:
        raise KsiError(ErrorCode.CONTEXT_WINDOW_EXCEEDED,
                       f"the exchange whose tool calls this input answers does not fit in {model}'s context window "
                       "with it (a call and its output are sent together)",
                       call_ids=sorted(answered))
