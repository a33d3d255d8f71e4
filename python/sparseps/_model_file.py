"""sparseps.read_model_file: a sparseps model file (<run.dir>/model.safetensors, or a checkpoint
folder's) as NumPy arrays, without the safetensors package (Debian 12 has none). The format's
definition (Hugging Face's safetensors: an 8-byte little-endian header length, a JSON header of
name -> dtype, shape and data_offsets, and __metadata__, then the tensors' bytes), checked as the
C++ reader (storage/safetensors.cc) checks it."""
import json
import pathlib
import struct

import numpy as np

__all__ = ["read_model_file"]

# The dtypes sparseps writes and reads, little-endian as the format defines them.
_DTYPES = {"F32": "<f4", "F64": "<f8", "U8": "u1", "U32": "<u4", "I64": "<i8", "U64": "<u8"}


def read_model_file(path):
    """Reads a safetensors file such as the model file worker 0 writes (checkpoint.save_model):
    returns (tensors, metadata), tensors a dict of name -> NumPy array of the file's dtype and
    shape (F32 for parameters and buffers; writable, sharing one buffer of the file's bytes),
    metadata a dict of str -> str (format, iteration, config_fingerprint, ...). The names are the
    model's (init(names=...), a PyTorch module's state_dict names). Raises OSError when the file
    cannot be read, ValueError naming the file and the fault for one that is not a whole, well
    formed file (truncated, a header past the end, an unknown dtype, a tensor whose bytes are not
    its shape's or do not follow the previous one's). Reads the whole file into memory."""
    raw = bytearray(pathlib.Path(path).read_bytes())

    def bad(why):
        return ValueError(f"{path}: not a safetensors model file: {why}")
    if len(raw) < 8:
        raise bad(f"{len(raw)} bytes, fewer than the header's length")
    (n,) = struct.unpack_from("<Q", raw)
    if n > len(raw) - 8:
        raise bad(f"a header of {n} bytes in a file of {len(raw)} (truncated?)")
    try:
        header = json.loads(bytes(raw[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ is not an object of strings")
    data = memoryview(raw)[8 + n:]
    spans = []
    for name, t in header.items():
        if not isinstance(t, dict) or not {"dtype", "shape", "data_offsets"} <= t.keys():
            raise bad(f"tensor '{name}' lacks dtype, shape or data_offsets")
        dtype = _DTYPES.get(t["dtype"])
        if dtype is None:
            raise bad(f"tensor '{name}' has unsupported dtype {t['dtype']}")
        shape, offsets = t["shape"], t["data_offsets"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise bad(f"tensor '{name}' has a bad shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and
                all(isinstance(o, int) and o >= 0 for o in offsets)):
            raise bad(f"tensor '{name}' has bad data_offsets")
        begin, end = offsets
        if begin > end or end > len(data):
            raise bad(f"tensor '{name}' lies at [{begin}, {end}) beyond the {len(data)} data "
                      "bytes (truncated?)")
        if int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize != end - begin:
            raise bad(f"tensor '{name}' holds {end - begin} bytes, not what its shape and dtype "
                      "need")
        spans.append((begin, end, name, dtype, shape))
    spans.sort()
    expect = 0
    tensors = {}
    for begin, end, name, dtype, shape in spans:
        if begin != expect:
            raise bad(f"tensor '{name}' does not follow the previous one")
        expect = end
        tensors[name] = (np.frombuffer(data[begin:end], dtype=dtype).reshape(shape) if end > begin
                         else np.zeros(shape, dtype=dtype))
    if expect != len(data):
        raise bad(f"{len(data) - expect} bytes after the last tensor")
    return {name: tensors[name] for name in header}, metadata
