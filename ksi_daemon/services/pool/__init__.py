"""The pool of daemons: several daemons sharing one database, handing turns to each other.

One verb per movement of a turn between daemons, used by the code and the docs alike:

- **line up**: a turn takes its place in its conversation's line, shared by every daemon, when
  it is accepted (`ConversationLeases.line_up`); the conversation's turns run in that order.
- **hold**: a turn runs while its daemon holds the conversation's lease; a turn waiting for an
  earlier one, on any daemon, holds nothing.
- **offer**: a turn holding its lease that finds no free call slot here is offered to the pool
  while it waits (`PoolRequests.offer`).
- **claim**: a daemon with a free slot claims an offered turn (`PoolRequests.claim_offered`) and
  runs it with its own ids; `stealing.WorkStealing` is the daemon's claimer.
- **withdraw**: a turn offered takes its offer back before it runs here or is cancelled
  (`PoolRequests.withdraw`); the database says whether it was still this daemon's.
- **hand over**: a turn leaves this daemon for another that runs it, claimed or taken over.
- **take over**: a daemon runs the unfinished turns of a daemon whose heartbeat went silent
  (`PoolRequests.take_over`, in `takeover`).

A turn claimed or taken over is run here as a request adopted from its record (`handover`).
"""
