"""Collectives of picklable Python objects over a communicator (TorchComms'
``torchcomms.objcol``, with its function names and signatures).

Each object is serialized to bytes, the bytes travel as ``uint8`` buffers
through the communicator's ordinary ops, and every receiving rank
deserializes them. Every function blocks until its ops are done and is a
collective of the whole communicator (``send_object_list`` and
``recv_object_list`` of the two ranks involved).

Serialization: with PyTorch importable, ``torch.save`` and ``torch.load``
as TorchComms does (``weights_only`` is passed to ``torch.load``); without
it, or with ``TORCHCOMMS_SERIALIZATION=pickle``, ``pickle``. Every rank must
use the same one. With ``pickle`` and ``weights_only=True`` (the default)
only plain data is accepted: ``None``, numbers, strings, bytes, lists,
tuples, dicts, sets, ``collections.OrderedDict`` and NumPy arrays and
scalars; anything else raises ``pickle.UnpicklingError`` naming the class,
and ``weights_only=False`` accepts it (unpickling runs code chosen by the
sender: only do that with ranks you trust).

Costs, N ranks and B bytes of serialized objects per rank:
``all_gather_object`` two all-gathers (8 N bytes of sizes, then every
rank's bytes with no padding); ``gather_object`` an all-gather of sizes and
a gather padded to the largest object; ``broadcast_object_list`` two
broadcasts; ``scatter_object_list`` a broadcast of N sizes and a scatter
padded to the largest object; ``send_object_list`` two sends.

Only communicators on host memory (device ``"cpu"``) are supported: on a
GPU communicator these functions raise ``ValueError``.
"""

import io
import os
import pickle

import numpy as np

__all__ = [
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]

# What an unpickler with weights_only=True may construct.
_SAFE = {
    "builtins": {
        "bool",
        "bytearray",
        "bytes",
        "complex",
        "dict",
        "float",
        "frozenset",
        "int",
        "list",
        "range",
        "set",
        "slice",
        "str",
        "tuple",
    },
    "collections": {"OrderedDict"},
    "numpy": {"dtype", "ndarray"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
}


class _DataOnly(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _SAFE.get(module, ()):
            return super().find_class(module, name)
        if module.startswith("numpy") and name.endswith("DType"):
            # NumPy >= 1.25 pickles dtypes as numpy.dtypes.<Kind>DType.
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"weights_only=True refuses to unpickle {module}.{name}; pass "
            "weights_only=False only for objects from ranks you trust"
        )


def _torch():
    if os.environ.get("TORCHCOMMS_SERIALIZATION") == "pickle":
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


def _to_bytes(obj):
    torch = _torch()
    if torch is None:
        return np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    f = io.BytesIO()
    torch.save(obj, f)
    return np.frombuffer(f.getvalue(), dtype=np.uint8)


def _from_bytes(buf, weights_only):
    data = bytes(memoryview(np.ascontiguousarray(buf, dtype=np.uint8)))
    torch = _torch()
    if torch is not None:
        return torch.load(io.BytesIO(data), weights_only=weights_only)
    if weights_only:
        return _DataOnly(io.BytesIO(data)).load()
    return pickle.loads(data)


def _host(comm):
    dev = str(comm.get_device())
    if dev != "cpu":
        raise ValueError(f"chorus.objcol needs a communicator on host memory, not {dev}")


def _sized_list(what, lst, n):
    if not isinstance(lst, list) or len(lst) != n:
        got = len(lst) if isinstance(lst, list) else type(lst).__name__
        raise ValueError(f"{what} must be a list of {n} entries (got {got})")


def all_gather_object(comm, object_list, obj, timeout=None, weights_only=True):
    """Every rank's ``obj`` into ``object_list`` (a list of the
    communicator's size) on every rank."""
    _host(comm)
    n = comm.get_size()
    _sized_list("object_list", object_list, n)
    data = _to_bytes(obj)
    sizes = [np.zeros(1, dtype=np.int64) for _ in range(n)]
    comm.all_gather(sizes, np.array([data.size], dtype=np.int64), timeout=timeout)
    outs = [np.empty(int(s[0]), dtype=np.uint8) for s in sizes]
    comm.all_gather_v(outs, data, timeout=timeout)
    for i, out in enumerate(outs):
        object_list[i] = _from_bytes(out, weights_only)


def gather_object(comm, obj, root, object_gather_list=None, timeout=None, weights_only=True):
    """Every rank's ``obj`` into ``object_gather_list`` on ``root`` (a list
    of the communicator's size there; ignored elsewhere)."""
    _host(comm)
    n, me = comm.get_size(), comm.get_rank()
    if me == root:
        _sized_list("object_gather_list on the root", object_gather_list, n)
    data = _to_bytes(obj)
    sizes = [np.zeros(1, dtype=np.int64) for _ in range(n)]
    comm.all_gather(sizes, np.array([data.size], dtype=np.int64), timeout=timeout)
    width = max(int(s[0]) for s in sizes)
    padded = np.zeros(width, dtype=np.uint8)
    padded[: data.size] = data
    outs = [np.empty(width, dtype=np.uint8) for _ in range(n)] if me == root else []
    comm.gather(outs, padded, root, timeout=timeout)
    if me == root:
        for i, (out, s) in enumerate(zip(outs, sizes)):
            object_gather_list[i] = _from_bytes(out[: int(s[0])], weights_only)


def broadcast_object_list(comm, object_list, root, timeout=None, weights_only=True):
    """``root``'s ``object_list`` into every rank's ``object_list`` (every
    rank passes a list of the same length)."""
    _host(comm)
    if not isinstance(object_list, list):
        raise ValueError("object_list must be a list")
    if not object_list:
        return
    me = comm.get_rank()
    if me == root:
        parts = [_to_bytes(o) for o in object_list]
        sizes = np.array([p.size for p in parts], dtype=np.int64)
    else:
        sizes = np.zeros(len(object_list), dtype=np.int64)
    comm.broadcast(sizes, root, timeout=timeout)
    data = np.concatenate(parts) if me == root else np.empty(int(sizes.sum()), dtype=np.uint8)
    comm.broadcast(data, root, timeout=timeout)
    if me != root:
        at = 0
        for i, s in enumerate(sizes):
            object_list[i] = _from_bytes(data[at : at + int(s)], weights_only)
            at += int(s)


def scatter_object_list(
    comm,
    root,
    scatter_object_output_list,
    scatter_object_input_list=None,
    timeout=None,
    weights_only=True,
):
    """Object ``i`` of ``root``'s ``scatter_object_input_list`` (a list of
    the communicator's size) into element 0 of rank ``i``'s
    ``scatter_object_output_list`` (a non-empty list)."""
    _host(comm)
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError(
            "Expected argument scatter_object_output_list to be a list of size at least 1."
        )
    n, me = comm.get_size(), comm.get_rank()
    if me == root:
        if scatter_object_input_list is None:
            raise ValueError("source rank must provide non-None scatter_object_input_list")
        _sized_list("scatter_object_input_list", scatter_object_input_list, n)
        parts = [_to_bytes(o) for o in scatter_object_input_list]
        sizes = np.array([p.size for p in parts], dtype=np.int64)
    else:
        sizes = np.zeros(n, dtype=np.int64)
    comm.broadcast(sizes, root, timeout=timeout)
    width = int(sizes.max())
    ins = None
    if me == root:
        ins = [np.zeros(width, dtype=np.uint8) for _ in range(n)]
        for buf, p in zip(ins, parts):
            buf[: p.size] = p
    out = np.empty(width, dtype=np.uint8)
    comm.scatter(out, ins, root, timeout=timeout)
    scatter_object_output_list[0] = _from_bytes(out[: int(sizes[me])], weights_only)


def send_object_list(comm, object_list, dst, timeout=None):
    """Send ``object_list`` to ``dst``, which calls ``recv_object_list``
    with a list of the same length."""
    _host(comm)
    if not isinstance(object_list, list):
        raise ValueError("object_list must be a list")
    if not object_list:
        return
    parts = [_to_bytes(o) for o in object_list]
    comm.send(np.array([p.size for p in parts], dtype=np.int64), dst, timeout=timeout)
    comm.send(np.concatenate(parts), dst, timeout=timeout)


def recv_object_list(comm, object_list, src, timeout=None, weights_only=True):
    """Receive ``src``'s ``send_object_list`` into ``object_list`` (a list
    of the length sent)."""
    _host(comm)
    if not isinstance(object_list, list):
        raise ValueError("object_list must be a list")
    if not object_list:
        return
    sizes = np.zeros(len(object_list), dtype=np.int64)
    comm.recv(sizes, src, timeout=timeout)
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    comm.recv(data, src, timeout=timeout)
    at = 0
    for i, s in enumerate(sizes):
        object_list[i] = _from_bytes(data[at : at + int(s)], weights_only)
        at += int(s)
