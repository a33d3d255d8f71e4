"""sparseps.JobEnded, shared by the pybind11 module and sparseps.capi."""


class JobEnded(SystemExit):
    """A replacement (node.rejoin) came when the job had ended or was ending (its workers done,
    or a stop), raised by init: nothing to join, and nothing failed. A SystemExit with code 0,
    as argparse's is: uncaught, the script ends with exit code 0 (what deploy/launch.sh,
    sparseps.sbatch and Slurm count as success) and prints nothing more (the library's log line
    said why); `except Exception` passes it by. str() is the reason; catch it to do otherwise."""

    def __init__(self, message="the job ended before this replacement worker could join"):
        super().__init__(0)
        self.message = message

    def __str__(self):
        return self.message
