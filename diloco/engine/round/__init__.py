"""The outer rounds of an island: when they fall due, what the island trains from while one is in flight, and
each round as one transaction (as torchft's DiLoCo sync).

Where a change belongs, by module:

- :mod:`~diloco.engine.round.schedule`: when rounds fall due (:class:`RoundSchedule`: every H / P inner steps, or
  every 1/P of a budget of compute seconds or tokens; the fragment each round averages; the weight of its Δ);
- :mod:`~diloco.engine.round.flight`: what is in flight, one small class per ``--diloco.overlap`` mode
  (:class:`~diloco.engine.round.flight.Blocking`, :class:`~diloco.engine.round.flight.Delayed`,
  :class:`~diloco.engine.round.flight.Eager`: what the island trains from meanwhile, how its parameters follow the
  outcome) and the round's own thread;
- :mod:`~diloco.engine.round.transaction`: the transaction (:class:`RoundTransaction`: catch up or leave out,
  pseudo-gradient → average → check → commit or roll back);
- :mod:`~diloco.engine.round.rounds`: :class:`OuterRounds`, which sends a round when due, holds the one in flight
  and applies it;
- :mod:`~diloco.engine.round.context`: :class:`RoundContext`, the collaborators all of them share, built once by
  the island;
- :mod:`~diloco.engine.round.record`: what one round did (:class:`RoundMetrics`, one record, derived from the
  averaging's :class:`peers.RoundResult`); :mod:`~diloco.engine.round.hooks`: faults and membership
  announcements around the transaction.

A round, read in the order it runs: **due** (:meth:`RoundSchedule.sync_due`) → **send**
(:meth:`OuterRounds.send`: :meth:`RoundTransaction.open` takes Δ = θ_global − θ_local of the round's fragment and
starts the averager, and the round in flight sets up what the island trains from) → **apply**
(:meth:`OuterRounds.apply`, at the latest when the next round is due, earlier as ``--diloco.overlap`` says:
:meth:`RoundTransaction.close` waits for the averager, averages again among the members left if the group lost
one, validates, commits or rolls back; then the parameters follow the outcome).  θ_global (the fp32 outer state,
what islands vote on, serve and checkpoint) only ever moves by committed averages, identically on every island,
whichever mode each uses.  Nothing here sees the island: the context holds its runtime, outer optimizer, peer
node (averager and member registry), state transfer and the run's statistics.
"""

from diloco.engine.round.context import IslandNorm, RoundContext
from diloco.engine.round.flight import InFlight
from diloco.engine.round.hooks import FaultHook, MembershipHook, RoundHook
from diloco.engine.round.record import CAUGHT_UP, RoundMetrics
from diloco.engine.round.rounds import OuterRounds
from diloco.engine.round.schedule import PER_TOKENS, RoundSchedule
from diloco.engine.round.transaction import RoundTransaction, Settled

__all__ = ["CAUGHT_UP", "PER_TOKENS", "FaultHook", "InFlight", "IslandNorm", "MembershipHook", "OuterRounds",
           "RoundContext", "RoundHook", "RoundMetrics", "RoundSchedule", "RoundTransaction", "Settled"]
