"""sparseps: sparse, compressed gradient aggregation through a parameter server or allreduce.

A Python training loop joins a sparseps job as one of its workers; the job's scheduler and
servers run as the usual daemons (sparseps-scheduler, sparseps-server), started from the same
config file:

    import sparseps
    worker = sparseps.Worker("job.yaml")          # SPARSEPS_SCHEDULER=host:port, SPARSEPS_RANK=r
    worker.init(params)                           # every worker starts from worker 0's params
    for batch in data:
        grads = ...                               # float32, laid out as params
        params -= worker.push_pull(grads)         # the job's encoding / collective
    worker.finish(test_accuracy=acc)

params and grads are one float32 tensor or array, or a list of them (PyTorch CPU or CUDA tensors,
NumPy arrays): whatever speaks DLPack, __cuda_array_interface__ or the buffer protocol; nothing
here imports torch. sparseps.torch has a DistributedOptimizer and a DDP communication hook.
docs/user-guide.md ("Python") has the whole story.
"""
import json

from . import _sparseps
from ._sparseps import Error, cuda

__all__ = ["Error", "Worker", "cuda"]


class Worker(_sparseps.Worker):
    __doc__ = _sparseps.Worker.__doc__

    def get(self, key):
        """The resolved value of a config key, typed: get("train.lr") -> 0.05,
        get("model.hidden") -> [256, 128], get("compression.encoding") -> "topk"."""
        text = self.config[key]
        try:
            return json.loads(text)
        except ValueError:
            return text  # enum values: topk, allreduce, ...
