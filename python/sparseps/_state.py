"""A training loop's state as bytes without pickle (for Worker.set_checkpoint_state): nested dicts,
lists and tuples of tensors, numbers, strings, booleans and None (an optimizer's state_dict), kept
as NumPy's .npz (numpy.savez; loaded with allow_pickle=False): the tensors as arrays, the rest as
JSON that names them. A checkpoint file can then be read without running code from it."""
import io
import json
import warnings

import numpy as np
import torch

__all__ = ["dumps", "loads", "LoopState", "ModuleBuffers"]


def _pack(obj, arrays):
    if torch.is_tensor(obj):
        arrays.append(obj.detach().cpu().numpy())
        return {"tensor": len(arrays) - 1}
    if isinstance(obj, dict):
        return {"dict": [[_pack(k, arrays), _pack(v, arrays)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_pack(v, arrays) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"sparseps: a {type(obj).__name__} in the state to checkpoint (tensors, "
                    "numbers, strings, None, and dicts, lists and tuples of them)")


def _unpack(node, arrays):
    (kind, v), = node.items()
    if kind == "tensor":
        return torch.from_numpy(arrays[f"a{v}"].copy())
    if kind == "dict":
        return {_unpack(k, arrays): _unpack(x, arrays) for k, x in v}
    if kind in ("list", "tuple"):
        items = [_unpack(x, arrays) for x in v]
        return items if kind == "list" else tuple(items)
    return v


def dumps(obj):
    """obj as bytes (see the module). TypeError on anything else (naming its type)."""
    arrays = []
    structure = json.dumps(_pack(obj, arrays)).encode()
    buffer = io.BytesIO()
    np.savez(buffer, structure=np.frombuffer(structure, dtype=np.uint8),
             **{f"a{i}": a for i, a in enumerate(arrays)})
    return buffer.getvalue()


def loads(raw):
    """dumps' object back (tensors on the CPU). ValueError when raw is not such bytes."""
    with np.load(io.BytesIO(raw), allow_pickle=False) as arrays:
        return _unpack(json.loads(arrays["structure"].tobytes()), arrays)


class LoopState:
    """The loop's extra_state (a dict of name -> object with state_dict() and load_state_dict())
    and whether a checkpoint waits for it: DistributedOptimizer's and the DDP hook's. A
    checkpoint's step ends (step_ended: each object's own step_ended(), where it has one, for
    state the next forward pass changes, such as ModuleBuffers'); its state is handed over later,
    as the loop leaves it between two steps (take). Not thread-safe (one loop's)."""

    def __init__(self, extra_state, who):
        """Each state_dict checked to go through dumps now rather than at the first checkpoint
        (TypeError naming `who` and the name otherwise)."""
        self.extra = dict(extra_state or {})
        self.waiting = False
        for name, obj in self.extra.items():
            if not (callable(getattr(obj, "state_dict", None)) and
                    callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"{who}: extra_state[{name!r}] (a {type(obj).__name__}) has no "
                                "state_dict() and load_state_dict()")
            try:
                dumps(obj.state_dict())
            except TypeError as e:
                raise TypeError(f"{who}: extra_state[{name!r}]'s state_dict(): {e}") from None

    def step_ended(self):
        """At the end of the step a checkpoint is of: it now waits for the loop's state."""
        for obj in self.extra.values():
            ended = getattr(obj, "step_ended", None)
            if callable(ended):
                ended()
        self.waiting = True

    def take(self):
        """Whether a checkpoint waits for the loop's state (then it no longer does)."""
        waiting, self.waiting = self.waiting, False
        return waiting

    def state_dicts(self):
        return {name: obj.state_dict() for name, obj in self.extra.items()}

    def restore(self, saved, where):
        """Loads each object from `saved` (a checkpoint's state_dicts); one the checkpoint lacks
        gets a warning naming it and `where` (the checkpoint) and starts again. Nothing waits
        after it."""
        self.waiting = False
        for name, obj in self.extra.items():
            if name in saved:
                obj.load_state_dict(saved[name])
            else:
                warnings.warn(f"{where} holds no state of extra_state[{name!r}]; it starts again")


def persistent_buffers(module, buffers=None):
    """Of `buffers` (a dict of name -> tensor; default: the module's named_buffers()), those in
    the module's state_dict: a buffer registered with persistent=False (a causal mask, a cache)
    is no part of the model's state, and a model file holding it would not load strictly."""
    state = module.state_dict(keep_vars=True)
    if buffers is None:
        buffers = dict(module.named_buffers())
    return {name: b for name, b in buffers.items() if name in state}


class ModuleBuffers:
    """A module's buffers (BatchNorm's running mean, variance and batch count: what is not a
    parameter) as an extra_state object, since sparseps aggregates and checkpoints the
    parameters only: extra_state={"buffers": ModuleBuffers(model)} keeps them in the checkpoints
    and restores them on resume, so that the model evaluates as before, and DistributedOptimizer
    puts them into worker 0's checkpoint model files and (synchronize()) the trained model file
    beside the parameters (those of the module's state_dict: not persistent=False ones, such as
    a causal mask). The next step's forward pass changes them before the checkpoint takes the
    loop's state, so they are copied at the end of the checkpoint's own step (step_ended).
    state_dict(): {name: tensor}; load_state_dict copies each into the buffer of that name
    (KeyError naming the lists when the names differ)."""

    def __init__(self, module):
        self.module = module
        self._held = None  # the buffers at the end of the checkpoint's step

    def step_ended(self):
        """Called by DistributedOptimizer and the DDP hook at the end of a step a checkpoint is
        of: copies the buffers as that step left them."""
        self._held = {name: buf.detach().clone() for name, buf in self.module.named_buffers()}

    def state_dict(self):
        held, self._held = self._held, None
        return held if held is not None else dict(self.module.named_buffers())

    def load_state_dict(self, state):
        # A copy held for a checkpoint that a rollback went behind is no one's state now (a
        # hand-over before the next checkpoint's step would otherwise send it).
        self._held = None
        mine = dict(self.module.named_buffers())
        if set(mine) != set(state):
            raise KeyError(f"ModuleBuffers: the checkpoint has buffers {sorted(state)}, the "
                           f"module {sorted(mine)}")
        with torch.no_grad():
            for name, buf in mine.items():
                buf.copy_(state[name])

