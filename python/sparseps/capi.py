"""sparseps through its C interface (libsparseps_client.so, include/sparseps/sparseps.h) and
ctypes: a worker of a sparseps job from any CPython 3 and any PyTorch, with no module built for
them (the pybind11 module sparseps._sparseps is built for one Python version; this is not).
capi.Worker has sparseps.Worker's interface, so sparseps.torch takes either:

    from sparseps import capi
    w = capi.Worker("job.yaml", rank=0, overrides=["cluster.scheduler_port=7000"])
    w.init(params)                 # float32 array or tensor (or a list), set to the job's start
    params -= w.push_pull(grads)   # the update; push_pull(grads, sparse=True): (keys, update, new)
    w.finish(test_accuracy=acc)

Tensors: float32, contiguous NumPy arrays (host), or PyTorch tensors on the CPU or (a CUDA
build of the library: capi.cuda()) a CUDA device, read through their data_ptr (torch is not
imported here); a list or tuple of them for a model of several tensors.

The library is found at $SPARSEPS_CLIENT_LIBRARY, else next to this package in a build tree
(<build>/client/libsparseps_client.so), else by the loader (libsparseps_client.so.0, as the
Debian package installs it). Every call that can fail raises capi.Error with the library's
message (KeyboardInterrupt when Ctrl-C ended a wait); ctypes releases the GIL during each call,
so workers may be threads.
"""
import ctypes
import json
import math
import os

import numpy as np

from . import _rollback
from ._job_ended import JobEnded
from ._local_rank import local_rank

__all__ = ["DeadlineExceeded", "Error", "InvalidArgument", "JobEnded", "Lost", "RolledBack",
           "Worker", "cuda", "library", "local_rank"]

OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, FAILED, INTERRUPTED, ROLLED_BACK, LOST, JOB_ENDED = \
    range(8)
HOST = -1
_ERR_LEN = 4096


class Error(RuntimeError):
    """A failed call: code is one of INVALID_ARGUMENT, DEADLINE_EXCEEDED, FAILED, ROLLED_BACK,
    LOST (JOB_ENDED is sparseps.JobEnded, a SystemExit with code 0)."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class InvalidArgument(Error, ValueError):
    """Bad input or config (code INVALID_ARGUMENT; the message names the key, file or size): a
    ValueError too, as the pybind11 module raises for it, so `except ValueError` serves both."""


class DeadlineExceeded(Error, TimeoutError):
    """A wait ran past its deadline (code DEADLINE_EXCEEDED; the message names who is missing): a
    TimeoutError too, as the pybind11 module raises for it, so `except TimeoutError` serves
    both."""


class RolledBack(Error):
    """A server was lost and replaced: the job, and this worker, went back to the newest complete
    checkpoint (step and params() are its). Restore the loop's own state of that step and go on
    from step."""


class Lost(Error):
    """This worker is out of the job (code LOST): it heard nothing from the scheduler for
    cluster.heartbeat_timeout_s (its host was cut off, or the scheduler died), or the scheduler
    removed it (declared dead while the process was stopped or too slow) and the others went on
    without it. Exit with code 3, as the daemons do, so that deploy/launch.sh lets the job go on
    (with --max-restarts, a replacement joins)."""


class _Buffer(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t), ("device", ctypes.c_int)]


class _Counters(ctypes.Structure):
    _fields_ = [("bytes_sent", ctypes.c_uint64), ("bytes_received", ctypes.c_uint64),
                ("selected", ctypes.c_uint64), ("applied", ctypes.c_int64),
                ("encode_ms", ctypes.c_double), ("comm_ms", ctypes.c_double)]


def _candidates():
    env = os.environ.get("SPARSEPS_CLIENT_LIBRARY")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "..", "..", "client", "libsparseps_client.so")  # a build tree
    yield "libsparseps_client.so.0"
    yield "libsparseps_client.so"


def _load():
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        _declare(lib)
        return lib
    raise ImportError("cannot load libsparseps_client (set SPARSEPS_CLIENT_LIBRARY): " +
                      "; ".join(errors))


def _declare(lib):
    c_float_p = ctypes.POINTER(ctypes.c_float)
    c_bytes_p = ctypes.POINTER(ctypes.c_uint8)
    buffers = [ctypes.POINTER(_Buffer), ctypes.c_size_t]
    err = [ctypes.c_char_p, ctypes.c_size_t]
    handle = ctypes.c_void_p
    signatures = {
        "version": (ctypes.c_char_p, []),
        "cuda_build": (ctypes.c_int, []),
        "device_of": (ctypes.c_int, [ctypes.c_void_p]),
        "worker_new": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p),
                                      ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(handle)] + err),
        "worker_free": (None, [handle]),
        "worker_init_buffers": (ctypes.c_int, [handle] + buffers +
                                [ctypes.POINTER(ctypes.c_char_p)] + err),
        "worker_init_tensors": (ctypes.c_int, [handle] + buffers +
                                [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t),
                                 ctypes.POINTER(ctypes.c_uint64)] + err),
        "worker_push_pull_update": (ctypes.c_int, [handle] + buffers +
                                    [c_float_p, ctypes.c_double] + err),
        "worker_push_pull_sparse": (ctypes.c_int, [handle] + buffers +
                                    [ctypes.c_double, ctypes.POINTER(ctypes.c_size_t)] + err),
        "worker_begin_step": (ctypes.c_int, [handle, ctypes.POINTER(_Buffer),
                                             ctypes.POINTER(ctypes.c_int)] + err),
        "worker_gradient_ready": (ctypes.c_int, [handle, ctypes.c_size_t] + err),
        "worker_sparse_result": (ctypes.c_int, [handle, ctypes.POINTER(ctypes.c_int64), c_float_p,
                                                c_float_p, ctypes.c_size_t] + err),
        "worker_params": (ctypes.c_int, [handle, c_float_p, ctypes.c_size_t] + err),
        "worker_residual": (ctypes.c_int, [handle, c_float_p, ctypes.c_size_t] + err),
        "worker_synchronize": (ctypes.c_int, [handle, c_float_p, ctypes.c_size_t] + err),
        "worker_set_trained_model": (ctypes.c_int, [handle, c_float_p, ctypes.c_size_t] + err),
        "worker_set_model_buffers": (ctypes.c_int, [
            handle, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64)), ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(c_float_p)] + err),
        "worker_set_checkpoint_state": (ctypes.c_int, [handle, c_bytes_p, ctypes.c_size_t,
                                                       c_float_p, ctypes.c_size_t] + err),
        "worker_checkpoint_state": (ctypes.c_size_t, [handle, c_bytes_p, ctypes.c_size_t]),
        "worker_send_handoff": (ctypes.c_int, [handle, c_bytes_p, ctypes.c_size_t, c_float_p,
                                               ctypes.c_size_t] + err),
        "worker_receive_handoff": (ctypes.c_int, [handle, ctypes.POINTER(ctypes.c_int),
                                                  ctypes.POINTER(ctypes.c_size_t),
                                                  ctypes.POINTER(ctypes.c_size_t)] + err),
        "worker_handoff_state": (ctypes.c_size_t, [handle, c_bytes_p, ctypes.c_size_t]),
        "worker_handoff_model": (ctypes.c_size_t, [handle, c_float_p, ctypes.c_size_t]),
        "worker_handoff_missing": (ctypes.c_size_t, [handle, ctypes.c_char_p, ctypes.c_size_t]),
        "worker_set_epoch": (ctypes.c_int, [handle, ctypes.c_uint32] + err),
        "worker_set_density_scale": (ctypes.c_int, [handle, ctypes.c_double] + err),
        "worker_allreduce_values": (ctypes.c_int, [handle, ctypes.POINTER(ctypes.c_double),
                                                   ctypes.c_size_t,
                                                   ctypes.POINTER(ctypes.c_double),
                                                   ctypes.POINTER(ctypes.c_uint32)] + err),
        "worker_report_evaluation": (ctypes.c_int, [handle, ctypes.c_double] + err),
        "worker_set_interruptible": (None, [handle, ctypes.c_int]),
        "worker_finish": (ctypes.c_int, [handle] + [ctypes.c_double] * 4 + err),
        "worker_last_step": (None, [handle, ctypes.POINTER(_Counters)]),
        "worker_live_workers": (ctypes.c_size_t, [handle, ctypes.POINTER(ctypes.c_int),
                                                  ctypes.c_size_t]),
        "worker_data_split": (ctypes.c_int, [handle, ctypes.c_uint64,
                                             ctypes.POINTER(ctypes.c_int),
                                             ctypes.POINTER(ctypes.c_int)] + err),
        "worker_config": (ctypes.c_size_t, [handle, ctypes.c_char_p, ctypes.c_size_t]),
    }
    for name, restype in (("rank", ctypes.c_int), ("num_workers", ctypes.c_int),
                          ("is_leader", ctypes.c_int), ("num_params", ctypes.c_size_t),
                          ("step", ctypes.c_uint64), ("lr", ctypes.c_double),
                          ("bytes_sent", ctypes.c_uint64), ("bytes_received", ctypes.c_uint64),
                          ("resumed", ctypes.c_int), ("rejoined", ctypes.c_int),
                          ("checkpoint_due", ctypes.c_int), ("handoff_due", ctypes.c_int),
                          ("handoff_expected", ctypes.c_int),
                          ("allreduce", ctypes.c_int)):
        signatures[f"worker_{name}"] = (restype, [handle])
    for name, (restype, argtypes) in signatures.items():
        f = getattr(lib, f"sparseps_{name}")
        f.restype = restype
        f.argtypes = argtypes


_lib = None


def library():
    """The loaded libsparseps_client (loaded on first use)."""
    global _lib
    if _lib is None:
        _lib = _load()
    return _lib


def cuda():
    """True when the library was built with CUDA: CUDA tensors are compressed on the device."""
    return bool(library().sparseps_cuda_build())


def _buffer(t, name):
    """(buffer, shape) of a float32 NumPy array or PyTorch tensor, read in place."""
    if isinstance(t, np.ndarray):
        if t.dtype != np.float32 or not t.flags.c_contiguous or not t.flags.writeable:
            raise Error(INVALID_ARGUMENT,
                        f"{name}: a writable, contiguous float32 numpy array is needed "
                        f"(got {t.dtype}{'' if t.flags.c_contiguous else ', not contiguous'})")
        return _Buffer(t.ctypes.data, t.size, HOST), t.shape
    if hasattr(t, "data_ptr") and hasattr(t, "is_contiguous"):  # a torch.Tensor
        if str(t.dtype) != "torch.float32":
            raise Error(INVALID_ARGUMENT, f"{name}: dtype {t.dtype}; sparseps takes float32 "
                        "(call .float())")
        if not t.is_contiguous():
            raise Error(INVALID_ARGUMENT, f"{name}: not contiguous (call .contiguous())")
        device = t.device.index if t.is_cuda else HOST
        return _Buffer(t.data_ptr(), t.numel(), device), tuple(t.shape)
    raise Error(INVALID_ARGUMENT, f"{name}: expected a float32 numpy array or torch tensor, "
                f"got {type(t).__name__}")


def _buffers(obj, name):
    """(ctypes array of buffers, shapes, listed) of one tensor or a list of them."""
    listed = isinstance(obj, (list, tuple))
    items = list(obj) if listed else [obj]
    if not items:
        raise Error(INVALID_ARGUMENT, f"{name}: the list is empty")
    parts = [_buffer(t, f"{name}[{i}]" if listed else name) for i, t in enumerate(items)]
    array = (_Buffer * len(parts))(*[b for b, _ in parts])
    return array, [s for _, s in parts], listed


class Worker:
    """One worker of a sparseps job, through the C interface (sparseps.Worker's interface). A
    context manager too: `with capi.Worker(...) as w:` closes it at the block's end."""

    def __init__(self, config="", rank=None, overrides=()):
        lib = library()
        sets = [s.encode() for s in overrides]
        array = (ctypes.c_char_p * max(len(sets), 1))(*sets)
        handle = ctypes.c_void_p()
        self._h = None  # the C handle; None once closed
        self._shapes = None
        self._call(lib.sparseps_worker_new, config.encode() if config else None, array,
                   len(sets), -1 if rank is None else rank, ctypes.byref(handle))
        self._h = handle
        lib.sparseps_worker_set_interruptible(handle, 1)  # Ctrl-C ends a wait

    @property
    def _handle(self):
        if self._h is None:
            raise InvalidArgument(INVALID_ARGUMENT, "sparseps.capi.Worker: closed (close(), or "
                                  "the end of its with block)")
        return self._h

    @staticmethod
    def _call(f, *args):
        err = ctypes.create_string_buffer(_ERR_LEN)
        code = f(*args, err, _ERR_LEN)
        if code == INTERRUPTED:
            raise KeyboardInterrupt(err.value.decode(errors="replace"))
        if code == ROLLED_BACK:
            raise RolledBack(code, err.value.decode(errors="replace"))
        if code == LOST:
            raise Lost(code, err.value.decode(errors="replace"))
        if code == JOB_ENDED:  # a SystemExit with code 0: nothing to join, nothing failed
            raise JobEnded(err.value.decode(errors="replace"))
        if code == INVALID_ARGUMENT:
            raise InvalidArgument(code, err.value.decode(errors="replace"))
        if code == DEADLINE_EXCEEDED:
            raise DeadlineExceeded(code, err.value.decode(errors="replace"))
        if code != OK:
            raise Error(code, err.value.decode(errors="replace"))

    def init(self, params, names=None):
        """Joins the job with the size of params (a float32 array or tensor, or a list of them)
        and writes the job's starting parameters (worker 0's, or a checkpoint's) into them in
        place; names name the model file's tensors (one per tensor)."""
        array, shapes, listed = _buffers(params, "params")
        c_names = None
        if names is not None:
            if len(names) != len(shapes):
                raise Error(INVALID_ARGUMENT, f"names: {len(names)} names for {len(shapes)} "
                            "tensors")
            c_names = (ctypes.c_char_p * len(names))(*[n.encode() for n in names])
        # The tensors' shapes: a method that works layer by layer (powersgd) needs them.
        ndims = (ctypes.c_size_t * len(shapes))(*[len(s) for s in shapes])
        flat = [int(d) for s in shapes for d in s]
        dims = (ctypes.c_uint64 * max(len(flat), 1))(*flat)
        self._call(library().sparseps_worker_init_tensors, self._handle, array, len(shapes),
                   c_names, ndims, dims)
        self._shapes = shapes if listed else None

    def push_pull(self, grads, sparse=False, loss=None, out=None, params_out=None):
        """Aggregates grads (laid out as init's params, or one flat tensor of all of them) and
        returns the update (params -= update holds the job's new parameters): a float32 array,
        or a list of them shaped like a list of grads. sparse=True: (keys, update, params) at
        the keys that changed; with `out` and/or `params_out` (writable float32 arrays or CPU
        tensors of the model's size) a step that changed every key copies its update and new
        parameters there and returns (keys, out, params_out), as sparseps.Worker.push_pull does
        without the copies."""
        targets = [self._dense_out(o, name, sparse)
                   for o, name in ((out, "out"), (params_out, "params_out"))]
        array, shapes, listed = _buffers(grads, "grads")
        lib = library()
        loss = math.nan if loss is None else float(loss)
        if sparse:
            m = ctypes.c_size_t()
            self._call(lib.sparseps_worker_push_pull_sparse, self._handle, array, len(shapes), loss,
                       ctypes.byref(m))
            keys = np.empty(m.value, dtype=np.int64)
            update = np.empty(m.value, dtype=np.float32)
            now = np.empty(m.value, dtype=np.float32)
            self._call(lib.sparseps_worker_sparse_result, self._handle,
                       keys.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), _floats(update),
                       _floats(now), m.value)
            if m.value == self.num_params and (out is not None or params_out is not None):
                for target, result in zip(targets, (update, now)):
                    if target is not None:
                        np.copyto(target, result)
                return keys, out, params_out
            return keys, update, now
        update = np.zeros(self.num_params, dtype=np.float32)
        self._call(lib.sparseps_worker_push_pull_update, self._handle, array, len(shapes),
                   _floats(update), loss)
        if not listed or self._shapes is None:
            return update
        out, offset = [], 0
        for shape in self._shapes:
            size = int(np.prod(shape, dtype=np.int64))
            out.append(update[offset:offset + size].reshape(shape))
            offset += size
        return out

    def begin_step(self, grad):
        """train.overlap: backward (ps mode; CPU tensors, or CUDA tensors where the encoding has
        a device compressor): starts this step's aggregation on grad, the one flat float32
        tensor the backward pass is writing and this step's push_pull(grad, sparse=True) gets
        (sparseps.Worker.begin_step). False: the job does not overlap, nothing started."""
        array, shapes, listed = _buffers(grad, "grad")
        if listed:
            raise ValueError("begin_step: grad is one flat tensor of all the model's elements")
        begun = ctypes.c_int()
        self._call(library().sparseps_worker_begin_step, self._handle, array, ctypes.byref(begun))
        return bool(begun.value)

    def gradient_ready(self, key_begin):
        """After begin_step: grad[key_begin:] is final for this step (CUDA: the kernels that
        wrote it have completed). Thread-safe."""
        self._call(library().sparseps_worker_gradient_ready, self._handle, int(key_begin))

    def _dense_out(self, obj, name, sparse):
        """push_pull's out or params_out as a flat NumPy view (None when not given)."""
        if obj is None:
            return None
        if not sparse:
            raise ValueError(f"push_pull: {name} is for sparse=True (a dense step's result)")
        target = np.asarray(obj)
        if (target.dtype != np.float32 or target.size != self.num_params or
                not target.flags.writeable or not target.flags.c_contiguous):
            raise ValueError(f"push_pull: {name} must be a writable contiguous float32 array of "
                             f"the model's {self.num_params} elements in host memory")
        return target.reshape(-1)

    def _copy(self, f):
        out = np.empty(self.num_params, dtype=np.float32)
        self._call(f, self._handle, _floats(out), out.size)
        return out

    def params(self):
        """The job's parameters as this worker holds them (a copy)."""
        return self._copy(library().sparseps_worker_params)

    def residual(self):
        """What this worker holds back for later steps (its residual; a copy)."""
        return self._copy(library().sparseps_worker_residual)

    def synchronize(self):
        """ssp / async: waits until every worker pushed as many steps and returns the job's
        parameters then (a copy); bsp and allreduce: at once."""
        return self._copy(library().sparseps_worker_synchronize)

    def set_trained_model(self, params):
        """The parameters worker 0 saves as the trained model at finish instead of the job's
        (a flat float32 array or tensor of num_params elements, copied)."""
        array = _host_floats(params, "set_trained_model: params")
        self._call(library().sparseps_worker_set_trained_model, self._handle, _floats(array),
                   array.size)

    def set_model_buffers(self, buffers):
        """The model's buffers (a dict of name -> float array or torch.Tensor on any device, such
        as the buffers of a module's state_dict: BatchNorm's running statistics) that worker 0
        writes beside the parameters into the trained model file at finish and into a
        checkpoint's model file at set_checkpoint_state, replacing earlier ones ({}: none).
        ValueError for a name of one of the model's layers, or for something that is not an array
        or tensor."""
        names, arrays = [], []
        for name, value in buffers.items():
            names.append(str(name).encode())
            shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
            arrays.append((shape, _host_floats(value, f"set_model_buffers: {name}")))
        n = len(arrays)
        shapes = [(ctypes.c_uint64 * max(len(shape), 1))(*shape) for shape, _ in arrays]
        self._call(library().sparseps_worker_set_model_buffers, self._handle, n,
                   (ctypes.c_char_p * max(n, 1))(*names),
                   (ctypes.POINTER(ctypes.c_uint64) * max(n, 1))(
                       *[ctypes.cast(sh, ctypes.POINTER(ctypes.c_uint64)) for sh in shapes]),
                   (ctypes.c_size_t * max(n, 1))(*[len(shape) for shape, _ in arrays]),
                   (ctypes.POINTER(ctypes.c_float) * max(n, 1))(*[_floats(a) for _, a in arrays]))

    def set_checkpoint_state(self, state, model=None):
        """Right after the push_pull that returned with checkpoint_due True: the loop's own state
        (bytes) for this worker's checkpoint file and, on worker 0, `model` (flat float32, or a
        tensor, of num_params elements; None: the job's parameters) as the checkpoint's model file,
        with the buffers set_model_buffers set last beside it (as
        sparseps.Worker.set_checkpoint_state)."""
        state = bytes(state)
        buffer = (ctypes.c_uint8 * max(len(state), 1)).from_buffer_copy(state or b"\0")
        array = None
        if model is not None:
            array = _host_floats(model, "set_checkpoint_state: model")
        self._call(library().sparseps_worker_set_checkpoint_state, self._handle,
                   ctypes.cast(buffer, ctypes.POINTER(ctypes.c_uint8)), len(state),
                   None if array is None else _floats(array), 0 if array is None else array.size)

    @property
    def checkpoint_state(self):
        """The loop's own state in the checkpoint resumed from or rolled back to (b"": none)."""
        f = library().sparseps_worker_checkpoint_state
        n = f(self._handle, None, 0)
        buffer = (ctypes.c_uint8 * max(n, 1))()
        f(self._handle, ctypes.cast(buffer, ctypes.POINTER(ctypes.c_uint8)), n)
        return bytes(buffer)[:n]

    def send_handoff(self, state, model=None):
        """On the donor (handoff_due), before the next push_pull: the loop's own state (bytes)
        and `model` (flat float32, or a tensor, of num_params elements; None: none) for the
        replacement that joined at the last push_pull's iteration (as
        sparseps.Worker.send_handoff)."""
        state = bytes(state)
        buffer = (ctypes.c_uint8 * max(len(state), 1)).from_buffer_copy(state or b"\0")
        array = None if model is None else _host_floats(model, "send_handoff: model")
        self._call(library().sparseps_worker_send_handoff, self._handle,
                   ctypes.cast(buffer, ctypes.POINTER(ctypes.c_uint8)), len(state),
                   None if array is None else _floats(array), 0 if array is None else array.size)

    def receive_handoff(self):
        """On a replacement (handoff_expected), before the next push_pull: waits for the donor's
        hand-over; {"from": rank, "state": bytes, "model": float32 array or None, "missing": why
        nothing came} (as sparseps.Worker.receive_handoff)."""
        lib = library()
        donor, state_n, model_n = ctypes.c_int(-1), ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._call(lib.sparseps_worker_receive_handoff, self._handle, ctypes.byref(donor),
                   ctypes.byref(state_n), ctypes.byref(model_n))
        buffer = (ctypes.c_uint8 * max(state_n.value, 1))()
        lib.sparseps_worker_handoff_state(self._handle,
                                          ctypes.cast(buffer, ctypes.POINTER(ctypes.c_uint8)),
                                          state_n.value)
        model = None
        if model_n.value > 0:
            model = np.empty(model_n.value, dtype=np.float32)
            lib.sparseps_worker_handoff_model(self._handle, _floats(model), model.size)
        size = lib.sparseps_worker_handoff_missing(self._handle, None, 0)
        text = ctypes.create_string_buffer(size)
        lib.sparseps_worker_handoff_missing(self._handle, text, size)
        return {"from": donor.value, "state": bytes(buffer)[:state_n.value], "model": model,
                "missing": text.value.decode()}

    def report_evaluation(self, test_accuracy):
        """The loop's test accuracy: the live metrics' gauge and finish()'s default (as
        sparseps.Worker.report_evaluation)."""
        self._call(library().sparseps_worker_report_evaluation, self._handle, test_accuracy)

    def allreduce_values(self, values, op="mean"):
        """The mean (op="mean") or sum (op="sum") of `values` over the live workers, element by
        element, as a float64 array (as sparseps.Worker.allreduce_values)."""
        if op not in ("mean", "sum"):
            raise ValueError(f"allreduce_values: op {op!r}; 'mean' or 'sum'")
        v = np.ascontiguousarray(np.asarray(values, dtype=np.float64).reshape(-1))
        sums = np.empty_like(v)
        contributors = ctypes.c_uint32(0)
        as_doubles = ctypes.POINTER(ctypes.c_double)
        _rollback.call(self, self._call, library().sparseps_worker_allreduce_values, self._handle,
                       v.ctypes.data_as(as_doubles), v.size, sums.ctypes.data_as(as_doubles),
                       ctypes.byref(contributors))
        return sums / contributors.value if op == "mean" else sums

    def set_density_scale(self, scale):
        """Scales the top-k k from the next push (as sparseps.Worker.set_density_scale)."""
        self._call(library().sparseps_worker_set_density_scale, self._handle, scale)

    def set_epoch(self, epoch):
        self._call(library().sparseps_worker_set_epoch, self._handle, epoch)

    def finish(self, test_accuracy=-1.0, train_loss=0.0, samples_per_s=0.0, train_s=0.0):
        self._call(library().sparseps_worker_finish, self._handle, test_accuracy, train_loss,
                   samples_per_s, train_s)

    def get(self, key):
        """The resolved value of a config key, typed (as sparseps.Worker.get)."""
        text = self.config[key]
        try:
            return json.loads(text)
        except ValueError:
            return text

    def _fact(self, name):
        return getattr(library(), f"sparseps_worker_{name}")(self._handle)

    rank = property(lambda self: self._fact("rank"))
    num_workers = property(lambda self: self._fact("num_workers"))
    is_leader = property(lambda self: bool(self._fact("is_leader")))
    num_params = property(lambda self: self._fact("num_params"))
    step = property(lambda self: self._fact("step"))
    lr = property(lambda self: self._fact("lr"))
    bytes_sent = property(lambda self: self._fact("bytes_sent"))
    bytes_received = property(lambda self: self._fact("bytes_received"))
    resumed = property(lambda self: bool(self._fact("resumed")))
    rejoined = property(lambda self: bool(self._fact("rejoined")))
    checkpoint_due = property(lambda self: bool(self._fact("checkpoint_due")))
    handoff_due = property(lambda self: bool(self._fact("handoff_due")))
    handoff_expected = property(lambda self: bool(self._fact("handoff_expected")))
    aggregation = property(lambda self: "allreduce" if self._fact("allreduce") else "ps")

    @property
    def last_step(self):
        c = _Counters()
        library().sparseps_worker_last_step(self._handle, ctypes.byref(c))
        return {name: getattr(c, name) for name, _ in _Counters._fields_}

    @property
    def live_workers(self):
        n = library().sparseps_worker_live_workers(self._handle, None, 0)
        ranks = (ctypes.c_int * max(n, 1))()
        library().sparseps_worker_live_workers(self._handle, ranks, n)
        return list(ranks[:n])

    def data_split(self, step):
        """(index, count): this worker's share of the training data in the epoch that begins
        after `step` steps, as sparseps.Worker.data_split."""
        index, count = ctypes.c_int(), ctypes.c_int()
        self._call(library().sparseps_worker_data_split, self._handle, step,
                   ctypes.byref(index), ctypes.byref(count))
        return index.value, count.value

    @property
    def config(self):
        lib = library()
        size = lib.sparseps_worker_config(self._handle, None, 0)
        text = ctypes.create_string_buffer(size)
        lib.sparseps_worker_config(self._handle, text, size)
        return dict(line.split(" = ", 1) for line in text.value.decode().splitlines())

    def close(self):
        """Frees the worker: one that did not finish leaves the job (under
        cluster.on_worker_failure: continue the others go on without it). Every call after it
        raises ValueError; closing again does nothing."""
        if getattr(self, "_h", None) is not None:
            library().sparseps_worker_free(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def _host_floats(x, what):
    """A flat, contiguous float32 host array of x: a NumPy array, anything NumPy converts, or a
    torch.Tensor on any device (detached and copied to the host); ValueError naming `what` for
    anything else (as the pybind11 module's HostFloats)."""
    try:
        if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch.Tensor, on any device
            x = x.detach().cpu().numpy()
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{what}: expected a float32 array or tensor, got {type(x)} ({e})") from e


def _floats(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
