"""sparseps through its C interface (libsparseps_client.so, include/sparseps/sparseps.h) and
ctypes: a worker of a sparseps job from any CPython 3, with no module built for this Python or
this PyTorch (the pybind11 module sparseps._sparseps is built for one Python version; this is
not). Host memory, float32 NumPy arrays (or anything numpy.asarray takes; a torch CPU tensor
through .numpy()).

    from sparseps import capi
    w = capi.Worker("job.yaml", rank=0, overrides=["cluster.scheduler_port=7000"])
    w.init(params)                 # float32 array, changed in place to the job's start
    w.push_pull(grad, params)      # grad changed in place; params becomes the job's new ones
    w.finish(test_accuracy=acc)

The library is found at $SPARSEPS_CLIENT_LIBRARY, else next to this package in a build tree
(<build>/client/libsparseps_client.so), else by the loader (libsparseps_client.so.0, as the
Debian package installs it). Every call that can fail raises capi.Error with the library's
message; ctypes releases the GIL during each call, so workers may be threads.
"""
import ctypes
import os

import numpy as np

__all__ = ["Error", "Worker", "library"]

OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, FAILED = 0, 1, 2, 3
_ERR_LEN = 4096


class Error(RuntimeError):
    """A failed call: code is one of INVALID_ARGUMENT, DEADLINE_EXCEEDED, FAILED."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


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
    err = [ctypes.c_char_p, ctypes.c_size_t]
    handle = ctypes.c_void_p
    lib.sparseps_version.restype = ctypes.c_char_p
    lib.sparseps_version.argtypes = []
    lib.sparseps_worker_new.restype = ctypes.c_int
    lib.sparseps_worker_new.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p),
                                        ctypes.c_size_t, ctypes.c_int,
                                        ctypes.POINTER(handle)] + err
    lib.sparseps_worker_free.restype = None
    lib.sparseps_worker_free.argtypes = [handle]
    for name in ("init", "synchronize"):
        f = getattr(lib, f"sparseps_worker_{name}")
        f.restype = ctypes.c_int
        f.argtypes = [handle, c_float_p, ctypes.c_size_t] + err
    lib.sparseps_worker_push_pull.restype = ctypes.c_int
    lib.sparseps_worker_push_pull.argtypes = [handle, c_float_p, c_float_p, ctypes.c_size_t] + err
    lib.sparseps_worker_set_epoch.restype = ctypes.c_int
    lib.sparseps_worker_set_epoch.argtypes = [handle, ctypes.c_uint32] + err
    lib.sparseps_worker_finish.restype = ctypes.c_int
    lib.sparseps_worker_finish.argtypes = [handle] + [ctypes.c_double] * 4 + err
    for name, restype in (("rank", ctypes.c_int), ("num_workers", ctypes.c_int),
                          ("is_leader", ctypes.c_int), ("num_params", ctypes.c_size_t),
                          ("step", ctypes.c_uint64), ("lr", ctypes.c_double),
                          ("bytes_sent", ctypes.c_uint64), ("bytes_received", ctypes.c_uint64)):
        f = getattr(lib, f"sparseps_worker_{name}")
        f.restype = restype
        f.argtypes = [handle]


_lib = None


def library():
    """The loaded libsparseps_client (loaded on first use)."""
    global _lib
    if _lib is None:
        _lib = _load()
    return _lib


def _floats(a, name):
    """a as a writable, contiguous float32 NumPy array of its own memory (no copy)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous \
            or not a.flags.writeable:
        raise Error(INVALID_ARGUMENT,
                    f"{name}: a writable, contiguous float32 numpy array is needed "
                    f"(got {type(a).__name__} {getattr(a, 'dtype', '')})")
    return a, a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


class Worker:
    """One worker of a sparseps job, through the C interface (see the module's doc)."""

    def __init__(self, config="", rank=-1, overrides=()):
        lib = library()
        sets = [s.encode() for s in overrides]
        array = (ctypes.c_char_p * max(len(sets), 1))(*sets)
        handle = ctypes.c_void_p()
        self._handle = None
        self._call(lib.sparseps_worker_new, config.encode() if config else None, array,
                   len(sets), rank, ctypes.byref(handle))
        self._handle = handle

    @staticmethod
    def _call(f, *args):
        err = ctypes.create_string_buffer(_ERR_LEN)
        code = f(*args, err, _ERR_LEN)
        if code != OK:
            raise Error(code, err.value.decode(errors="replace"))

    def init(self, params):
        """Joins the job with params.size parameters; params becomes the job's start."""
        a, p = _floats(params, "params")
        self._call(library().sparseps_worker_init, self._handle, p, a.size)

    def push_pull(self, grad, params):
        """Aggregates grad (changed in place) and writes the job's new parameters into params
        (with SBC's local steps, the local copy the next gradient is computed at)."""
        g, gp = _floats(grad, "grad")
        a, p = _floats(params, "params")
        if g.size != a.size:
            raise Error(INVALID_ARGUMENT, f"grad has {g.size} elements, params {a.size}")
        self._call(library().sparseps_worker_push_pull, self._handle, gp, p, a.size)

    def synchronize(self, params):
        a, p = _floats(params, "params")
        self._call(library().sparseps_worker_synchronize, self._handle, p, a.size)

    def set_epoch(self, epoch):
        self._call(library().sparseps_worker_set_epoch, self._handle, epoch)

    def finish(self, test_accuracy=-1.0, train_loss=0.0, samples_per_s=0.0, train_s=0.0):
        self._call(library().sparseps_worker_finish, self._handle, test_accuracy, train_loss,
                   samples_per_s, train_s)

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

    def close(self):
        """Frees the worker (a worker that did not finish leaves the job)."""
        if self._handle is not None:
            library().sparseps_worker_free(self._handle)
            self._handle = None

    def __del__(self):
        self.close()
