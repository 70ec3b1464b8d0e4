"""What an island does about a group that listed it but whose roster it never received.

A round's leader can list an island in its roster and send it to every member but that one (the message lost,
or the island gave up waiting just then): the group then averages without its part, and its members vote, or
wait for its encoded part.  The island learns of it from those messages, which reach it while it still waits for
a roster, or just after it gave up.  It then abstains on the group's vote (or declines its exchange), so that
the members count it as alive and all of them go round again at once under the retry's round id, instead of
waiting for it until their timeouts and for each other under different round ids.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from peers.result import RoundResult
from peers.settings import AveragerSettings
from peers.wire.round_keys import is_on_round

log = logging.getLogger("peers.group.averager")

MISSED_GRACE = 1.0
"""Seconds an island whose step failed waits for the verdicts or parts of a group that listed it anyway
(its matchmaking gave up just as that group's all-reduce ran without it)."""
PARTS_GRACE = 2.0
"""Seconds an island still looking for its group waits after encoded parts of its round reached it before it
concludes that it was listed in a group it never learned of."""


class MissedGroups:
    """Part of :class:`peers.group.averager.VerifiedAverager`: standing out of the rounds of groups we missed."""

    peer_id: str
    settings: AveragerSettings
    _votes: Any
    _parts: Any
    _vote: Callable[..., tuple[str, int, int]]

    def _missed_group(self, key: str, round_id: str) -> RoundResult:
        """Verdicts on our round came while we were in no group: a group listed us, but its roster never
        reached us (the leader's message was lost), and it averaged without our part.
        Abstain on that group's vote so that its members stop waiting for us and all go round again."""
        peers = self._votes.box.group(key, self.peer_id)
        log.info("a group averaged this round without this island (its roster never reached it); abstaining")
        return self._abstain(peers, round_id, "averaging failed: a group listed this island but it never "
                             "learned of it (its roster never came), and the group averaged without it; abstained",
                             key)

    def _listed_meanwhile(self, round_id: str, since: float) -> RoundResult | None:
        """Our step failed (most often: no group formed).  If a group that listed us averaged this round
        without us, its verdicts (or parts) reach us within moments of our failure: abstain on its vote
        (decline its exchange) so that its members count us as alive and we all go round again under
        their retry id, instead of each waiting for the other under a different round id.  None if no
        such message comes within ``MISSED_GRACE`` seconds."""
        deadline = time.monotonic() + MISSED_GRACE
        while (missed := self._missed(round_id, since, 0.0)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return missed

    def _missed(self, round_id: str, since: float, parts_grace: float) -> RoundResult | None:
        """While we are in no group: a group's verdicts on our round, or its encoded parts that came at
        least ``parts_grace`` seconds ago (members send them once their all-reduce ended: if we are still
        looking a moment later, it ran without us), mean a group listed us that we never learned of;
        abstain on its vote or decline its exchange.  None if neither came."""
        listed = self._votes.box.first_since(lambda key: is_on_round(key, round_id), since)
        if listed is not None:
            return self._missed_group(listed[1], round_id)
        parts = self._parts.box.first_since(lambda key: is_on_round(key, round_id), since) \
            if self._parts is not None else None
        if parts is not None and time.monotonic() > parts[0] + parts_grace:
            return self._missed_exchange(parts[1], round_id)
        return None

    def _missed_exchange(self, key: str, round_id: str) -> RoundResult:
        """As :meth:`_missed_group`, earlier: the group's members sent us their encoded parts and wait for
        ours, which would keep them ``allreduce_timeout``.  Decline, so that all of us go round again now."""
        peers = self._parts.box.group(key, self.peer_id)
        log.info("a group listed this island but it never learned of it (its roster never came); declining its "
                 "exchange")
        self._parts.decline(key, [p for p in peers if p != self.peer_id], self.settings.request_timeout + 5.0)
        return RoundResult(False, "averaging failed: a group listed this island but it never learned of it (its "
                           "roster never came); declined its exchange of encoded parts", group_size=len(peers), peers=peers,
                           members_left=len(peers), retryable=len(peers) >= self.settings.min_group_size)

    def _abstain(self, peers: list[str], round_id: str, reason: str, key: str | None = None) -> RoundResult:
        """We have no result while others voted on ``round_id`` (``key``: their vote's key, when we cannot tell
        the group): tell them and learn who is left."""
        _, voters, left = self._vote(None, peers, round_id, key)
        return RoundResult(False, reason, group_size=len(peers), peers=peers, voters=voters, members_left=left,
                           retryable=left >= self.settings.min_group_size)
