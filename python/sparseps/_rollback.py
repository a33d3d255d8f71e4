"""A worker's rollback, told to the loop's wrappers of it (DistributedOptimizer, the DDP hook's
SparseAllreduceState) when a call the loop makes itself raised it: such a wrapper restores its
own state of the checkpoint's step, as when its own push_pull raises sparseps.RolledBack."""
import weakref


def listen(worker, method, *args):
    """Calls method(*args) (a bound method, held weakly: a wrapper gone is no longer told) after a
    call of `worker` that went through `call` raised RolledBack."""
    worker.__dict__.setdefault("_rollback_listeners", []).append((weakref.WeakMethod(method),
                                                                   args))


def call(worker, f, *args, **kwargs):
    """f(*args, **kwargs); where it raises RolledBack (sparseps's or sparseps.capi's), every
    listener of `worker` first."""
    try:
        return f(*args, **kwargs)
    except Exception as e:
        if type(e).__name__ == "RolledBack":
            for ref, bound in list(worker.__dict__.get("_rollback_listeners", ())):
                method = ref()
                if method is not None:
                    method(*bound)
        raise
