"""One training rank's loop: the :class:`~harness.train.loop.trainer.Trainer` and its components, built by
:mod:`harness.train.loop.build`."""
