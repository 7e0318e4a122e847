"""Which of its ancestors' stored summaries a fork uses: those its parent's turn after the fork
point had to choose from, when an ancestor took that turn. A fork at k then opens its requests
exactly as that turn k+1 did (the system prompt, the same stand-ins, the window's start after
them), so the provider's prompt cache that turn filled holds the fork's prefix too. A summary the
parent stored later, even of exchanges 1..k, would move the fork's window start and its cache
would miss.
"""

from __future__ import annotations

from typing import Any

from ksi_common.records import ResponseRecord
from ksi_common.summaries import Summary
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory
from ksi_daemon.services.conversations.stand_ins import TurnSaw

Chain = list[tuple[ConversationMemory, int | None]]


async def fork_point_turn(cache: ConversationCache, chain: Chain) -> TurnSaw | None:
    """The stored summaries the turn after the fork point had to choose from; None (every stored
    one up to the fork point) when it was sent none, when no ancestor took that turn, or when its
    record does not say what it was sent (an exchange stored before that record, or a turn that
    sent the client's own history)."""
    if len(chain) < 2 or chain[1][1] is None:
        return None
    fork, at = chain[0][0], chain[1][1]
    turn = next((entry for member, upto in chain[1:] if upto == at
                 for entry in [member.entry(at + 1)] if entry is not None), None)
    if turn is None:
        return None  # the parent has not gone on past the fork point: its next turn uses what the fork does
    if fork.inherited is not None and fork.inherited[0] == turn.response_id:
        return fork.inherited[1]  # the turn's record is read once per fork in memory
    [record] = await cache.responses.read_many([turn.response_id])
    saw = _saw(record) if record is not None else None
    fork.inherited = (turn.response_id, saw)
    return saw


def _saw(record: ResponseRecord) -> TurnSaw | None:
    sent: Any = (record.outcome or {}).get("sent")
    if not isinstance(sent, dict) or sent.get("history_source") == "client":
        return None
    blocks = [block for block in sent.get("stand_in") or [] if isinstance(block, dict)]
    if not blocks:
        # the turn's history fitted whole. A fork whose history fits uses no summary anyway; one
        # whose longer input leaves exchanges out cannot open as that turn did, and takes what is stored
        return None
    # a turn's own fallback ("recent") is made again from the same exchanges; the rest were stored
    # (a "digest" of several names only their span: the time the turn was asked finds those)
    ranges = frozenset((int(block["first"]), int(block["upto"])) for block in blocks
                       if block.get("kind") != "recent" and "first" in block and "upto" in block)
    asked = next((str(line["ts"]) for line in record.inputs if line.get("ts")), None)
    return TurnSaw(ranges, asked)


def inherited_summaries(chain: Chain, found: list[list[Summary]], saw: TurnSaw | None
                        ) -> list[tuple[Summary, int | None]]:
    """Each member's summaries (`found`, in chain order) paired with the last exchange its owner shares
    with the conversation, the root's first (as `stand_ins.cover` reads them); an ancestor's only
    when the fork point's turn had it to choose from."""
    return [(summary, upto) for (_member, upto), summaries in reversed(list(zip(chain, found, strict=True)))
            for summary in summaries
            if upto is None or saw is None or saw.includes(summary)]
