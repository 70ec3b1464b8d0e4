"""The island's averagers, what the trainer's rounds call (``start`` → ``finish``, or ``average``): sharded
over the island's ranks with hivemind groups (:mod:`.sharded`, one round's pieces in :mod:`.bucket_round`),
the hierarchical torch.distributed all-reduce (:mod:`.fallback`), and nobody (:mod:`.local`).  Every one
returns a :class:`peers.result.RoundResult`.

May import every other part of :mod:`peers`, and :mod:`outer_optim`.
"""
