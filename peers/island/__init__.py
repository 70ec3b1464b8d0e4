"""The island's own side of a round: how its ranks hold a pseudo-gradient and move it among themselves, whatever
the island's shape.

- :mod:`.layout`: the run's canonical layout (the whole model cut into buckets, the same on every island) and where
  each rank's shards sit in it;
- :mod:`.exchange`: the in-server collectives over the island's process group (a bucket's pieces gathered onto
  its owner rank, the averages scattered back, fingerprints of θ_global identical on every shape);
- :mod:`.ranks`: what the peer node needs of the island's process group (its control collectives).

Nothing here crosses a server's boundary: the bytes between islands are :mod:`peers.wire`'s.

May import: :mod:`peers.fingerprints`, torch.
"""
