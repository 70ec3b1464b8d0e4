"""Talking to other islands: who is in the run, the bytes of a round, the group and its vote, and the island's
averagers that put them together.

**The front door.**  The trainer (``diloco``) imports peers only from here: :class:`PeerNode` (an island rank's
place in the run: its DHT node, transport, member registry and averager) and the handful of plain pieces it hands
over or reads back (the canonical layout and the island's bucket exchange, a round's result, fingerprints of
θ_global, state downloads, traffic counts, the errors that end a start with one line).  They are loaded on first
use, so that ``import peers`` costs nothing (hivemind takes a second to import).  ``tests/test_imports.py``
keeps ``diloco`` on this side of the door.

Where a change belongs, by folder:

- :mod:`peers.discovery`: who is in the run (the DHT, the run key that signs a private run's records, the member
  registry with its heartbeats);
- :mod:`peers.island`: the island's own side of a round (the canonical layout of a pseudo-gradient whatever the
  island's shape, the in-server collectives that gather its buckets onto their owners and scatter the averages);
- :mod:`peers.wire`: the bytes between islands (the transport and its sealed connections, islands behind NAT,
  codecs' payloads on the wire, state for joiners, traffic counters, the link probe);
- :mod:`peers.group`: a round's group with the other islands and its vote (matchmaking belongs here);
- :mod:`peers.averaging`: the island's averagers (sharded over its ranks, the torch fallback, local);
- :mod:`peers.node`: the peer node that starts, connects and stops all of the above for one rank.

One floor per concept; a module imports its own floor and the floors below it, never one above (a test checks
it): plain data and math (:mod:`peers.settings`, :mod:`peers.errors`, :mod:`peers.result`,
:mod:`peers.fingerprints`, :mod:`peers.proctable`, :mod:`peers.aggregation`: the group's mean and the rules robust
to a lying member) → discovery and island → wire → group → averaging → node.

One round, top to bottom: :meth:`peers.averaging.sharded.ShardedAverager.start` gathers the island's buckets
(:class:`peers.island.exchange.BucketExchange`) → :meth:`peers.group.averager.VerifiedAverager.run_round` forms
the group and votes → each rank's buckets cross :func:`peers.wire.encoded.average_encoded` over
:class:`peers.wire.transport.Transport` → :meth:`~peers.averaging.sharded.ShardedAverager.finish` scatters
the result.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {  # name -> the module that defines it (a module itself where the name is the module's)
    # the peer node and what it is told
    "PeerNode": "peers.node", "round_id": "peers.node", "is_peer_file": "peers.node", "IDENTITY": "peers.node",
    "RUN_KEY": "peers.node",
    "PeerSettings": "peers.settings", "codec_backend_problem": "peers.settings", "port_problems": "peers.settings",
    "IslandRanks": "peers.island.ranks", "AGGREGATES": "peers.aggregation", "WEIGHTINGS": "peers.aggregation",
    "is_secret": "peers.settings", "obtain_run_key": "peers.discovery.run_key", "peer_id_of": "peers.discovery.dht",
    "mute_shutdown_noise": "peers.discovery.dht", "wait_until": "peers.discovery.membership",
    "Position": "peers.discovery.membership", "confirmed_position": "peers.discovery.membership",
    # errors that end an island's start with one line
    "PeerNetworkError": "peers.errors", "PortTakenError": "peers.errors", "RunKeyError": "peers.errors",
    # what the trainer hands over and reads back
    "CanonicalLayout": "peers.island.layout", "spec_tuple": "peers.island.layout",
    "BucketExchange": "peers.island.exchange", "FeedbackBuffers": "peers.averaging.sharded",
    "RoundResult": "peers.result", "as_float": "peers.result",
    "fingerprint": "peers.fingerprints", "fingerprints_agree": "peers.fingerprints", "STATS": "peers.fingerprints",
    "CHUNKS_PER_BUCKET": "peers.fingerprints", "digest": "peers.fingerprints",
    "Downloaded": "peers.wire.state_share", "download_state": "peers.wire.state_share:download",
    "witness_state": "peers.wire.state_share:witness",
    "Traffic": "peers.wire.counters", "WireCounter": "peers.wire.counters",
    "ring_allreduce_bytes": "peers.wire.counters",
    "descendants": "peers.proctable", "process_table": "peers.proctable", "process_trees": "peers.proctable",
    "socket_files": "peers.proctable",
    # ``diloco probe``: the link between two servers, measured before a run
    "probe": "peers.wire.probe:",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Load an exported name on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'peers' has no attribute {name!r}")
    module, _, attr = _EXPORTS[name].partition(":")
    loaded = importlib.import_module(module)
    value = loaded if _EXPORTS[name].endswith(":") else getattr(loaded, attr or name)
    globals()[name] = value
    return value
