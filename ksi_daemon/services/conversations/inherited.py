"""Which of its ancestors' stored summaries a fork uses: those its parent's turn after the fork
point was sent, when an ancestor took that turn. A fork at k then opens its requests exactly as
that turn k+1 did (the system prompt, the same stand-ins, the window's start after them), so the
provider's prompt cache that turn filled holds the fork's prefix too. A summary the parent stored
later, even of exchanges 1..k, would move the fork's window start and its cache would miss.
"""

from __future__ import annotations

from typing import Any

from ksi_common.summaries import Summary
from ksi_daemon.services.conversations.memory import ConversationCache, ConversationMemory

Chain = list[tuple[ConversationMemory, int | None]]
Range = tuple[int, int]  # first, upto


async def fork_point_ranges(cache: ConversationCache, chain: Chain) -> frozenset[Range] | None:
    """The ranges of the stored summaries the turn after the fork point was sent (none: it was
    sent none); None when no ancestor took that turn, or its record does not say what it was sent
    (an exchange stored before that record, or a turn that sent the client's own history)."""
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
    ranges = _stored_ranges((record.outcome or {}).get("sent") if record is not None else None)
    fork.inherited = (turn.response_id, ranges)
    return ranges


def _stored_ranges(sent: Any) -> frozenset[Range] | None:
    if not isinstance(sent, dict) or sent.get("history_source") == "client":
        return None
    blocks = [block for block in sent.get("stand_in") or [] if isinstance(block, dict)]
    # a turn's own fallback ("recent") is made again from the same exchanges; the rest were stored
    return frozenset((int(block["first"]), int(block["upto"])) for block in blocks
                     if block.get("kind") != "recent" and "first" in block and "upto" in block)


def inherited_summaries(chain: Chain, found: list[list[Summary]], ranges: frozenset[Range] | None
                        ) -> list[tuple[Summary, int | None]]:
    """Each member's summaries (`found`, in chain order) paired with the last exchange its owner shares
    with the conversation, the root's first (as `stand_ins.cover` reads them); an ancestor's only
    when the fork point's turn was sent its range."""
    return [(summary, upto) for (_member, upto), summaries in reversed(list(zip(chain, found, strict=True)))
            for summary in summaries
            if upto is None or ranges is None or (summary.first, summary.upto) in ranges]
