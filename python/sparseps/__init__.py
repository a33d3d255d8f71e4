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
docs/user-guide.md ("Python") has the whole story. sparseps.capi is the same worker, with the
same interface, through the client library's C interface and ctypes, for a Python the module was
not built for; both are layers on the client library (libsparseps_client.so).
sparseps.read_model_file reads the model file a job writes (model.safetensors) into NumPy arrays;
sparseps.torch.load_model_file into a state_dict for a module's load_state_dict. sparseps.EpochPlan
(and sparseps.torch.ElasticSampler for a DataLoader) plan a loop's epochs as the membership says:
the live workers share the data anew after one is lost or joins. sparseps.local_rank() is the
worker's rank among its host's workers, for its GPU on a host with several.
"""
import json

from . import _rollback
from ._epochs import EpochPlan
from ._job_ended import JobEnded
from ._local_rank import local_rank
from ._model_file import read_model_file

__all__ = ["EpochPlan", "Error", "JobEnded", "Lost", "RolledBack", "Worker", "cuda",
           "local_rank", "read_model_file"]


def _module():
    """sparseps._sparseps, imported on first use: `from sparseps import capi` never loads it, so
    capi works on a Python the module was not built for."""
    try:
        from . import _sparseps
    except ImportError as e:  # not built for this Python: sparseps.capi still works
        raise ImportError(
            f"{e}; the module sparseps._sparseps is built for one Python version: `from sparseps "
            "import capi` works from any Python 3 through libsparseps_client's C interface") from e
    return _sparseps


def _worker_class(module):
    class Worker(module.Worker):
        __doc__ = module.Worker.__doc__

        def get(self, key):
            """The resolved value of a config key, typed: get("train.lr") -> 0.05,
            get("model.hidden") -> [256, 128], get("compression.encoding") -> "topk"."""
            text = self.config[key]
            try:
                return json.loads(text)
            except ValueError:
                return text  # enum values: topk, allreduce, ...

        def allreduce_values(self, values, op="mean"):
            return _rollback.call(self, super().allreduce_values, values, op)
        allreduce_values.__doc__ = module.Worker.allreduce_values.__doc__

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    Worker.__module__ = __name__
    return Worker


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module 'sparseps' has no attribute {name!r}")
    module = _module()
    value = _worker_class(module) if name == "Worker" else getattr(module, name)
    globals()[name] = value  # once
    return value
