"""A round's group, formed from the run's member registry by one leader every island can name, and the rule
that keeps a run one run: a round commits only for a majority of the islands that committed the round before.

**Why not hivemind's matchmaking.**  hivemind forms a group by a race: every peer declares itself in a DHT bucket,
and whoever asks first leads whoever answers.  At 24 islands on one machine, the race formed groups of 2 to 6
each round, and each group committed its own average: after 5 rounds the run held 6 different θ_global.  It took
5.7 round trips at 100 ms to form a group of 2, and one more process per island.  Here every island computes the
same leader from what the run has already agreed on, and a group forms in one round trip to it.

**How a roster forms** (one round id, on each island's rank 0, over its :mod:`peers.wire.transport`):

1. The island reads the registry once (:class:`RoundView`): which islands are live, where their rank 0 listens,
   who will come to this round, and which islands of the last committed roster will not (they left before it, or
   their address refuses connections: their process is gone).
2. The round's leader order is the last committed roster (every island that committed it holds the same one), or,
   before any round committed, every island registered, each sorted by a hash of the round id and its id
   (:func:`leader_order`): the leader changes every round.  The island sends its *join* (its round metadata) to
   the first island of that order it can reach; the first is itself, it leads.
3. The leader waits until every island it expects has joined, or, once a majority of the last committed roster
   has, ``matchmaking_time`` more for the rest (a late or dead island does not hold a run up longer); then it
   sends every member the *roster*: each member's metadata.  In a new run's first round it expects at least
   ``--averaging.wait_for_islands``, whatever its first read of the registry listed.  A join that comes after the
   roster left gets it too: its sender sees it is not a member and catches up with the run instead.
4. Every join is answered, whatever the island that got it does next (:meth:`RosterForming._answer_joins`): a
   join waiting in its inbox when it stops taking them is taken into its roster (a leader), sent on to its leader
   (a follower), or told to try the next island.  Two islands that follow each other (the first of the order came
   late and joined an island that had asked it, which had joined it meanwhile) find it out: of the two, the one
   first in the order leads.

**At most one lineage of θ_global** (:func:`quorum_problem`).  A round's result counts only when its group holds a
majority of the islands that committed the previous round (the *committed roster*, kept with θ_global, in
checkpoints, and handed to joiners), less those known not to take part in this round: they left the run before
it, or nothing listens at their address any more.  Two groups without a common member can then never both
commit the same round.  Before any round committed (a new run), the count is the largest number of islands any
member saw registered, and at least ``--averaging.wait_for_islands``.

**Hierarchical rounds** (:func:`split_groups`).  A roster larger than ``--averaging.max_group_size`` is split, the
same way on every member (by a hash of the round id), into groups of near-equal size that average inside
themselves and then across (:func:`peers.wire.encoded.average_encoded` with ``groups``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from peers.discovery.membership import Snapshot
from peers.fingerprints import digest
from peers.result import RoundResult
from peers.wire.transport import GoneError, Transport, TransportError, refuses, send_all

log = logging.getLogger("peers.group.averager")

JOIN = "roster.join."
"""Key prefix of a join (``roster.join.<round id>``): a member's metadata for the round, sent to its leader."""
ROSTER = "roster.list."
"""Key prefix of a roster (``roster.list.<round id>``): every member's metadata, sent by the leader to each; or the
one answer an island that leads no roster gives a join (it takes no part, has not reached the round, follows
another leader, or its roster left already)."""
HERE = "roster.here."
"""Key prefix of what an island in the round answers a join at once (``roster.here.<round id>``): it is there
(leading, or following a leader it will send the joiner on to)."""
ARRIVED = "roster.arrived."
"""Key prefix of what a leader tells the islands it expects as it starts leading (``roster.arrived.<round id>``): its
endpoint and the digest of the θ_global it enters the round with (not its join's whole fingerprint: 3,600 floats at
1b).  An island still waiting for the islands of the round to come
(:meth:`peers.discovery.membership.Membership.outvoted`) learns so at once that its leader came, rather than at its
next read of the registry, and joins it when it comes to the round.  Two islands whose reads of the registry missed
each other may both lead: each tells the other, and the one later in the order hands its round over.  An island that
follows a leader answers the notice with the leader it follows (``{"leader": [id, endpoint]}``)."""
GENESIS = "genesis"
"""The lineage of θ_global before any round committed (every island of a new run starts from the same θ_0)."""
CLOSED_ROUNDS = 64
"""Rosters a leader remembers after sending them, to answer joins that come later."""
POLL = 1.0
"""Seconds between two looks, while a roster forms, at whether the leader or an expected island is gone."""
PASS_BODY = b'{"pass": true}'
"""What an island that takes no part in a round answers the joins that come to it: try the next leader."""
CLOSED_BODY = b'{"closed": true}'
"""What a leader answers a join that comes after its roster left: the joiner is not a member (it catches up)."""
NOT_YET_BODY = b'{"not_yet": true}'
"""What an island answers a join for a round it has not reached yet (still training): try the next leader.  It
remembers who asked, and once it comes to that round joins them instead of leading it too late: the round's leader
is the first of the order that is there when the others look."""


def _order_key(round_id: str, island: str) -> bytes:
    return hashlib.sha256(f"{round_id}|{island}".encode()).digest()


def leader_order(candidates: Iterable[str], round_id: str) -> list[str]:
    """``candidates`` in the order a round's leader is picked: by a hash of the round id and the island id, the
    same on every island, different every round (so that no island leads every round)."""
    return sorted(set(candidates), key=lambda island: _order_key(round_id, island))


def split_groups(members: Sequence[str], round_id: str, max_group_size: int) -> list[list[str]]:
    """The roster's groups: one group of every member when they are at most ``max_group_size`` (0: no limit), else
    ``ceil(n / max_group_size)`` groups whose sizes differ by one at most, dealt in the order of a hash of the round
    id and the island id (every member computes the same groups; a slow or distant island is not always grouped
    with the same others).  Each group is sorted, and the groups are in the order of their first member."""
    order = sorted(members, key=lambda island: _order_key("group|" + round_id, island))
    if max_group_size <= 0 or len(order) <= max_group_size:
        return [sorted(order)]
    k = -(-len(order) // max_group_size)
    return sorted((sorted(order[j::k]) for j in range(k)), key=lambda g: g[0])


def lineage(committed: Collection[str], strikes: Mapping[str, int] | None = None) -> str:
    """A short name for the committed roster an island's θ_global descends from, and the strikes the run holds
    against members (:data:`GENESIS` before any round committed): islands that agree on θ_global but not on these
    belong to different lineages."""
    if not committed and not strikes:
        return GENESIS
    told = "|".join(sorted(committed)) + "#" + "|".join(f"{i}={n}" for i, n in sorted((strikes or {}).items()))
    return hashlib.sha256(told.encode()).hexdigest()[:16]


def quorum_problem(members: Collection[str], committed: Collection[str], out: Collection[str], seen: int,
                   wait_for: int = 0) -> str:
    """Why a group of ``members`` must not commit the round ('' when it may).  It must hold a majority of the
    ``committed`` roster of the previous round, less the islands ``out`` of this round (they left before it or are
    gone), and a majority of ``seen``, the live islands the registry lists.  Before any round committed
    (``committed`` empty, or every island of it out), a majority of ``seen`` or of ``wait_for``, the islands the
    run waits for, whichever is more.

    The second majority is what keeps a run one lineage: islands catch up only to a position at least half of the
    live islands hold (:func:`peers.discovery.membership.confirmed_position`), so a round committed by fewer, though
    by a majority of a roster that islands leaving had shrunk (5 of the 9 left of 10, with 15 live), starts a
    lineage the others never follow."""
    counted = set(committed) - set(out)
    if counted:
        have, total = len(set(members) & counted), len(counted)
        if 2 * have <= total:
            return (f"no majority of the run: the group holds {have} of the {total} island(s) that committed the last "
                    f"round (a majority is {total // 2 + 1}); an island cut off from the rest of the run must not move "
                    f"θ_global on its own")
    else:
        seen = max(seen, wait_for)
    if 2 * len(members) > seen:
        return ""
    return (f"no majority of the run: the group holds {len(members)} of the {seen} island(s) registered (a majority is "
            f"{seen // 2 + 1})")


@dataclass
class RoundView:
    """What an island's rank 0 knows of the run as it enters a round (one read of the registry, plus the committed
    roster it holds)."""

    committed: tuple[str, ...] = ()
    """The islands that committed the last round this island committed or adopted (empty: none yet)."""
    endpoints: dict[str, str] = field(default_factory=dict)
    """Island id → its rank 0's transport endpoint, for the live islands the registry lists."""
    expected: set[str] = field(default_factory=set)
    """Islands that will come to this round: those the registry lists at it, and the committed roster's islands not
    known to be out."""
    out: set[str] = field(default_factory=set)
    """Of :attr:`committed`, the islands known not to take part in this round (left before it, or gone)."""
    seen: int = 1
    """Live islands the registry lists (this one included): the count of a new run's first quorum."""

    @classmethod
    def of(cls, snapshot: Snapshot, committed: Sequence[str]) -> RoundView:
        """The view of an island holding the committed roster ``committed``, from one read of the registry."""
        out = set(committed) & snapshot.absent
        expected = set(snapshot.coming) | (set(committed) - out)
        return cls(tuple(committed), dict(snapshot.endpoints), expected, out, snapshot.seen)

    def without(self, banned: Collection[str]) -> RoundView:
        """This view with the islands the run left out (struck out: ``--averaging.strikes``) counted nowhere: not
        expected, out of the committed roster, and not among the live islands a quorum counts.  Every member holds
        the same strikes, so every member counts alike; counted, a struck island that trains on alone kept half the
        run's votes from the honest islands (3 honest of 4 registered: a group of 2 of them committed nothing)."""
        banned = set(banned)
        if not banned:
            return self
        return replace(self, expected=self.expected - banned, out=self.out | (set(self.committed) & banned),
                       seen=max(1, self.seen - len(banned & set(self.endpoints))))

    def leaders(self, round_id: str) -> list[str]:
        """The round's leader order (see :func:`leader_order`), islands known to be out left out."""
        base = set(self.committed) - self.out or self.expected
        return leader_order(base, round_id)


def pack(members: Mapping[str, dict]) -> bytes:
    """A roster (member → metadata) as sent: JSON, the θ_global fingerprints (the bulk of the metadata, identical
    on islands in sync) listed once."""
    states: list[Any] = []
    index: dict[str, int] = {}
    body = {}
    for island, meta in members.items():
        meta = dict(meta)
        state = meta.pop("state_fingerprint", None)
        if state is not None:
            text = json.dumps(state)
            if text not in index:
                index[text] = len(states)
                states.append(state)
            meta["_state"] = index[text]
        body[island] = meta
    return json.dumps({"members": body, "states": states}).encode()


def unpack(payload: bytes | bytearray | memoryview) -> dict[str, dict] | None:
    """The roster :func:`pack` made (None if it is not one: anything may come)."""
    try:
        body = json.loads(bytes(payload))
        states, members = body["states"], body["members"]
        out = {}
        for island, meta in members.items():
            meta = dict(meta)
            if "_state" in meta:
                meta["state_fingerprint"] = states[int(meta.pop("_state"))]
            out[str(island)] = meta
        return out
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


class RosterForming:
    """Forms each round's roster for one island (on its rank 0), over its transport (see the module's docstring).

    ``island``: this island's id (its rank 0's peer id, as its transport authenticates it); ``matchmaking_time``:
    how long a leader that has a majority waits for the rest; ``request_timeout``: how long a join may take to reach
    a leader before the next in order is tried; ``target``: close the roster as soon as this many joined (0: when
    every expected island did); ``min_group_size``: a leader holding fewer members waits on (for an island that
    comes late, or until it gives up); ``wait_for``: the islands a new run waits for (``--averaging.wait_for_islands``):
    before any round committed, a leader holding fewer does not take its registry read for every island coming."""

    def __init__(self, transport: Transport, island: str, matchmaking_time: float, request_timeout: float,
                 target: int = 0, min_group_size: int = 2, wait_for: int = 0):
        self.transport, self.island = transport, island
        self.matchmaking_time, self.request_timeout, self.target = matchmaking_time, request_timeout, target
        self.min_group_size, self.wait_for = min_group_size, wait_for
        self._closed: OrderedDict[str, bytes] = OrderedDict()
        """Round ids this island is done with → what it answers joins that come later (the roster left, or it takes
        no part)."""
        self._current = ""
        """The round id this island is forming a roster for now ('' between rounds)."""
        self._passed_over: OrderedDict[str, dict[str, list[float] | None]] = OrderedDict()
        """Round ids whose joins came before this island reached the round → their senders (who went on to the
        next leader in the order) → the digest of the θ_global each enters the round with (None if its join
        carried none)."""
        self._arrivals: OrderedDict[str, dict[str, list[float] | None]] = OrderedDict()
        """Round ids this island has not reached yet → the leaders that said they came (:data:`ARRIVED`) → the digest
        each enters it with."""
        self._leading: OrderedDict[str, dict[str, str]] = OrderedDict()
        """Round ids → the islands known to lead them (they said so, or an island following one named it) → the
        endpoint given ('' if none)."""
        self._following: tuple[str, str] | None = None
        """(leader, its endpoint) this island waits for the roster of, now."""
        self._endpoint = ""
        """This island's endpoint in the round it forms."""
        self._not_there: set[str] = set()
        """Islands of the order that answered, in this pass over it, that they had not reached the round."""
        self._handed_first = ""
        """The island the last hand-off went to."""
        self._refresh: Callable[[], RoundView] | None = None
        self._handed_to = RoundView()
        self._followed: tuple[str, str] | None = None
        """(leader, its endpoint) whose roster this island took in the round it forms or formed last."""
        self._order: list[str] = []
        """The leader order of the round this island forms (as its view of the registry gives it)."""
        self._lock = threading.Lock()
        transport.handlers[JOIN] = self._on_join
        transport.handlers[ARRIVED] = self._on_arrived

    def asked(self, round_id: str) -> dict[str, list[float] | None]:
        """The islands known to be in ``round_id`` before this island reached it (they asked to join it, or lead it
        and said so) → the digest of the θ_global each enters it with (:func:`peers.fingerprints.digest`; None if
        its message carried none)."""
        with self._lock:
            return {**self._arrivals.get(round_id, {}), **self._passed_over.get(round_id, {})}

    def decline(self, round_id: str) -> None:
        """This island takes no part in ``round_id`` (it leaves the round out, or catches up past it): islands whose
        join comes to it, taking it for the round's leader, are told to try the next one in the order."""
        self._stop_taking(round_id, PASS_BODY)

    def _stop_taking(self, round_id: str, body: bytes, answer: bool = True) -> dict[str, tuple[dict, str]]:
        """From now on this island answers every join of ``round_id`` with ``body``, and answers so the joins
        already in its inbox (each was told this island is there) unless not ``answer``.  The joins it took:
        (metadata, endpoint) by island."""
        return self._answer_joins(round_id, body, (lambda _: not answer), close=True)

    def _answer_joins(self, round_id: str, body: bytes, keep: Callable[[str], bool], close: bool = False
                      ) -> dict[str, tuple[dict, str]]:
        """Take the joins of ``round_id`` from the inbox and answer them with ``body``, but those of the islands
        ``keep`` names; ``close``: and answer so every join that comes later.  The joins taken: (metadata, endpoint) by
        island.  Taken under the lock that decides whether a join is kept, so that none is kept after the inbox
        was emptied for the last time (its sender would wait for an answer that never comes)."""
        key = JOIN + round_id
        with self._lock:
            if close:
                self._closed[round_id] = body
                while len(self._closed) > CLOSED_ROUNDS:
                    self._closed.popitem(last=False)
            pending = self.transport.box.wait_for(key, lambda m: True, 0.0)
            self.transport.box.release(key, drop=True)
        taken = {}
        for island, payload in pending.items():
            joined = _read_join(payload, round_id)
            if joined is None:
                continue
            taken[island] = joined
            if not keep(island):
                threading.Thread(target=self._answer, args=(joined[1], ROSTER + round_id, body), daemon=True).start()
        return taken

    def close(self) -> None:
        """Stop answering joins."""
        if self.transport.handlers.get(JOIN) == self._on_join:
            del self.transport.handlers[JOIN]
        if self.transport.handlers.get(ARRIVED) == self._on_arrived:
            del self.transport.handlers[ARRIVED]

    def _on_arrived(self, key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        """A leader says it came to a round, or an island names the leader it follows: kept as a leader of that round
        (and, for a round this island has not reached, for :meth:`asked`).  Told so while following another leader,
        this island answers with the one it follows."""
        round_id = key.removeprefix(ARRIVED)
        said = _read_arrival(payload, sender)
        if said is None:
            return True
        entering, leader, where = said
        answer = None
        with self._lock:
            if round_id in self._closed:
                return True
            if round_id != self._current:
                if leader == sender:
                    _remember(self._arrivals, round_id, sender, entering)
            elif self._following is not None and leader == sender and self._following[0] != sender:
                answer = self._following
            if leader != self.island:
                _remember(self._leading, round_id, leader, where)
        if answer is not None and where:
            threading.Thread(target=self._answer, args=(where, ARRIVED + round_id,
                                                       json.dumps({"leader": list(answer)}).encode()),
                             daemon=True).start()
        return True

    def _leaders_known(self, round_id: str) -> dict[str, str]:
        """The islands known to lead ``round_id`` (:attr:`_leading`) → the endpoint given ('' if none)."""
        with self._lock:
            return dict(self._leading.get(round_id, {}))

    def _say_arrived(self, round_id: str, meta: dict, islands: Mapping[str, str]) -> None:
        """Tell ``islands`` (island → endpoint: those a leader expects) that it came to ``round_id``, each in a thread
        of its own (an island that is gone costs nobody a wait)."""
        body = json.dumps({"digest": _digest_of(meta.get("state_fingerprint")), "endpoint": self._endpoint}).encode()
        deadline = time.monotonic() + self.request_timeout
        for where in islands.values():
            if where:
                threading.Thread(target=self._answer, args=(where, ARRIVED + round_id, body, deadline),
                                 daemon=True).start()

    def _on_join(self, key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        """A join: kept for the roster this island is forming (and told it is there), or answered at once: the
        roster left already, this island takes no part in the round, or has not reached it yet."""
        round_id = key.removeprefix(JOIN)
        endpoint = extra.get("endpoint") if isinstance(extra, dict) else None
        with self._lock:
            sent = self._closed.get(round_id)
            here = sent is None and round_id == self._current
            if sent is None and not here:
                sent = NOT_YET_BODY
                _remember(self._passed_over, round_id, sender, _entering(payload))
            if here:  # into the inbox while the lock is held: whoever stops taking joins finds it there
                self.transport.box.put(key, sender, payload)
        if isinstance(endpoint, str) and endpoint:
            threading.Thread(target=self._answer, args=(endpoint, (HERE if here else ROSTER) + round_id,
                                                       b"" if here else sent), daemon=True).start()
        return True

    def _answer(self, endpoint: str, key: str, body: bytes, deadline: float | None = None) -> None:
        try:
            self.transport.send(endpoint, key, body, deadline or time.monotonic() + self.request_timeout + 5.0)
        except TransportError as e:
            log.debug("could not answer %s at %s: %s", key, endpoint, e)

    # ---------------------------------------------------------------------------------------------- forming
    def form(self, round_id: str, meta: dict, view: RoundView, deadline: float,
             give_up: Callable[[], RoundResult | None], refresh: Callable[[], RoundView] | None = None
             ) -> dict[str, dict] | RoundResult:
        """This island's roster of ``round_id`` (member → metadata, ours ``meta`` included), or the failed result of
        a round that formed none by ``deadline`` (``time.monotonic``).  ``give_up()`` is asked about once a
        second: a result ends the wait with it (the island is stopping, the run moved past the round, a group
        listed us that we missed).  ``refresh()`` reads the registry again: a leader still without a group (islands
        that read the registry at another moment took another island for the leader) looks again, and when the fresh
        order names an island before it, sends its joiners on to that one and joins it too; the leader of a new run's
        first round looks again before it closes its roster."""
        endpoint = self._endpoint = view.endpoints.get(self.island, "") or self.transport.endpoint
        body = json.dumps(dict(meta, endpoint=endpoint)).encode()
        with self._lock:
            self._current = round_id
            askers = set(self._passed_over.pop(round_id, {}))
            self._arrivals.pop(round_id, None)
        self._refresh, self._followed = refresh, None
        # an island that came after a leader said it leads the round joins it, rather than asking the order again
        known = {i: where for i, where in self._leaders_known(round_id).items() if _may_lead(view, i)}
        view = replace(view, endpoints={**{i: w for i, w in known.items() if w}, **view.endpoints})
        first = leader_order(known, round_id)
        try:
            handoffs, handed_to = 0, ""
            while True:
                self._not_there = set()
                formed = self._form(round_id, meta, view, deadline, give_up, body, endpoint, askers, first)
                if formed is not HANDED_OFF:
                    return formed
                # handed over to an island that then said it had not reached the round: a wait for it, not leaders
                # that disagree (40M, rounds in flight: 3 such hand-offs in 3 s gave up a round the other island
                # was still training towards)
                if handed_to not in self._not_there:
                    handoffs += 1
                if handoffs > HANDOFFS:
                    return RoundResult(False, f"averaging failed: the islands of round {round_id} never agreed on a "
                                       f"leader")
                view, askers, handed_to = self._handed_to, set(), self._handed_first
                first = [handed_to]
        finally:
            # joins that still come (or wait in the inbox) are sent on to the leader we followed, or on to the next
            # one in their order when we formed no roster; a leader answered them already
            if round_id not in self._closed:
                followed = self._followed
                self._stop_taking(round_id, PASS_BODY if followed is None else
                                  json.dumps({"redirect": list(followed)}).encode())
            with self._lock:
                self._current = ""
                self._leading.pop(round_id, None)

    def _form(self, round_id: str, meta: dict, view: RoundView, deadline: float,
              give_up: Callable[[], RoundResult | None], body: bytes, endpoint: str, askers: set[str],
              first: Sequence[str] = ()) -> dict[str, dict] | RoundResult:
        """:meth:`form`, once this island is in the round.  The round's leader is the first island of the order that
        is there when the others look: an island asks those before it in the order, joins the first that is there,
        and leads when none is.  One that came late joins an island known to lead the round (``first``: it said so,
        or this island handed the round over to it), else the first of the islands later in the order that asked it
        before (``askers``): it leads, or follows the leader and sends us on.  An island that leads no round (a
        newcomer) and finds none of them there yet asks again until one is."""
        order = self._order = view.leaders(round_id) or [self.island]
        mine = order.index(self.island) if self.island in order else len(order)
        later = [c for c in order[mine + 1:] if c in askers]
        for leader in [c for c in first if c != self.island] + later[:1]:
            followed = self._join(leader, round_id, view, deadline, give_up, body, endpoint)
            if isinstance(followed, dict) or followed not in (PASSED, NOT_THERE, UNREACHABLE):
                return self._lead(round_id, meta, view, deadline, give_up) if followed is LEAD else followed
        while True:
            waiting = False
            for leader in order:
                if leader == self.island:
                    return self._lead(round_id, meta, view, deadline, give_up)
                followed = self._join(leader, round_id, view, deadline, give_up, body, endpoint)
                if followed is LEAD:
                    return self._lead(round_id, meta, view, deadline, give_up)
                if followed is NOT_THERE:
                    waiting = True
                    self._not_there.add(leader)
                elif followed not in (PASSED, UNREACHABLE):
                    return followed
            if not waiting or time.monotonic() >= deadline:
                return RoundResult(False, f"averaging failed: none of the {len(order)} island(s) that could lead "
                                   f"round {round_id} was reachable")
            stop = give_up()
            if stop is not None:
                return stop
            time.sleep(0.2)

    def _join(self, leader: str, round_id: str, view: RoundView, deadline: float,
              give_up: Callable[[], RoundResult | None], body: bytes, endpoint: str) -> dict[str, dict] | RoundResult:
        """Send our join to ``leader`` and follow it (see :meth:`_follow`); :data:`UNREACHABLE` when it cannot be
        reached."""
        where = view.endpoints.get(leader)
        if not where:
            return UNREACHABLE
        try:
            self.transport.send(where, JOIN + round_id, body, min(deadline, time.monotonic() + self.request_timeout),
                                {"endpoint": endpoint})
        except TransportError as e:
            log.info("round %s: could not reach its leader %s (%s); trying the next", round_id, leader[-8:],
                     "gone" if isinstance(e, GoneError) else e)
            return UNREACHABLE
        return self._follow(round_id, leader, where, deadline, give_up, body, endpoint)

    def _follow(self, round_id: str, leader: str, where: str, deadline: float,
                give_up: Callable[[], RoundResult | None], body: bytes, endpoint: str
                ) -> dict[str, dict] | RoundResult:
        """Wait for the roster of the leader we joined (it may wait for islands still training).  Joins that reach
        this island meanwhile (their senders took it for the leader) are told whom it follows; told so in turn, we
        join that leader instead (up to :data:`REDIRECTS` times)."""
        box, key, here = self.transport.box, ROSTER + round_id, HERE + round_id
        box.hold(key)
        redirected = 0
        self._following = (leader, where)
        try:
            while True:
                got = box.wait_for(key, lambda m: leader in m, min(deadline, time.monotonic() + POLL))
                # only once our leader said it is there are joins sent on to it: until then this island may yet
                # lead them (if its leader turns out not to have reached the round)
                if leader in box.wait_for(here, lambda m: True, 0.0):
                    if leader in self.transport.box.wait_for(JOIN + round_id, lambda m: True, 0.0) and \
                            self._before(leader):
                        return LEAD  # our leader follows us in turn: of the two, the one first in the order leads
                    self._redirect_joins(round_id, leader, where)
                if leader in got:
                    sent = got[leader]
                    if bytes(sent) == PASS_BODY:
                        return PASSED
                    if bytes(sent) == NOT_YET_BODY:
                        return NOT_THERE
                    if bytes(sent) == CLOSED_BODY:
                        return RoundResult(False, "the other islands moved past this round without this island (it "
                                           "joined after their roster left)", left_behind=True)
                    turn = _read_redirect(sent)
                    if turn is not None and turn[0] == self.island:
                        return LEAD  # the island we joined follows us: we lead (its join waits in our inbox)
                    if turn is not None and redirected >= REDIRECTS:
                        return UNREACHABLE
                    if turn is not None:
                        redirected += 1
                        box.release(key, drop=True)
                        box.hold(key)
                        leader, where = self._following = turn
                        try:
                            self.transport.send(where, JOIN + round_id, body,
                                                min(deadline, time.monotonic() + self.request_timeout),
                                                {"endpoint": endpoint})
                        except TransportError as e:
                            return RoundResult(False, f"averaging failed: could not reach the round's leader "
                                               f"{leader[-8:]} ({e})")
                        continue
                    members = unpack(sent)
                    if members is None:
                        return RoundResult(False, f"averaging failed: the leader of round {round_id} sent a roster "
                                           f"that could not be read ({bytes(sent)[:40]!r})")
                    if self.island not in members:
                        return RoundResult(False, "the other islands moved past this round without this island (it "
                                           "joined after their roster left)", left_behind=True)
                    self._followed = (leader, where)
                    return members
                if time.monotonic() >= deadline:
                    return RoundResult(False, "averaging failed: no roster came from the round's leader within "
                                       "the matchmaking timeout")
                stop = give_up()
                if stop is not None:
                    return stop
                if refuses(where):  # the leader is gone (nothing listens at its address): the next one leads
                    log.info("round %s: its leader %s is gone; trying the next", round_id, leader[-8:])
                    return UNREACHABLE
        finally:
            self._following = None
            box.release(key, drop=True)
            box.release(here, drop=True)

    def _before(self, island: str) -> bool:
        """Whether this island comes before ``island`` in the round's leader order as it sees it (an island the
        order does not name comes after every one it does)."""
        rank = {c: i for i, c in enumerate(self._order)}
        return rank.get(self.island, len(rank)) < rank.get(island, len(rank) + 1)

    def _redirect_joins(self, round_id: str, leader: str, where: str) -> None:
        """Tell the islands whose joins reached this follower which leader it follows (their view of the run
        differed from ours: a newcomer, or an island that found another one gone).  A join from our own leader means
        it follows us in turn (it came late and joined an island that had asked it, see :meth:`_form`); it comes
        before us in the order (else we would lead, see :meth:`_follow`), and told that it follows itself, it
        leads."""
        self._answer_joins(round_id, json.dumps({"redirect": [leader, where]}).encode(), lambda _: False)

    def _lead(self, round_id: str, meta: dict, view: RoundView, deadline: float,
              give_up: Callable[[], RoundResult | None]) -> dict[str, dict] | RoundResult:
        """Gather the joins of the round until every expected island joined, or a majority did and the grace
        window passed (or ``deadline``), and at least ``min_group_size`` did; send the roster to every member."""
        box, key = self.transport.box, JOIN + round_id
        box.hold(key)
        with self._lock:  # leading after all (it had handed the round over): joins come to it again
            self._closed.pop(round_id, None)
        expected = set(view.expected) - {self.island}
        self._say_arrived(round_id, meta, {i: view.endpoints.get(i, "") for i in expected})
        majority_since: float | None = None
        members: dict[str, dict] = {self.island: meta}
        endpoints: dict[str, str] = {}
        rivals: set[str] = set()
        # a new run's first read of the registry may have missed islands (their records reached the DHT's nodes a
        # moment apart, or the read timed out): its leader looks again before it closes the roster
        looks_left = 0 if view.committed or self._refresh is None else CONFIRMING_LOOKS
        next_look = time.monotonic() + POLL
        try:
            while True:
                for island, payload in box.wait_for(key, lambda m: set(m) >= expected,
                                                    min(deadline, time.monotonic() + 0.25)).items():
                    if island in members or island == self.island:
                        continue
                    joined = _read_join(payload, round_id)
                    if joined is not None:
                        members[island], endpoints[island] = joined
                for rival, where in self._leaders_known(round_id).items():
                    if rival in rivals or rival in members or not _may_lead(view, rival):
                        continue
                    rivals.add(rival)
                    where = where or view.endpoints.get(rival, "")
                    if where and _order_key(round_id, rival) < _order_key(round_id, self.island):
                        log.info("round %s: %s leads it too and comes first in the order: handing the round over to "
                                 "it", round_id, rival[-8:])
                        self._hand_over(round_id, rival, replace(view, endpoints={**view.endpoints, rival: where},
                                                                 expected=view.expected | {rival}))
                        return HANDED_OFF
                    expected.add(rival)  # it hands its round over to this one, told that it leads it too
                    self._say_arrived(round_id, meta, {rival: where})
                now = time.monotonic()
                enough = len(members) >= self.min_group_size
                # a new run's first read of the registry may not list every island registered yet (its records
                # reach the DHT's nodes a moment apart): one missing from it would come after the roster left
                complete = expected <= set(members) and (bool(view.committed) or len(members) >= self.wait_for)
                # a target reached by islands holding no majority would close a roster bound to roll back, while
                # the committed islands it lacks are still on their way
                short = quorum_problem(members, view.committed, view.out, view.seen, self.wait_for)
                if enough and (complete or (self.target and len(members) >= self.target and not short)):
                    if not looks_left:
                        break
                    looks_left -= 1
                    fresh = self._refresh()
                    new = {i: fresh.endpoints[i] for i in fresh.expected - set(members) - expected - {self.island}
                           if fresh.endpoints.get(i)}
                    if not new:
                        break
                    log.info("round %s: a second look at the registry lists %d island(s) the first missed; waiting "
                             "for them", round_id, len(new))
                    expected |= set(new)
                    view.endpoints.update(new)
                    view.seen = max(view.seen, fresh.seen)
                    self._say_arrived(round_id, meta, new)
                    continue
                if enough and not short:
                    majority_since = majority_since or now
                    if now - majority_since >= self.matchmaking_time:
                        break
                if now >= deadline:
                    break
                if now >= next_look:
                    next_look = now + POLL
                    stop = give_up()
                    if stop is not None:
                        self._stop_taking(round_id, PASS_BODY)
                        return stop
                    if self._refresh is not None and (not enough or short):
                        handed = self._hand_off(round_id, members)
                        if handed:
                            return HANDED_OFF
                    gone = {i for i in expected - set(members) if refuses(view.endpoints.get(i, ""))}
                    if gone:
                        log.info("round %s: %d expected island(s) are gone; not waiting for them", round_id, len(gone))
                        expected -= gone
                        # the members count the majority without them (the roster carries what its leader found)
                        meta["out"] = sorted(set(meta.get("out", [])) | (gone & set(view.committed)))
                        view.out |= gone & set(view.committed)
            # joins that came since the last look came in time: they are members too
            for island, (joined, where) in self._stop_taking(round_id, CLOSED_BODY, answer=False).items():
                if island not in members and island != self.island:
                    members[island], endpoints[island] = joined, where
            body = pack(members)
            log.debug("round %s: led a roster of %d island(s)", round_id, len(members))
        finally:
            box.release(key, drop=True)
        others = [(endpoints[i], ROSTER + round_id, body, None) for i in members if i != self.island]
        failed = send_all(self.transport, others, time.monotonic() + self.request_timeout + 5.0)
        if failed:
            log.info("round %s: the roster could not reach %d member(s)", round_id, len(failed))
        return members

    def _hand_off(self, round_id: str, members: Mapping[str, dict]) -> bool:
        """A leader still without a group reads the registry again; when the fresh order names an island before it,
        it sends its joiners on to that one (and answers later joins so), to join it too.  Whether it did."""
        fresh = self._refresh()
        order = fresh.leaders(round_id)
        before = order[:order.index(self.island)] if self.island in order else order
        first = next((c for c in before if c not in members and fresh.endpoints.get(c)), None)
        if first is None:
            return False
        log.info("round %s: the registry now names %s before this island: handing the round over to it", round_id,
                 first[-8:])
        self._hand_over(round_id, first, fresh)
        return True

    def _hand_over(self, round_id: str, leader: str, view: RoundView) -> None:
        """Send this leader's joiners on to ``leader`` (at its endpoint in ``view``), answer later joins so, and join
        it next with ``view`` (:meth:`form` goes on from :attr:`_handed_to`)."""
        self._stop_taking(round_id, json.dumps({"redirect": [leader, view.endpoints[leader]]}).encode())
        self._handed_to, self._handed_first = view, leader

PASSED = RoundResult(False, "the leader takes no part in the round")
"""What :meth:`RosterForming._follow` returns when the leader we joined declined the round."""
LEAD = RoundResult(False, "the leader we joined follows us")
"""What :meth:`RosterForming._follow` returns when the island we joined took us for its leader."""
NOT_THERE = RoundResult(False, "the leader has not reached the round yet")
UNREACHABLE = RoundResult(False, "the leader cannot be reached")
HANDED_OFF = RoundResult(False, "this island handed its round over to a leader before it in the order")
HANDOFFS = 2
"""How many times one island hands a round over before it gives the round up (a hand-off to an island that had not
reached the round yet does not count: the round waits for it until the matchmaking deadline)."""
REDIRECTS = 4
"""How many times a joiner follows a follower on to its leader before it tries the next island of the order."""
CONFIRMING_LOOKS = 3
"""How many more reads of the registry the leader of a new run's first round makes before it closes its roster
(each finds islands the reads before it missed, or the roster closes)."""
"""What :meth:`RosterForming._follow` returns when the leader we joined is still training towards the round."""


def _may_lead(view: RoundView, island: str) -> bool:
    """Whether ``island`` may lead a round of an island holding ``view``: it is of the committed roster and not known
    to be out of the round (before any round committed: any island not known to be out)."""
    candidates = set(view.committed) - view.out
    return island in candidates if candidates else island not in view.out


def _remember(rounds: OrderedDict[str, dict], round_id: str, island: str, value: Any) -> None:
    """``rounds[round_id][island] = value``, keeping the last :data:`CLOSED_ROUNDS` rounds."""
    rounds.setdefault(round_id, {})[island] = value
    while len(rounds) > CLOSED_ROUNDS:
        rounds.popitem(last=False)


def _read_redirect(payload: bytes | bytearray | memoryview) -> tuple[str, str] | None:
    """(leader, its endpoint) of a follower's redirect, or None if ``payload`` is not one."""
    try:
        body = json.loads(bytes(payload))
        leader, where = body["redirect"]
        return (leader, where) if isinstance(leader, str) and isinstance(where, str) and where else None
    except (ValueError, KeyError, TypeError):
        return None


def _entering(payload: bytes | bytearray | memoryview) -> list[float] | None:
    """The digest of the θ_global a join's sender enters the round with (None if it carries no fingerprint)."""
    try:
        return _digest_of(json.loads(bytes(payload)).get("state_fingerprint"))
    except (ValueError, AttributeError):
        return None


def _digest_of(state: Any) -> list[float] | None:
    """The digest of a θ_global fingerprint as a join carries it (None if it is none: anything may come)."""
    try:
        return digest([float(x) for x in state]) if isinstance(state, list) and state else None
    except (ValueError, TypeError):
        return None


def _read_arrival(payload: bytes | bytearray | memoryview, sender: str
                  ) -> tuple[list[float] | None, str, str] | None:
    """(digest, leader, its endpoint) of an arrival notice (:data:`ARRIVED`) from ``sender``: the leader is the sender
    itself (the digest of the θ_global it enters with, None if none; its endpoint, '' if none), or the one it
    follows (no digest).  None if it is neither (anything may come)."""
    try:
        body = json.loads(bytes(payload))
        named = body.get("leader")
        if named is not None:
            leader, where = named
            return (None, leader, where) if isinstance(leader, str) and isinstance(where, str) and where else None
        said, where = body.get("digest"), body.get("endpoint", "")
        entering = [float(x) for x in said] if isinstance(said, list) and said else None
        return entering, sender, where if isinstance(where, str) else ""
    except (ValueError, TypeError, AttributeError):
        return None


def _read_join(payload: bytes | bytearray | memoryview, round_id: str) -> tuple[dict, str] | None:
    """(metadata, endpoint) of a join, or None if it is not one for ``round_id`` (anything may come)."""
    try:
        meta = json.loads(bytes(payload))
    except ValueError:
        return None
    if not isinstance(meta, dict) or str(meta.get("round_id")) != round_id:
        return None
    endpoint = meta.get("endpoint")
    return (meta, endpoint) if isinstance(endpoint, str) and endpoint else None
