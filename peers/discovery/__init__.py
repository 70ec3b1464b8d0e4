"""Who is in the run: starting and joining hivemind's DHT (:mod:`.dht`), reads and writes of it that cannot
hang (:mod:`.calls`), the run key that signs a private run's records, where an island finds it and how it is
stretched when weak (:mod:`.run_key`), records only their owner can write (:mod:`.owned`), and the member
registry with its heartbeats (:mod:`.membership`).

May import: :mod:`peers.settings`, :mod:`peers.errors`, :mod:`peers.fingerprints`, :mod:`peers.identity`, hivemind.
"""
