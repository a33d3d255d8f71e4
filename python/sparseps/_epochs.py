"""A training loop's epochs as the job's membership shapes them (sparseps.EpochPlan): which share
of the data each epoch is this worker's and how many steps it takes, the same on every worker, as
sparseps-worker plans them (worker/trainer.cc)."""
import math

__all__ = ["EpochPlan"]


class EpochPlan:
    """The epochs of a worker's loop as sparseps-worker plans them. An epoch's share of the
    training data is split(first step) (Worker.data_split: shard index of count, the live
    workers' after a membership change, the same count on every worker) and its steps are
    (samples // count) // batch, so that every worker takes as many (not its shard's own length
    // batch: shards differ by a sample). `epochs` epochs (None: no end), cut at `max_steps` (0:
    no cut). Attributes: epoch (0-based), begin (its first step), index, count, steps (of this
    epoch), total (the run's last step as planned now; math.inf without an end), epochs (their
    number as planned now), horizon (total without the cut: a learning-rate schedule's end).
    ValueError when an epoch has no whole batch. Not thread-safe."""

    def __init__(self, split, samples, batch, epochs=None, max_steps=0):
        if batch < 1:
            raise ValueError(f"EpochPlan: a batch of {batch} samples")
        self.split, self.samples, self.batch = split, samples, batch
        self.planned, self.max_steps = epochs, max_steps
        self.seek(0)

    def _enter(self, epoch, begin):
        self.epoch, self.begin = epoch, begin
        self.index, self.count = self.split(begin)
        self.steps = (self.samples // self.count) // self.batch
        if self.steps == 0:
            raise ValueError(f"{self.samples // self.count} training samples on this worker: "
                             f"fewer than one batch of train.batch_size {self.batch}")
        self.horizon = self.total = (math.inf if self.planned is None else
                                     begin + (self.planned - epoch) * self.steps)
        if self.max_steps:
            self.total = min(self.total, self.max_steps)
        self.epochs = (math.inf if self.total == math.inf else
                       epoch + (self.total - begin + self.steps - 1) // self.steps)

    def seek(self, step):
        """Goes to the epoch that step `step` is in (a resumed job's, a replacement's, a
        rolled-back one's), through every epoch before it as the workers took them."""
        self._enter(0, 0)
        while step >= self.begin + self.steps and self.begin + self.steps < self.total:
            self._enter(self.epoch + 1, self.begin + self.steps)

    def seek_epoch(self, epoch):
        """Goes to the start of epoch `epoch` (0-based), through every epoch before it."""
        self._enter(0, 0)
        while self.epoch < epoch:
            self._enter(self.epoch + 1, self.begin + self.steps)

    def next(self):
        """Goes to the next epoch; True when its split differs from the last one's."""
        before = (self.index, self.count)
        self._enter(self.epoch + 1, self.begin + self.steps)
        return (self.index, self.count) != before
