"""The names a round goes by on the wire: its group, its exchange, its vote."""

from __future__ import annotations

import hashlib

_ROUND_TAG = ".round."


def group_key(peers: list[str], round_id: str) -> str:
    """A short name for one group (its sorted members) in one round."""
    return hashlib.sha1(("|".join(peers) + "#" + round_id).encode()).hexdigest()[:16]


def vote_key(prefix: str, peers: list[str], round_id: str) -> str:
    """The key of a group's vote on a round (direct verdicts and the DHT record).  The round comes last, so
    that a member still in the all-reduce can tell verdicts on its round arrived (:func:`is_on_round`)."""
    return f"{prefix}.vote.{group_key(peers, round_id)}{_ROUND_TAG}{round_id}"


def parts_key(peers: list[str], round_id: str) -> str:
    """The key of a group's exchange of encoded pseudo-gradients on a round (the round last, as in
    :func:`vote_key`: a member still looking for its group can tell parts of its round reached it)."""
    return f"{group_key(peers, round_id)}{_ROUND_TAG}{round_id}"


def names_group(key: str, peers: list[str]) -> bool:
    """Is ``key`` (a vote or parts key, under any stage prefix) the key of the group ``peers`` (sorted)?
    Lets a member that never learned its group trust the member list a message on the key carries."""
    head, tag, round_id = key.rpartition(_ROUND_TAG)
    return bool(tag) and head.endswith(group_key(peers, round_id))


def round_in(key: str) -> str:
    """The round id a vote or parts key is on (``""`` for any other key)."""
    _, tag, round_id = key.rpartition(_ROUND_TAG)
    return round_id if tag else ""


def is_on_round(key: str, round_id: str) -> bool:
    """Is ``key`` a vote or parts key of some group on round ``round_id`` (not on its retry, nor another round)?"""
    return key.endswith(_ROUND_TAG + round_id)
