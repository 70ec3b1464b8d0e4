"""Messages that arrive before anyone waits for them (verdicts, encoded parts), kept by key and sender,
and the rounds we stood out of, whose late messages we still answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from peers.wire.round_keys import is_on_round, names_group

MAX_KEYS = 1024
"""Keys buffered for waits not yet held here (verdicts can arrive before our all-reduce ends)."""
MAX_GROUP = 1024
"""Most members a message may list as its group (more: the list is ignored)."""
MAX_ANSWERED = 64
"""Keys we stood out of (abstained, declined) whose late messages we still answer."""
GONE = object()
"""Inbox entry of a member that could not be reached and left no verdict in the DHT record; a verdict
that still arrives replaces it."""


class Inbox:
    """Messages received (verdicts, encoded pseudo-gradients), by key and sender; a waiter wakes as soon
    as one arrives."""

    def __init__(self, ttl: float, max_keys: int = MAX_KEYS):
        self.ttl, self.max_keys = ttl, max_keys
        self._changed = threading.Condition()
        self._votes: dict[str, dict[str, Any]] = {}
        self._born: dict[str, float] = {}
        self._groups: dict[str, list[str]] = {}
        self._held: set[str] = set()

    def put(self, key: str, sender: str, value: Any, group: Sequence[str] = ()) -> None:
        """Keep ``sender``'s message on ``key`` (its first one; a real one replaces :data:`GONE`) and wake
        the waiters.  ``group``: the members the message says the key's group has, kept when the key names
        that group and ``sender`` is in it."""
        with self._changed:
            if key not in self._votes:
                self._prune()
                if len(self._votes) >= self.max_keys:
                    return
                self._votes[key], self._born[key] = {}, time.monotonic()
            if self._votes[key].get(sender, GONE) is GONE:
                self._votes[key][sender] = value
            group = sorted(group) if len(group) <= MAX_GROUP else []
            if key not in self._groups and sender in group and names_group(key, group):
                self._groups[key] = group
            self._changed.notify_all()

    def _prune(self) -> None:
        """Forget keys no wait holds that are older than ``ttl``, then the oldest ones beyond ``max_keys``."""
        now, excess = time.monotonic(), len(self._votes) + 1 - self.max_keys  # room for one more key
        for i, (born, k) in enumerate(sorted((t, k) for k, t in self._born.items() if k not in self._held)):
            if i >= excess and now - born <= self.ttl:
                break  # oldest first: the rest is younger
            del self._votes[k], self._born[k]
            self._groups.pop(k, None)

    def wait_for(self, key: str, done: Callable[[dict[str, Any]], bool], deadline: float) -> dict[str, Any]:
        """Block until ``done(messages on key)`` or ``deadline`` (``time.monotonic``); the messages then."""
        with self._changed:
            while True:
                votes = dict(self._votes.get(key, {}))
                left = deadline - time.monotonic()
                if done(votes) or left <= 0:
                    return votes
                self._changed.wait(left)

    def first_since(self, match: Callable[[str], bool], since: float) -> tuple[float, str] | None:
        """(when, as ``time.monotonic``; on which key) the first message arrived on a key ``match`` accepts,
        among keys first seen at or after ``since``; None if none did."""
        with self._changed:
            return min(((t, k) for k, t in self._born.items() if t >= since and match(k)), default=None)

    def keys_on_round(self, round_id: str) -> list[str]:
        """The keys of messages on round ``round_id`` (see :func:`peers.wire.round_keys.is_on_round`)."""
        with self._changed:
            return [k for k in self._votes if is_on_round(k, round_id)]

    def senders(self, key: str) -> list[str]:
        """Who sent a message on ``key`` (members we could not reach left out)."""
        with self._changed:
            return sorted(s for s, v in self._votes.get(key, {}).items() if v is not GONE)

    def group(self, key: str, me: str) -> list[str]:
        """The members of ``key``'s group: as its messages listed them, else (none did: DHT-borne verdicts)
        those who sent a message on it, and ``me``."""
        with self._changed:
            return self._groups.get(key) or sorted({*self.senders(key), me})

    def hold(self, key: str) -> None:
        """Keep ``key``'s messages until :meth:`release` (a wait on it is under way)."""
        with self._changed:
            self._held.add(key)

    def release(self, key: str, drop: bool = False) -> None:
        """The wait on ``key`` is over: its messages may age out (``drop``: forget them now)."""
        with self._changed:
            self._held.discard(key)
            if drop and key in self._votes:
                del self._votes[key], self._born[key]
                self._groups.pop(key, None)


class LateAnswers:
    """Keys of rounds we stood out of (abstained on a vote, declined an exchange), whom we told, and what to
    tell the members whose messages on such a key come later: a member we did not know of when we stood out
    must not wait for us either.  Bounded: the oldest key is forgotten first."""

    def __init__(self, max_keys: int = MAX_ANSWERED):
        self.max_keys = max_keys
        self._keys: dict[str, tuple[set[str], Any]] = {}

    def remember(self, key: str, told: Iterable[str], answer: Any) -> None:
        """We stood out of ``key``'s round and told ``told``; ``answer``: what :meth:`newcomer` gives."""
        while len(self._keys) >= self.max_keys:
            del self._keys[next(iter(self._keys))]
        self._keys[key] = (set(told), answer)

    def newcomer(self, key: str, sender: str) -> Any:
        """The answer owed to ``sender``, who just wrote on ``key``, if we stood out of that round without
        telling it (it is told from now on); None otherwise."""
        entry = self._keys.get(key)
        if entry is None or sender in entry[0]:
            return None
        entry[0].add(sender)
        return entry[1]
