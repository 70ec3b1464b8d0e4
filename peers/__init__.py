"""Talking to other islands: who is in the run, the bytes of a round, the group and its vote, and the island's
averagers that put them together.

One floor per concept; a module imports its own floor and the floors below it, never one above (a test
checks it, ``tests/test_imports.py``):

0. plain data and math: :mod:`peers.settings` (what the config section ``averaging`` *is*),
   :mod:`peers.result` (the one result every averager returns), :mod:`peers.fingerprints`,
   :mod:`peers.proctable` (who started whom, from ``/proc``), :mod:`peers.aggregation` (the group's mean and
   the rules robust to a lying member);
1. :mod:`peers.discovery`: the DHT, the run key, the member registry (who is in the run);
2. :mod:`peers.wire`: the bytes (the canonical layout, moving pieces inside an island, the transport between
   islands, codecs' payloads on the wire, state for joiners, traffic counters, the link probe);
3. :mod:`peers.group`: a round's group with the other islands (hivemind's matchmaking) and its vote;
4. :mod:`peers.averaging`: the island's averagers (sharded over its ranks, the torch fallback, local).

One round, top to bottom: :meth:`peers.averaging.sharded.ShardedAverager.start` gathers the island's buckets
(:class:`peers.wire.exchange.BucketExchange`) → :meth:`peers.group.averager.VerifiedAverager.run_round` forms
the group and votes → each rank's buckets cross :func:`peers.wire.encoded.average_encoded` over
:class:`peers.wire.transport.Transport` → :meth:`~peers.averaging.sharded.ShardedAverager.finish` scatters
the result.
"""
