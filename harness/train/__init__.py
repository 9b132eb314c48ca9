"""The drafter's training, in rooms stacked so that each imports only those below it:

* :mod:`harness.train.launch` — a run from its resolved config: run directories, starting the ranks, failure
  reports;
* :mod:`harness.train.loop` — one training rank: the :class:`~harness.train.loop.trainer.Trainer` and its
  components (data, evaluation, checkpoints, metrics, gradient statistics), assembled by ``build``;
* :mod:`harness.train.placement` — where the target and the drafter run, and the link that carries the target's
  features to the drafter ranks of a split;
* the base every room uses: ``config`` (the typed run config), ``distributed`` (ranks, process groups,
  collectives), ``status`` (each rank's stage, for failure reports), ``batch`` (micro-batches collated),
  ``rank_models`` (the models a rank builds).
"""
