"""sparseps.torch.ElasticSampler: a torch.utils.data Sampler of a worker's share of the data that
follows the job's membership (sparseps.EpochPlan)."""
import torch

from sparseps._epochs import EpochPlan

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """This worker's share of a data set in a sparseps job, as torch's DistributedSampler is for
    torch.distributed and horovod.torch.elastic.ElasticSampler for Horovod's elastic jobs: in
    each epoch the shard that the membership gives it (Worker.data_split at the epoch's first
    step: after a worker is lost, or a replacement joins, the live workers share the whole data
    set from the next epoch on), reshuffled every epoch, in the same number of whole batches on
    every worker ((samples // count) // batch_size, as BSP needs), as sparseps-worker and
    examples/torch_job.py take their data:

        sampler = sparseps.torch.ElasticSampler(dataset, worker, batch_size=64, seed=42)
        loader = torch.utils.data.DataLoader(dataset, batch_size=64, sampler=sampler)
        for epoch in range(sampler.epoch_of(worker.step), epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                ...  # forward, backward, one optimizer step (one push_pull) per batch

    Call set_epoch before each epoch; it leaves out the batches of the epoch already done (a
    job resumed from a checkpoint, a replacement worker: worker.step is past the epoch's first
    step). After sparseps.RolledBack, set_epoch(epoch_of(worker.step)) and iterate the loader
    anew. The DataLoader's batch_size must be the sampler's.

    data: a sized data set (len(data)) or the number of samples. shuffle=False: the shard in the
    data set's order. seed: the same on every worker (train.seed). epochs, max_steps: the end of
    its plan (plan.total, plan.horizon: EpochPlan's), for a loop that plans its steps by it
    (examples/torch_job.py); none by default. It may be made before
    worker.init (a DataLoader usually is); it reads the membership from its first use on, which
    before init is the binding's Error. ValueError when a worker's share holds no whole batch.
    Not thread-safe across set_epoch."""

    def __init__(self, data, worker, batch_size, shuffle=True, seed=0, epochs=None, max_steps=0):
        self.samples = data if isinstance(data, int) else len(data)
        self.worker, self.batch, self.shuffle, self.seed = worker, batch_size, shuffle, seed
        self.epochs, self.max_steps = epochs, max_steps
        self._plan = None  # made at the first use: the worker's membership comes with init
        self.epoch, self.skip = 0, 0

    @property
    def plan(self):
        """The EpochPlan the epochs follow (made at the first use)."""
        if self._plan is None:  # at epoch 0, which self.epoch is until set_epoch
            self._plan = EpochPlan(self.worker.data_split, self.samples, self.batch, self.epochs,
                                   self.max_steps)
        return self._plan

    def epoch_of(self, step):
        """The epoch (0-based) that step `step` is in, as the workers took their epochs."""
        self.plan.seek(step)
        epoch = self.plan.epoch
        self.plan.seek_epoch(self.epoch)
        return epoch

    def set_epoch(self, epoch):
        """Goes to epoch `epoch` (0-based): its shard, its order, and past the batches of it that
        the worker's steps already took."""
        self.epoch = epoch
        self.plan.seek_epoch(epoch)
        self.skip = min(max(self.worker.step - self.plan.begin, 0), self.plan.steps)

    @property
    def steps(self):
        """The epoch's steps (batches) on every worker, those already done included."""
        return self.plan.steps

    def order(self):
        """The epoch's sample indices, every step of it (int64 on the CPU): step s takes
        order()[s * batch_size:(s + 1) * batch_size]."""
        p = self.plan
        perm = (torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed))
                if self.shuffle else torch.arange(self.samples))
        shard = perm[p.index::p.count]
        if self.shuffle:
            shard = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(
                self.seed ^ (self.epoch + 1) * 0x9E3779B9 ^ self.worker.rank))]
        return shard[:p.steps * self.batch]

    def __iter__(self):
        return iter(self.order()[self.skip * self.batch:].tolist())

    def __len__(self):
        return (self.plan.steps - self.skip) * self.batch
