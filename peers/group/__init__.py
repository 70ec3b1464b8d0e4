"""A round's group with the other islands and its vote: the island's hivemind averager, whose matchmaking
forms the group (:mod:`.matchmaking`), the verified round (:mod:`.averager`: group → exchange → vote), the
vote itself (:mod:`.vote`) and a group that listed us while our matchmaking never learned of it
(:mod:`.missed_group`).

May import: :mod:`peers.settings`, :mod:`peers.result`, :mod:`peers.fingerprints`, :mod:`peers.discovery`,
:mod:`peers.wire`, :mod:`outer_optim`, hivemind.
"""
