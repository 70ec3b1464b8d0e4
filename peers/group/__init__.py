"""A round's group with the other islands and its vote: the roster, formed from the run's registry by one leader
every island can name, the rule that lets a round commit only for a majority of the run, and the split of a
large roster into groups (:mod:`.roster`); the verified round (:mod:`.averager`: roster → exchange → quorum →
vote); the vote itself (:mod:`.vote`); and a roster that listed us while we never received it
(:mod:`.missed_group`).

May import: :mod:`peers.settings`, :mod:`peers.result`, :mod:`peers.fingerprints`, :mod:`peers.discovery`,
:mod:`peers.island`, :mod:`peers.wire`, :mod:`outer_optim`, hivemind.
"""
