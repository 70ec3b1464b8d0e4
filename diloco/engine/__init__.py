"""One island rank, and the trainer core it shares with the synchronous baseline.

Where a change belongs, by module:

- :mod:`~diloco.engine.island`: the wiring of an island rank's parts and its training loop;
- :mod:`~diloco.engine.trainer`: the trainer core (builders, the inner step, the evaluation, the metric records
  and the summary) every trainer stands on, whatever its sync;
- :mod:`~diloco.engine.round`: the outer rounds (when they fall due, what is in flight, the transaction);
- :mod:`~diloco.engine.state_transfer`: θ_global between islands (catching up, serving joiners, resynchronizing);
- :mod:`~diloco.engine.checkpoints`: what a checkpoint holds (``{name: part}``, each part ``state_dict`` /
  ``load_state_dict``), resume and resharding;
- :mod:`~diloco.engine.runtime` (where this process sits: the island's process groups and mesh),
  :mod:`~diloco.engine.metrics` (records, W&B, the run's totals), :mod:`~diloco.engine.throughput`,
  :mod:`~diloco.engine.faults` (scripted faults for tests).
"""
