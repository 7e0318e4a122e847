"""The pool of daemons: several daemons sharing one database, handing turns to each other.

One verb per movement of a turn between daemons, used by the code and the docs alike:

- **line up**: a turn takes its place in its conversation's line, shared by every daemon, when
  it is accepted (`ConversationLeases.line_up`); the conversation's turns run in that order.
- **hold**: a turn runs while its daemon holds the conversation's lease; a turn waiting for an
  earlier one, on any daemon, holds nothing.
- **offer**: a turn holding its lease that finds no free call slot here is offered to the pool
  while it waits (`PoolRequests.offer`, in `placement`).
- **claim**: a daemon with a free slot claims an offered turn (`PoolRequests.claim_offered`, in
  `claiming`) and runs it with the turn's own ids.
- **withdraw**: an offered turn takes its offer back before it runs here or is cancelled
  (`PoolRequests.withdraw`); the database says whether it was still this daemon's.
- **hand over**: a turn leaves this daemon's queue for another daemon that runs it, claimed or
  taken over (`TurnState.HANDED_OVER`).
- **take over**: a daemon runs the unfinished turns of a daemon whose heartbeat went silent
  (`PoolRequests.take_over`, in `takeover`).

A turn claimed or taken over is run here as a request adopted from its record (`handover`).
On the daemon that queued it, a turn's state is one `turn.PooledTurn`; the scheduler asks
`placement.Placement` one question of it, run here or hand over. A claim or a cancel reaches a
turn waiting for a slot as a message, never by cancelling the worker that runs its conversation.
"""
