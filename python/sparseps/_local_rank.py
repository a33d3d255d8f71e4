"""sparseps.local_rank, shared by the pybind11 module and sparseps.capi: which of a host's GPUs
a worker takes, read as the C++ worker reads it (worker/trainer.h PickCudaDevice)."""
import os

# In this order, the first one set: deploy/launch.sh's and sparseps.sbatch's own, torchrun's,
# Open MPI's mpirun's, srun's.
LOCAL_RANK_VARIABLES = ("SPARSEPS_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                        "SLURM_LOCALID")


def local_rank(environ=None):
    """This worker's rank among the workers on its host: SPARSEPS_LOCAL_RANK (deploy/launch.sh
    and sparseps.sbatch set it per worker), LOCAL_RANK (torchrun), OMPI_COMM_WORLD_LOCAL_RANK
    (Open MPI) or SLURM_LOCALID, the first one set; 0 without any. Its GPU on a host with
    several, as sparseps-worker takes it for train.cuda_device -1, and as Horovod's and
    torchrun's users pick theirs:

        torch.cuda.set_device(sparseps.local_rank() % torch.cuda.device_count())

    environ: a mapping to read instead of os.environ. ValueError naming the variable for a value
    that is not a non-negative integer."""
    env = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        value = env.get(name, "")
        if value == "":
            continue
        if not value.isdigit() or not value.isascii() or int(value) >= 2 ** 31:
            raise ValueError(f"env {name}={value!r}: expected a non-negative integer local rank")
        return int(value)
    return 0
