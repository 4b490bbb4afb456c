"""Chorus collectives from Python, with TorchComms' API.

::

    import numpy as np
    import chorus

    comm = chorus.new_comm("cpu", "cpu", "main")
    grad = np.ones(1024, dtype=np.float32)
    comm.all_reduce(grad, chorus.ReduceOp.AVG, async_op=False)  # in place
    comm.finalize()

Names and argument order follow ``torchcomms._comms`` (``TorchComm``,
``TorchWork``, ``BatchSendRecv``, ``ReduceOp``); docs/python.md lists the
differences. Buffers are anything with the buffer protocol (NumPy arrays,
``bytearray``, ``memoryview``), CPU ``torch.Tensor``s, or any CPU array with
``__dlpack__`` (DLPack), C-contiguous.
Ops write into the caller's arrays; an array must not be read or written
until its op's work has been waited on.

Rank, size and the rendezvous come from the environment, as set by
``python -m chorus.run -n N script.py``, ``chorus-run`` or ``torchrun``
(plus ``CHORUS_SECRET``).
"""

import array
import datetime
import enum
import inspect
import os
import secrets
import socket
import sys

from . import _chorus
from ._errors import *  # noqa: F401,F403
from ._errors import ConfigError, MismatchError, NotSupportedError, __all__ as _error_names
from ._hookargs import (
    FINALIZE_OP_ID,
    POST_HOOK_ARGS,
    PRE_HOOK_ARGS,
    AbortHookArgs,
    AllGatherPreHookArgs,
    AllGatherSinglePreHookArgs,
    AllGatherVPreHookArgs,
    AllReducePreHookArgs,
    AllToAllPreHookArgs,
    AllToAllSinglePreHookArgs,
    AllToAllVSinglePreHookArgs,
    BarrierPreHookArgs,
    BatchOpIssuePreHookArgs,
    BroadcastPreHookArgs,
    CollectivePostHookArgs,
    FinalizePostHookArgs,
    FinalizePreHookArgs,
    GatherPreHookArgs,
    GatherSinglePreHookArgs,
    NewWindowPostHookArgs,
    NewWindowPreHookArgs,
    OpName,
    PostHookArgs,
    PreHookArgs,
    RecvPreHookArgs,
    ReducePreHookArgs,
    ReduceScatterPreHookArgs,
    ReduceScatterSinglePreHookArgs,
    ReduceScatterVPreHookArgs,
    RemovableHandle,
    ScatterPreHookArgs,
    SendPreHookArgs,
    SplitPostHookArgs,
    SplitPreHookArgs,
    WindowPreHookArgs,
    _op_name,
)

# Every hook-args class, importable from here as from torchcomms._comms.
for _c in PRE_HOOK_ARGS + POST_HOOK_ARGS[1:]:
    globals()[_c.__name__] = _c
del _c

__all__ = [
    "new_comm",
    "join_comm",
    "Comm",
    "Work",
    "ReduceOp",
    "RedOpType",
    "P2POp",
    "P2POpType",
    "BatchSendRecv",
    "CommOptions",
    "OpName",
    "PreHookArgs",
    "PostHookArgs",
    "CollectivePostHookArgs",
    "AbortHookArgs",
    "RemovableHandle",
    "AllGatherPHandle",
    "Window",
    "TorchCommWindow",
    "TorchCommWindowAttr",
    "TorchCommWinAccessType",
    "DTYPES",
] + [c.__name__ for c in PRE_HOOK_ARGS + POST_HOOK_ARGS[1:]] + list(_error_names)

__version__ = _chorus.__version__

Work = _chorus.Work
"""The handle of an op (TorchComms' ``TorchWork``): ``is_completed()``,
``wait()`` (any number of times) and ``wait_blocking()``."""


# ------------------------------------------------------------------ dtypes

# Chorus's DType codes (src/tensor.rs).
_F16, _BF16, _F32, _F64, _I8, _U8, _I32, _I64, _U32, _U64, _BOOL = range(11)

DTYPES = {
    "float16": _F16,
    "bfloat16": _BF16,
    "float32": _F32,
    "float64": _F64,
    "int8": _I8,
    "uint8": _U8,
    "int32": _I32,
    "int64": _I64,
    "uint32": _U32,
    "uint64": _U64,
    "bool": _BOOL,
}
"""The element types Chorus reduces and moves, by name."""

_ITEMSIZE = {_F16: 2, _BF16: 2, _F32: 4, _F64: 8, _I8: 1, _U8: 1, _I32: 4, _I64: 8,
             _U32: 4, _U64: 8, _BOOL: 1}


def _itemsize(code):
    return _ITEMSIZE[code]


def _dtype_name(code):
    return next(name for name, c in DTYPES.items() if c == code)

# struct-module format letter -> (signed int / unsigned int / float) kind.
_INT_FORMATS = set("bhilq")
_UINT_FORMATS = set("BHILQ")
_FLOAT_FORMATS = {"e": _F16, "f": _F32, "d": _F64}
_INT_CODES = {1: _I8, 4: _I32, 8: _I64}
_UINT_CODES = {1: _U8, 4: _U32, 8: _U64}


def _torch_view(obj):
    """A CPU torch tensor as a NumPy array sharing its memory, and the dtype
    code when NumPy cannot express it (bfloat16)."""
    import torch  # only reached for torch tensors

    if obj.device.type != "cpu":
        raise ValueError(
            f"tensor is on {obj.device}; the chorus Python package moves host memory only"
        )
    t = obj.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), _BF16
    return t.numpy(), None


def _buffer(obj):
    """``(byte memoryview, dtype code)`` of a C-contiguous buffer."""
    override = None
    if type(obj).__module__.startswith("torch"):
        obj, override = _torch_view(obj)
    try:
        mv = memoryview(obj)
    except TypeError:
        if not hasattr(type(obj), "__dlpack__"):
            raise TypeError(
                f"expected an array with the buffer protocol or __dlpack__ (numpy.ndarray, "
                f"bytearray, CPU torch.Tensor), got {type(obj).__name__}"
            ) from None
        # No buffer protocol: import it through DLPack. The view owns the
        # DLPack tensor (its deleter runs when the view is freed) and is a
        # flat byte buffer; the dtype comes from the DLPack header.
        view, code = _chorus._dlpack_view(obj)
        return memoryview(view), code
    if not mv.c_contiguous:
        raise ValueError(
            "the array is not C-contiguous; pass numpy.ascontiguousarray(x) "
            "(and copy the result back into x for an in-place op)"
        )
    fmt = mv.format.lstrip("@=<")
    if fmt.startswith((">", "!")) and sys.byteorder == "little":
        raise ValueError(f"big-endian arrays are not supported (format {mv.format!r})")
    fmt = fmt.lstrip(">!")
    if override is not None:
        code = override
    elif fmt in _FLOAT_FORMATS:
        code = _FLOAT_FORMATS[fmt]
    elif fmt in _INT_FORMATS and mv.itemsize in _INT_CODES:
        code = _INT_CODES[mv.itemsize]
    elif fmt in _UINT_FORMATS and mv.itemsize in _UINT_CODES:
        code = _UINT_CODES[mv.itemsize]
    elif fmt == "c":
        code = _U8
    elif fmt == "?" and mv.itemsize == 1:
        # Reductions on bool are logical (SUM/MAX/BOR = or, PRODUCT/MIN/BAND = and).
        code = _BOOL
    else:
        raise TypeError(
            f"unsupported element type (format {mv.format!r}, {mv.itemsize} bytes); "
            f"Chorus supports {', '.join(DTYPES)}"
        )
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B") if mv.nbytes else memoryview(bytearray())
    return mv, code


def _buffers(objs):
    """Byte views of a list of buffers, and their common dtype code."""
    views = [_buffer(o) for o in objs]
    codes = {c for _, c in views}
    if len(codes) > 1:
        raise TypeError("the tensors of one op must all have the same dtype")
    return [v for v, _ in views], (codes.pop() if codes else None)


def _same(code, other, what):
    if other is not None and code is not None and other != code:
        raise TypeError(f"{what} has a different dtype from the input")
    return code if code is not None else other


def _row_width(x):
    """Elements per row of dimension 0 of ``x`` (1 for 1-D or shapeless)."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 2:
        return 1
    width = 1
    for d in tuple(shape)[1:]:
        width *= int(d)
    return width


def _seconds(timeout):
    """A ``timedelta`` or number of seconds as float seconds, or ``None``."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


# ------------------------------------------------------------------ ReduceOp


class RedOpType(enum.Enum):
    """The kind of a :class:`ReduceOp` (TorchComms' ``RedOpType``)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


class ReduceOp:
    """A reduction: ``ReduceOp.SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``AVG``,
    ``BAND``, ``BOR``, ``BXOR``, or ``ReduceOp.PREMUL_SUM(factor)`` (each rank
    scales its input by its own ``factor``, a scalar or a one-element
    array or tensor, then the results are summed)."""

    __slots__ = ("_type", "_factor")

    def __init__(self, type_, factor=0.0):
        self._type = RedOpType(type_)
        self._factor = float(factor)

    @property
    def type(self):
        return self._type

    @staticmethod
    def PREMUL_SUM(factor):  # noqa: N802 (TorchComms' name)
        if not isinstance(factor, (int, float)):
            # A one-element array or tensor holding this rank's factor, as
            # TorchComms passes it (NCCL reads it from a one-element buffer).
            # torch: numel(); NumPy: the size attribute.
            n = factor.numel() if hasattr(factor, "numel") else getattr(factor, "size", 1)
            if n != 1:
                raise TypeError(
                    f"PREMUL_SUM takes this rank's factor: a scalar or a one-element "
                    f"tensor, got {n} elements"
                )
            try:
                factor = factor.item() if hasattr(factor, "item") else float(factor)
            except (TypeError, ValueError):
                raise TypeError("PREMUL_SUM takes a scalar or a one-element tensor") from None
            factor = float(factor)
        return ReduceOp(RedOpType.PREMUL_SUM, factor)

    def __eq__(self, other):
        return (
            isinstance(other, ReduceOp)
            and self._type == other._type
            and self._factor == other._factor
        )

    def __hash__(self):
        return hash((self._type, self._factor))

    def __repr__(self):
        if self._type is RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM({self._factor})"
        return f"ReduceOp.{self._type.name}"


for _t in RedOpType:
    if _t is not RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _t.name, ReduceOp(_t))
del _t


def _op(op):
    if not isinstance(op, ReduceOp):
        raise TypeError(f"expected a chorus.ReduceOp, got {type(op).__name__}")
    return op._type.value, op._factor


# ------------------------------------------------------------------ p2p batches


class P2POpType(enum.Enum):
    """Direction of a :class:`P2POp`."""

    SEND = 0
    RECV = 1


class P2POp:
    """One send or receive of a batch (TorchComms' ``P2POp``)."""

    def __init__(self, type, tensor, peer):  # noqa: A002 (TorchComms' name)
        self.type = P2POpType(type)
        self.tensor = tensor
        self.peer = int(peer)


class BatchSendRecv:
    """Sends and receives issued together (``comm.batch_op_create()``), so
    that a ring exchange cannot deadlock on the order of its ops."""

    def __init__(self, comm):
        self._comm = comm
        self.ops = []

    def send(self, tensor, dst):
        self.ops.append(P2POp(P2POpType.SEND, tensor, dst))

    def recv(self, tensor, src):
        self.ops.append(P2POp(P2POpType.RECV, tensor, src))

    def issue(self, async_op=False, options=None, *, hints=None, timeout=None):
        if options is not None and timeout is None:
            timeout = getattr(options, "timeout", None)
        ops = []
        for p in self.ops:
            view, code = _buffer(p.tensor)
            ops.append((p.type is P2POpType.SEND, view, code, p.peer))
        if options is not None and hints is None:
            hints = getattr(options, "hints", None)
        comm = self._comm
        code = ops[0][2] if ops else None
        work = comm._run(
            OpName.batch_op_issue, hints, BatchOpIssuePreHookArgs,
            lambda: comm._on(hints).batch_p2p(ops, _seconds(timeout)),
            num_ops=len(ops), ops=list(self.ops), async_op=async_op,
            peers=sorted({p for *_, p in ops}),
            _data=(code, sum(len(v) for _, v, _, _ in ops),
                   sum(len(v) // _itemsize(c) for _, v, c, _ in ops)),
        )
        return _finish(work, async_op)


def _finish(work, async_op):
    if not async_op:
        work.wait()
    return work


# ------------------------------------------------------------------ options


class CommOptions:
    """A communicator's options, as :meth:`Comm.get_options` returns them
    (TorchComms' ``CommOptions``; the fields Chorus does not use keep
    TorchComms' defaults)."""

    def __init__(self, timeout=None, hints=None):
        self.abort_process_on_timeout_or_error = False
        self.timeout = timeout if timeout is not None else datetime.timedelta(minutes=10)
        self.high_priority_stream = False
        self.store = None
        self.enable_reconfigure = True
        self.hints = dict(hints or {})

    def __repr__(self):
        return f"CommOptions(timeout={self.timeout!r}, hints={self.hints!r})"


# ------------------------------------------------------------------ hooks


def _takes_one(callback):
    """Whether ``callback`` can be called with exactly one argument."""
    try:
        inspect.signature(callback).bind(None)
        return True
    except (TypeError, ValueError):
        return False


def _unraisable(exc, hook):
    _chorus._write_unraisable(exc, hook)


# ------------------------------------------------------------------ persistent


class AllGatherPHandle:
    """A persistent all-gather (:meth:`Comm.all_gather_p_init`): dtype,
    count and output fixed once; each exec gathers into the same output,
    writing it in place."""

    def __init__(self, comm, output, oview, code, count):
        self._comm = comm
        self._output = output
        self._oview = oview
        self._code = code
        self.count = count

    def _exec(self, comm, input, async_op, hints, timeout):  # noqa: A002
        if self._oview is None:
            raise ValueError("this persistent all_gather was freed")
        if comm.get_name() != self._comm.get_name():
            raise ValueError("the handle belongs to another communicator")
        iview, code = _buffer(input)
        if code != self._code or len(iview) != self.count * _itemsize(code):
            raise ValueError(
                f"all_gather_p_exec takes {self.count} x {_dtype_name(self._code)} per rank "
                f"(fixed at init), got {len(iview) // _itemsize(code)} x {_dtype_name(code)}"
            )
        oview, owner = self._oview, self._comm
        work = owner._run(
            OpName.all_gather_single, hints, AllGatherSinglePreHookArgs,
            lambda: owner._on(hints).all_gather_single(oview, iview, code, _seconds(timeout)),
            input=input, output=self._output, async_op=async_op, _data=(code, len(iview)),
        )
        return _finish(work, async_op)

    def _free(self):
        self._oview = None
        self._output = None


# ------------------------------------------------------------------ windows


class TorchCommWinAccessType(enum.Enum):
    """How a peer's window is reached: mapped into this process
    (``UNIFIED``: this rank's own, or a same-host peer's shared memory), or
    over the network (``SEPARATE``)."""

    WIN_ACCESS_TYPE_UNIFIED = 0
    WIN_ACCESS_TYPE_SEPARATE = 1


class TorchCommWindowAttr:
    """A peer's window as this rank sees it: ``access_type`` and ``size``
    (bytes, Chorus only)."""

    def __init__(self, access_type, size):
        self.access_type = access_type
        self.size = size

    def __repr__(self):
        return f"TorchCommWindowAttr({self.access_type.name}, size={self.size})"


class Window:
    """A one-sided window (TorchComms' ``TorchCommWindow``), from
    :meth:`Comm.new_window`.

    ``put`` writes into a peer's window without the peer posting a
    receive; ``signal(dst)`` tells ``dst`` that every earlier put to it has
    landed; ``wait_signal(src)`` waits for the next signal from ``src``
    (each pair counts its signals). Read this rank's window with
    ``get_tensor()`` or ``read()`` once a ``wait_signal`` returned.
    """

    def __init__(self, comm, native, tensor, code):
        self._comm = comm
        self._w = native
        self._tensor = tensor
        self._code = code
        self._waits = {}

    @property
    def dtype(self):
        return _dtype_name(self._code)

    def get_size(self):
        """This rank's window size in bytes."""
        return self._w.get_size()

    def sizes(self):
        """Chorus only: every rank's window size in bytes."""
        return self._w.sizes()

    def get_attr(self, peer_rank):
        unified, size = self._w.get_attr(peer_rank)
        kind = (
            TorchCommWinAccessType.WIN_ACCESS_TYPE_UNIFIED
            if unified
            else TorchCommWinAccessType.WIN_ACCESS_TYPE_SEPARATE
        )
        return TorchCommWindowAttr(kind, size)

    def put(self, tensor, dst_rank, target_offset_nelems, async_op=False, hints=None, timeout=None):
        """Write ``tensor`` into ``dst_rank``'s window at element offset
        ``target_offset_nelems`` (elements of ``tensor``'s dtype)."""
        view, code = _buffer(tensor)
        offset = int(target_offset_nelems) * _itemsize(code)
        return _finish(self._comm._run(
            OpName.window_put, hints, WindowPreHookArgs,
            lambda: self._w.put(view, code, dst_rank, offset, _seconds(timeout)),
            tensor=tensor, peers=[dst_rank], async_op=async_op, _data=(code, len(view)),
        ), async_op)

    def signal(self, dst_rank, async_op=False, hints=None, timeout=None):
        """Signal ``dst_rank``: delivered after every earlier put to it."""
        return _finish(self._comm._run(
            OpName.window_signal, hints, WindowPreHookArgs,
            lambda: self._w.signal(dst_rank, 1, _seconds(timeout)),
            tensor=None, peers=[dst_rank], async_op=async_op,
        ), async_op)

    def wait_signal(self, peer_rank, async_op=False, hints=None, timeout=None):
        """Wait for the next signal from ``peer_rank`` (the k-th call waits
        for its k-th signal); the puts it issued before it are then in this
        rank's window."""
        want = self._waits.get(peer_rank, 0) + 1
        work = self._comm._run(
            OpName.window_wait_signal, hints, WindowPreHookArgs,
            lambda: self._w.wait_signal(peer_rank, want, _seconds(timeout)),
            tensor=None, peers=[peer_rank], async_op=async_op,
        )
        self._waits[peer_rank] = want
        return _finish(work, async_op)

    def read(self, out, offset_bytes=0, timeout=None):
        """Chorus only: copy this rank's window from ``offset_bytes`` into
        ``out`` (any writable buffer); returns ``out``."""
        view, _ = _buffer(out)
        self._w.read(view, int(offset_bytes), _seconds(timeout)).wait()
        return out

    def get_tensor(self):
        """The tensor given to ``new_window``, refreshed with this rank's
        window contents (a copy), or ``None`` for a window made by size."""
        if self._tensor is None:
            return None
        return self.read(self._tensor)

    def free(self):
        """Free the window on every rank (collective); finalize and abort
        free it too."""
        self._w.free()

    def __repr__(self):
        return repr(self._w)


TorchCommWindow = Window


# ------------------------------------------------------------------ communicator


class Comm:
    """A communicator (TorchComms' ``TorchComm``).

    Every op takes ``async_op`` (default ``False``: block until done) and
    the keywords ``hints`` (a ``dict`` of strings, over the communicator's
    own: hooks and the flight recorder see them, known keys such as
    ``"chorus.tag"`` and ``"chorus.record"`` are checked, others are kept
    and ignored) and ``timeout`` (a ``timedelta`` or seconds; this op only).
    Every op returns a :class:`Work`, already completed when ``async_op`` is
    false.
    """

    def __init__(self, native):
        self._c = native
        # Hooks registered from Python (copy-on-write tuples of
        # ``(key, callback)``): pre hooks run here, in ``_run``; post hooks
        # are registered with Chorus as well and kept here for the events
        # only Python sees (split, new_window, finalize).
        self._pre = ()
        self._post = ()

    def _on(self, hints):
        """The native communicator, carrying ``hints`` for one op."""
        if not hints:
            return self._c
        return self._c.with_hints({str(k): str(v) for k, v in dict(hints).items()})

    def _run(self, name, hints, args, issue, **fields):
        """Issue an op: ``issue()`` returns its native work. With pre hooks
        registered, first call them on this thread with a fresh op id and
        ``args(...)`` (a :class:`PreHookArgs` class) over ``fields`` (an
        exception in one propagates and the op is not issued), then issue
        the op with that id, so its post hooks see the same."""
        pre = self._pre
        if not pre:
            return issue()
        op_id = _chorus._reserve_op_id()
        a = self._pre_args(args, name, op_id, hints, fields)
        for _, f in pre:
            f(name, op_id, a)
        work, taken = _chorus._with_op_id(op_id, issue)
        if not taken and self._post:
            # Rejected by Chorus's argument checks before it was issued: its
            # pre hooks saw it, so its post hooks hear how it ended.
            try:
                work.wait()
                error = None
            except Exception as e:  # noqa: BLE001 - handed to the hooks
                error = e
            self._tell_post(name, op_id, PostHookArgs(seq=None, duration=0.0,
                                                      run_duration=None, error=error))
        return work

    def _pre_args(self, cls, name, op_id, hints, fields):
        merged = self._c.get_hints()
        if hints:
            merged.update({str(k): str(v) for k, v in dict(hints).items()})
        code, nbytes, *count = fields.pop("_data", (None, 0))
        common = {
            "op_id": op_id,
            "name": name,
            "op": name.value,
            "comm": self._c.get_name(),
            "rank": self._c.get_rank(),
            "tag": merged.get("chorus.tag"),
            "hints": merged,
            "dtype": _dtype_name(code) if code is not None else None,
            "count": count[0] if count else (nbytes // _itemsize(code) if code is not None else 0),
            "bytes": nbytes,
            "root": None,
            "peers": [],
        }
        # The op's own fields win (split's ``name`` is the new
        # communicator's, as in TorchComms).
        common.update(fields)
        return cls(common)

    def _lifecycle(self, name, op_id, pre_args, run, post_args):
        """Run a communicator event Chorus's hooks do not see (split,
        new_window, finalize): pre hooks before ``run()``, post hooks
        after it returned, with ``post_args(result)``. ``op_id``: ``None``
        for a fresh one of the sequence (taken only when hooks are
        registered)."""
        if op_id is None and (self._pre or self._post):
            op_id = _chorus._reserve_op_id()
        if self._pre:
            a = self._pre_args(pre_args[0], name, op_id, None, pre_args[1])
            for _, f in self._pre:
                f(name, op_id, a)
        result = run()
        if self._post:
            self._tell_post(name, op_id, post_args(result))
        return result

    def _tell_post(self, name, op_id, args):
        """Call the post hooks here, for an event Chorus's hooks did not
        see; an exception goes to ``sys.unraisablehook``, as from theirs."""
        args._d.update(op_id=op_id, op=name.value, name=name, comm=self._c.get_name(),
                       rank=self._c.get_rank())
        args._d.setdefault("error", None)
        for _, f in self._post:
            try:
                f(args._d, args)
            except Exception as e:  # noqa: BLE001 - as Chorus's own post hooks
                _unraisable(e, f)

    # -------------------------------------------------------------- identity

    def get_rank(self):
        return self._c.get_rank()

    def get_size(self):
        return self._c.get_size()

    def get_name(self):
        return self._c.get_name()

    def get_device(self):
        """``"cpu"`` or ``"cuda:N"`` (a ``torch.device`` when torch is
        imported)."""
        dev = self._c.get_device()
        torch = sys.modules.get("torch")
        return torch.device(dev) if torch is not None else dev

    def get_backend(self):
        return self._c.get_backend()

    def get_timeout(self):
        """The default timeout of this communicator's ops."""
        return datetime.timedelta(seconds=self._c.get_timeout())

    def get_epoch(self):
        """The epoch (Chorus only: 0, then +1 per ``reconfigure``)."""
        return self._c.get_epoch()

    def get_backend_version(self):
        """The vendor library's version where there is one (``"nccl
        2.21.5"``), else the backend's name and Chorus's version."""
        return self._c.get_backend_version()

    def set_timeout(self, timeout):
        """Set the default timeout (``timedelta`` or seconds) of the ops
        issued from now on; ops already issued keep theirs."""
        self._c.set_timeout(_seconds(timeout))

    def get_options(self):
        """The options this communicator was created with (a
        :class:`CommOptions`), with its current timeout and hints."""
        return CommOptions(timeout=self.get_timeout(), hints=self._c.get_hints())

    # -------------------------------------------------------------- observing

    def register_pre_hook(self, callback):
        """Call ``callback(name, op_id, args)`` before every op issued on this
        communicator from now on, as TorchComms does: on the thread that
        called the op, after its arguments were checked and before it is
        issued. ``name`` is an :class:`OpName` (a ``str``), ``op_id`` a
        process-wide increasing id (its post hooks see the same), ``args`` the
        op's :class:`PreHookArgs` subclass (``AllReducePreHookArgs``, ...),
        which carries the op's tensors. ``callback(args)`` when it takes one
        argument (``args.name``, ``args.op_id``). Hooks run in the order they
        were registered. An exception raised by one propagates to the
        caller and the op is not issued on this rank (the other ranks' ops
        then wait for it, up to their timeout), which is how
        :class:`chorus.hooks.NanCheckHook` stops an op. ``split``,
        ``new_window`` and ``finalize`` reach pre hooks too. Returns a
        :class:`RemovableHandle`."""
        if _takes_one(callback):

            def hook(name, op_id, args):
                callback(args)

        else:
            hook = callback
        key = object()
        self._pre = self._pre + ((key, hook),)

        def remove():
            self._pre = tuple(e for e in self._pre if e[0] is not key)

        return RemovableHandle(remove)

    def register_post_hook(self, callback):
        """Call ``callback(op_id, args)`` for every op when it completes
        (``args`` a :class:`PostHookArgs`: duration, error, ...), or
        ``callback(args)`` when it takes one argument (``args.name``,
        ``args.op_id``). Post hooks run one at a time, in order, on this
        communicator's hook thread or on a thread waiting for one of its
        ops; waiting for an op (a blocking op, ``wait()``) returns only after
        its post hooks ran. ``split``, ``new_window`` and ``finalize`` call
        them on the caller's thread once they returned. An exception in one
        goes to ``sys.unraisablehook``. Returns a :class:`RemovableHandle`."""
        if _takes_one(callback):

            def call(d, args):
                args._d.setdefault("name", _op_name(d["op"]))
                callback(args)

        else:

            def call(d, args):
                callback(d["op_id"], args)

        native = self._c.register_post_hook(lambda d: call(d, PostHookArgs(d)))
        key = object()
        self._post = self._post + ((key, call),)

        def remove():
            native.remove()
            self._post = tuple(e for e in self._post if e[0] is not key)

        return RemovableHandle(remove)

    def register_abort_hook(self, callback):
        """Call ``callback()`` once when this communicator is aborted (by a
        failure or by ``abort()``), before its outstanding ops are failed;
        ``callback(args)`` with an :class:`AbortHookArgs` (the cause) if it
        takes one argument. The abort waits for it at most 2 s."""
        with_args = _takes_one(callback)

        def hook(d):
            if with_args:
                callback(AbortHookArgs(d))
            else:
                callback()

        return RemovableHandle(self._c.register_abort_hook(hook).remove)

    def flight_record(self):
        """Chorus only: the last ops of this communicator (2000 by default),
        oldest first, as dicts: ``id``, ``op_id``, ``seq``, ``op``,
        ``dtype``, ``count``, ``bytes``, ``root``, ``peers``, ``tag``,
        ``state`` (``"queued"``, ``"started"``, ``"completed"``,
        ``"failed"``), ``error`` and the ``issued_us`` / ``started_us`` /
        ``completed_us`` timestamps (microseconds since the Unix epoch)."""
        return self._c.flight_record()

    def __repr__(self):
        return repr(self._c)

    # -------------------------------------------------------------- lifecycle

    def finalize(self):
        """Finish every outstanding op, then close the communicator."""
        self._lifecycle(
            OpName.finalize, FINALIZE_OP_ID, (FinalizePreHookArgs, {"async_op": False}),
            self._c.finalize, lambda _: FinalizePostHookArgs(),
        )

    def abort(self, reason=None):
        """Fail every outstanding op (on every rank) and close."""
        self._c.abort(reason)

    def is_aborted(self):
        return self._c.is_aborted()

    def is_abort_supported(self):
        return True

    def health(self):
        """Chorus only: ``{"active", "epoch", "failed_ranks", "failure",
        "child_failures", "tcp_fallbacks"}`` as this rank sees it now
        (``tcp_fallbacks``: ``(peer, reason)`` for each same-host peer
        reached over TCP because shared memory could not be set up)."""
        return self._c.health()

    def split(self, ranks, name, hints=None, timeout=None):
        """A communicator of ``ranks`` (every rank passes the same list), or
        ``None`` on ranks not in it."""
        ranks = list(ranks)

        def run():
            child = self._on(hints).split(ranks, name, _seconds(timeout))
            return Comm(child) if child is not None else None

        return self._lifecycle(
            OpName.split, None, (SplitPreHookArgs, {"ranks": ranks, "name": name, "async_op": False}),
            run, lambda child: SplitPostHookArgs(new_comm=child),
        )

    def reconfigure(self, timeout=None, min_size=None, wait_joiners=0, *, uuid=None, init_handles=None):
        """Form the next epoch from the ranks still alive (Chorus's quorum
        reconfigure).

        Returns ``(comm, rank_map)``: the new communicator and
        ``{"epoch", "size", "old_to_new", "joined"}``. Raises
        ``NoQuorumError`` when no more than half of the ranks (or fewer than
        ``min_size``) survived.

        TorchComms' form, ``reconfigure(uuid, init_handles, ...)`` with
        handles from :meth:`get_init_handle`, is not supported: it raises
        ``NotSupportedError`` (a ``RuntimeError``), as TorchComms does for a
        backend without it.
        """
        if uuid is not None or init_handles is not None or isinstance(timeout, str):
            raise NotSupportedError(
                "reconfigure not implemented for uuid and init_handles: Chorus reconfigures "
                "by quorum, reconfigure(timeout, min_size, wait_joiners)"
            )
        child, rank_map = self._c.reconfigure(_seconds(timeout), min_size, wait_joiners)
        return Comm(child), rank_map

    def get_init_handle(self):
        """TorchComms' init handle for ``reconfigure(uuid, init_handles)``:
        not supported, raises ``NotSupportedError`` (a ``RuntimeError``)
        saying ``getInitHandle not implemented``, as TorchComms does for a
        backend without it."""
        raise NotSupportedError(
            f"getInitHandle not implemented for backend {self.get_backend()!r}: Chorus "
            "reconfigures by quorum (reconfigure(timeout, min_size, wait_joiners))"
        )

    def tensor_register(self, tensor):
        """Register ``tensor`` for transfers without a copy (TorchComms).
        Chorus's backends need no registration (the ``cpu`` backend reads and
        writes host buffers in place), so this only checks that ``tensor``
        is a buffer ops can use (raising as an op would) and keeps nothing."""
        _buffer(tensor)

    def tensor_deregister(self, tensor):
        """Undo :meth:`tensor_register`: checks ``tensor`` as it does and
        keeps nothing."""
        _buffer(tensor)

    # -------------------------------------------------------------- collectives

    def all_reduce(self, tensor, op, async_op=False, hints=None, timeout=None):
        view, code = _buffer(tensor)
        o, f = _op(op)
        return _finish(self._run(
            OpName.all_reduce, hints, AllReducePreHookArgs,
            lambda: self._on(hints).all_reduce(view, code, o, f, _seconds(timeout)),
            tensor=tensor, reduce_op=op, async_op=async_op, _data=(code, len(view)),
        ), async_op)

    def reduce(self, tensor, root, op, async_op=False, hints=None, timeout=None):
        view, code = _buffer(tensor)
        o, f = _op(op)
        return _finish(self._run(
            OpName.reduce, hints, ReducePreHookArgs,
            lambda: self._on(hints).reduce(view, code, root, o, f, _seconds(timeout)),
            tensor=tensor, root=root, reduce_op=op, async_op=async_op, _data=(code, len(view)),
        ), async_op)

    def broadcast(self, tensor, root, async_op=False, hints=None, timeout=None):
        view, code = _buffer(tensor)
        return _finish(self._run(
            OpName.broadcast, hints, BroadcastPreHookArgs,
            lambda: self._on(hints).broadcast(view, code, root, _seconds(timeout)),
            tensor=tensor, root=root, async_op=async_op, _data=(code, len(view)),
        ), async_op)

    def all_gather(self, tensor_list, tensor, async_op=False, hints=None, timeout=None):
        """Every rank's ``tensor`` into ``tensor_list`` (one per rank)."""
        if len(tensor_list) != self.get_size():
            raise ValueError(f"tensor_list must hold {self.get_size()} tensors")
        return self._all_gather_v(
            OpName.all_gather, AllGatherPreHookArgs, tensor_list, tensor, async_op, hints, timeout
        )

    def all_gather_v(self, tensor_list, tensor, async_op=False, hints=None, timeout=None):
        """As ``all_gather``, each rank's tensor of its own size."""
        return self._all_gather_v(
            OpName.all_gather_v, AllGatherVPreHookArgs, tensor_list, tensor, async_op, hints, timeout
        )

    def _all_gather_v(self, name, args, tensor_list, tensor, async_op, hints, timeout):
        view, code = _buffer(tensor)
        outs, ocode = _buffers(tensor_list)
        code = _same(code, ocode, "tensor_list")
        return _finish(self._run(
            name, hints, args,
            lambda: self._on(hints).all_gather_v(outs, view, code, _seconds(timeout)),
            input=tensor, output=tensor_list, async_op=async_op, _data=(code, len(view)),
        ), async_op)

    def all_gather_single(self, output, input, async_op=False, hints=None, timeout=None):  # noqa: A002
        iview, code = _buffer(input)
        oview, ocode = _buffer(output)
        code = _same(code, ocode, "output")
        return _finish(self._run(
            OpName.all_gather_single, hints, AllGatherSinglePreHookArgs,
            lambda: self._on(hints).all_gather_single(oview, iview, code, _seconds(timeout)),
            input=input, output=output, async_op=async_op, _data=(code, len(iview)),
        ), async_op)

    def reduce_scatter(self, output, input_list, op, async_op=False, hints=None, timeout=None):
        if len(input_list) != self.get_size():
            raise ValueError(f"input_list must hold {self.get_size()} tensors")
        return self._reduce_scatter_v(
            OpName.reduce_scatter, ReduceScatterPreHookArgs,
            output, input_list, op, async_op, hints, timeout,
        )

    def reduce_scatter_v(self, output, input_list, op, async_op=False, hints=None, timeout=None):
        return self._reduce_scatter_v(
            OpName.reduce_scatter_v, ReduceScatterVPreHookArgs,
            output, input_list, op, async_op, hints, timeout,
        )

    def _reduce_scatter_v(self, name, args, output, input_list, op, async_op, hints, timeout):
        oview, code = _buffer(output)
        ins, icode = _buffers(input_list)
        code = _same(code, icode, "input_list")
        o, f = _op(op)
        return _finish(self._run(
            name, hints, args,
            lambda: self._on(hints).reduce_scatter_v(oview, ins, code, o, f, _seconds(timeout)),
            input=input_list, output=output, reduce_op=op, async_op=async_op,
            _data=(code, sum(len(v) for v in ins)),
        ), async_op)

    def reduce_scatter_single(self, output, input, op, async_op=False, hints=None, timeout=None):  # noqa: A002
        iview, code = _buffer(input)
        oview, ocode = _buffer(output)
        code = _same(code, ocode, "output")
        o, f = _op(op)
        return _finish(self._run(
            OpName.reduce_scatter_single, hints, ReduceScatterSinglePreHookArgs,
            lambda: self._on(hints).reduce_scatter_single(
                oview, iview, code, o, f, _seconds(timeout)
            ),
            input=input, output=output, reduce_op=op, async_op=async_op,
            _data=(code, len(iview)),
        ), async_op)

    def all_to_all_single(self, output, input, async_op=False, hints=None, timeout=None):  # noqa: A002
        iview, code = _buffer(input)
        oview, ocode = _buffer(output)
        code = _same(code, ocode, "output")
        return _finish(self._run(
            OpName.all_to_all_single, hints, AllToAllSinglePreHookArgs,
            lambda: self._on(hints).all_to_all_single(oview, iview, code, _seconds(timeout)),
            input=input, output=output, async_op=async_op, _data=(code, len(iview)),
        ), async_op)

    def all_to_all_v_single(
        self,
        output,
        input,  # noqa: A002
        output_split_sizes,
        input_split_sizes,
        async_op=False,
        hints=None,
        timeout=None,
    ):
        """Split sizes count rows of dimension 0, as in TorchComms: for a 2-D
        ``input`` of shape ``(rows, k)`` a split of 2 moves ``2 * k``
        elements; ``input`` and ``output`` must have the same shape past
        dimension 0. For 1-D arrays (and buffers without a ``shape``) a row
        is one element."""
        width = _row_width(input)
        if _row_width(output) != width:
            raise ValueError(
                "input and output of all_to_all_v_single must have the same shape past "
                f"dimension 0 (got {tuple(input.shape)} and {tuple(output.shape)})"
            )
        iview, code = _buffer(input)
        oview, ocode = _buffer(output)
        code = _same(code, ocode, "output")
        out_splits = [int(s) * width for s in output_split_sizes]
        in_splits = [int(s) * width for s in input_split_sizes]
        return _finish(self._run(
            OpName.all_to_all_v_single, hints, AllToAllVSinglePreHookArgs,
            lambda: self._on(hints).all_to_all_v_single(
                oview, iview, out_splits, in_splits, code, _seconds(timeout)
            ),
            input=input, output=output, input_split_sizes=list(input_split_sizes),
            output_split_sizes=list(output_split_sizes), async_op=async_op,
            _data=(code, len(iview)),
        ), async_op)

    def all_to_all(self, output_tensor_list, input_tensor_list, async_op=False, hints=None, timeout=None):
        ins, code = _buffers(input_tensor_list)
        outs, ocode = _buffers(output_tensor_list)
        code = _same(code, ocode, "output_tensor_list")
        if code is None:
            raise ValueError("all_to_all needs one tensor per rank")
        return _finish(self._run(
            OpName.all_to_all, hints, AllToAllPreHookArgs,
            lambda: self._on(hints).all_to_all(outs, ins, code, _seconds(timeout)),
            input=input_tensor_list, output=output_tensor_list, async_op=async_op,
            _data=(code, sum(len(v) for v in ins)),
        ), async_op)

    def barrier(self, async_op=False, hints=None, timeout=None):
        return _finish(self._run(
            OpName.barrier, hints, BarrierPreHookArgs,
            lambda: self._on(hints).barrier(_seconds(timeout)),
            async_op=async_op,
        ), async_op)

    def scatter(self, output_tensor, input_tensor_list, root, async_op=False, hints=None, timeout=None):
        """``input_tensor_list`` is read on ``root`` only (others may pass
        ``[]`` or ``None``)."""
        oview, code = _buffer(output_tensor)
        ins = None
        nbytes = len(oview)
        if self.get_rank() == root:
            ins, icode = _buffers(input_tensor_list or [])
            code = _same(code, icode, "input_tensor_list")
            nbytes = sum(len(v) for v in ins)
        return _finish(self._run(
            OpName.scatter, hints, ScatterPreHookArgs,
            lambda: self._on(hints).scatter(oview, ins, root, code, _seconds(timeout)),
            output=output_tensor, input=input_tensor_list, root=root, async_op=async_op,
            _data=(code, nbytes),
        ), async_op)

    def gather(self, output_tensor_list, input_tensor, root, async_op=False, hints=None, timeout=None):
        """``output_tensor_list`` is filled on ``root`` only."""
        iview, code = _buffer(input_tensor)
        outs = []
        if self.get_rank() == root:
            outs, ocode = _buffers(output_tensor_list)
            code = _same(code, ocode, "output_tensor_list")
        return _finish(self._run(
            OpName.gather, hints, GatherPreHookArgs,
            lambda: self._on(hints).gather(outs, iview, root, code, _seconds(timeout)),
            input=input_tensor, output=output_tensor_list, root=root, async_op=async_op,
            _data=(code, len(iview)),
        ), async_op)

    def gather_single(self, output, input, root, async_op=False, hints=None, timeout=None):  # noqa: A002
        iview, code = _buffer(input)
        oview, ocode = _buffer(output)
        code = _same(code, ocode, "output")
        return _finish(self._run(
            OpName.gather_single, hints, GatherSinglePreHookArgs,
            lambda: self._on(hints).gather_single(oview, iview, root, code, _seconds(timeout)),
            input=input, output=output, root=root, async_op=async_op, _data=(code, len(iview)),
        ), async_op)

    # -------------------------------------------------------------- p2p

    def send(self, tensor, dst, async_op=False, hints=None, timeout=None):
        view, code = _buffer(tensor)
        return _finish(self._run(
            OpName.send, hints, SendPreHookArgs,
            lambda: self._on(hints).send(view, dst, code, _seconds(timeout)),
            tensor=tensor, peer=dst, peers=[dst], async_op=async_op, _data=(code, len(view)),
        ), async_op)

    def recv(self, tensor, src, async_op=False, hints=None, timeout=None):
        view, code = _buffer(tensor)
        return _finish(self._run(
            OpName.recv, hints, RecvPreHookArgs,
            lambda: self._on(hints).recv(view, src, code, _seconds(timeout)),
            tensor=tensor, peer=src, peers=[src], async_op=async_op, _data=(code, len(view)),
        ), async_op)

    def batch_op_create(self):
        return BatchSendRecv(self)

    # -------------------------------------------------------------- persistent

    def all_gather_p_init(self, output, hints=None, timeout=None):
        """Set up a persistent all-gather into ``output`` (``size`` blocks of
        the per-rank count): the ranks agree on dtype and count once here
        (``MismatchError`` if they differ), and every
        :meth:`all_gather_p_exec` gathers into the same ``output``.
        Collective."""
        oview, code = _buffer(output)
        size = self.get_size()
        per_rank, rest = divmod(len(oview) // _itemsize(code), size)
        if rest:
            raise ValueError(f"the output's length is not a multiple of the {size} ranks")
        mine = array.array("q", [code, per_rank])
        rows = array.array("q", bytes(8 * 2 * size))
        self._on(hints).all_gather_single(
            memoryview(rows).cast("B"), memoryview(mine).cast("B"), _I64, _seconds(timeout)
        ).wait()
        for r in range(size):
            if rows[2 * r : 2 * r + 2] != mine:
                raise MismatchError(
                    f"all_gather_p_init on {self.get_name()!r}: rank {r} set up a persistent "
                    f"all_gather of another dtype or count than this rank's {per_rank} x "
                    f"{_dtype_name(code)}",
                    failed_ranks=[],
                    fatal=False,
                )
        return AllGatherPHandle(self, output, oview, code, per_rank)

    def all_gather_p_exec(self, handle, input, async_op=False, hints=None, timeout=None):  # noqa: A002
        """Gather every rank's ``input`` into the handle's output."""
        return handle._exec(self, input, async_op, hints, timeout)

    def all_gather_p_free(self, handle):
        """Release a persistent all-gather (local: no communication)."""
        handle._free()

    # -------------------------------------------------------------- windows

    def new_window(self, tensor=None, *, size=None, timeout=None):
        """A one-sided :class:`Window` (collective; ranks may pass different
        sizes). With ``tensor``, this rank's window has its size and dtype
        and starts with its contents, and :meth:`Window.get_tensor` copies
        the window back into it; else ``size`` bytes (zeroed)."""
        if tensor is not None and size is not None:
            raise ValueError("pass tensor or size, not both")
        code = _U8
        if tensor is not None:
            view, code = _buffer(tensor)
            size = len(view)
        elif size is None:
            raise ValueError("new_window needs a tensor or size= (bytes)")

        def run():
            win = Window(self, self._c.new_window(int(size), _seconds(timeout)), tensor, code)
            if tensor is not None and size:
                win._w.put(view, code, self.get_rank(), 0, _seconds(timeout)).wait()
            # Every rank's initial contents are in place before any rank can
            # put into a peer's window.
            self._c.barrier(_seconds(timeout)).wait()
            return win

        return self._lifecycle(
            OpName.new_window, None,
            (NewWindowPreHookArgs, {"tensor": tensor, "size": int(size), "async_op": False}),
            run, lambda win: NewWindowPostHookArgs(new_window=win),
        )


# TorchComms' class name.
TorchComm = Comm


# Per process: the job secret and store address this process's rank 0
# publishes through a torch.distributed Store (one store server per process,
# which outlives communicators, so every communicator it hosts has the same).
_HOSTED = {}


def _rendezvous_through(store, name, rank, size, secret):
    """Find Chorus's store through a ``torch.distributed`` ``Store`` (any
    object with its ``set(key, value)`` and blocking ``get(key)``): rank 0
    publishes the address of the QUIC store it hosts and the job secret
    under ``chorus/<name>/rendezvous``; every other rank reads them.
    Returns ``(address, secret, host_store)`` for the native ``new_comm``."""
    if not (callable(getattr(store, "set", None)) and callable(getattr(store, "get", None))):
        raise TypeError(
            "store must be None, the \"host:port\" of a chorus-rendezvous, or a "
            f"torch.distributed Store (with set and get), not {type(store).__name__}"
        )
    me, _ = _chorus.rank_size(rank, size)
    key = f"chorus/{name}/rendezvous"
    if me == 0:
        if not _HOSTED:
            host, port = _store_host_port()
            _HOSTED["addr"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            # The job's secret when it has one (so that communicators created
            # without a torch store reach the same store), else a fresh one.
            _HOSTED["secret"] = os.environ.get("CHORUS_SECRET") or secrets.token_hex(32)
        # A secret the caller gave is not published: every rank must pass it.
        value = f"{_HOSTED['addr']} {'-' if secret else _HOSTED['secret']}"
        store.set(key, value.encode())
    else:
        raw = store.get(key)
        value = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    addr, _, published = value.partition(" ")
    if not published:
        raise ConfigError(f"malformed Chorus rendezvous record under {key!r} in the torch store")
    if secret is None and published == "-":
        raise ConfigError(
            "rank 0 passed its own secret to new_comm, so every rank must pass it too"
        )
    return addr, (secret if secret is not None else published), True


def _store_host_port():
    """Where this process hosts Chorus's store for communicators found
    through a torch store: the job's rank 0 (``RANK`` 0 or unset) on
    ``MASTER_ADDR``/``MASTER_PORT`` when both are set (the UDP port beside
    torch's TCP store, as ``chorus.run`` and torchrun leave free); any other
    process (rank 0 of a subgroup) on the address it reaches ``MASTER_ADDR``
    from (the loopback address when that is local) and a free UDP port, so
    that group leaders on one host never race for one port."""
    master = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not master:
        return "127.0.0.1", _free_udp_port("127.0.0.1")
    if port and os.environ.get("RANK", "0") == "0":
        return master, port
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((master, int(port or 9)))  # no datagram is sent
        host = s.getsockname()[0]
    return host, _free_udp_port(host)


def _free_udp_port(host):
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _torchrun_without_secret():
    """Whether this looks like a multi-rank torchrun launch with no secret."""
    if os.environ.get("CHORUS_SECRET"):
        return False
    if "CHORUS_STORE_ADDR" in os.environ:
        return False
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_PORT" in os.environ
    except ValueError:
        return False


def new_comm(
    backend,
    device,
    name,
    abort_process_on_timeout_or_error=None,
    timeout=None,
    high_priority_stream=None,
    store=None,
    enable_reconfigure=False,
    hints=None,
    *,
    connect_timeout=None,
    secret=None,
    rank=None,
    size=None,
    checks=None,
):
    """Create a communicator; every rank calls it with the same ``name``.

    ``backend``: ``"cpu"`` (built in; TCP and same-host shared memory), or
    another backend compiled into the extension. ``device``: ``"cpu"``,
    ``"cuda:N"`` or a ``torch.device``. ``timeout``: default timeout of every
    op (``timedelta`` or seconds; 10 minutes if ``None``).

    ``store``: ``None`` (from the environment: ``MASTER_ADDR``/``MASTER_PORT``,
    rank 0 hosting Chorus's QUIC store, or ``CHORUS_STORE_ADDR``), or the
    ``"host:port"`` of a running ``chorus-rendezvous``, or a
    ``torch.distributed`` ``Store`` (``TCPStore``, ``PrefixStore``, ...): rank 0
    then hosts Chorus's QUIC store (the job's rank 0 on
    ``MASTER_ADDR``/``MASTER_PORT`` when set, any other process on a free
    port of its own address) and publishes its address and the job secret
    (``CHORUS_SECRET``, else a fresh one) through that store, so no
    ``CHORUS_SECRET`` is needed; every rank must pass a store of the same
    job. ``abort_process_on_timeout_or_error``,
    ``hints``: a ``dict`` of strings carried by every op of the
    communicator (see :class:`Comm`); a malformed value of a known key is
    ``InvalidArgumentError``. ``high_priority_stream`` is accepted for
    compatibility and has no effect. ``enable_reconfigure=True`` raises
    ``NotSupportedError`` (a ``RuntimeError``), as TorchComms does for a
    backend without ``reconfigure(uuid, init_handles)``: every Chorus
    communicator can be reconfigured by quorum without it
    (:meth:`Comm.reconfigure`).

    Chorus only (keywords): ``connect_timeout`` (bootstrap, 120 s),
    ``secret`` (else ``CHORUS_SECRET``), ``rank`` and ``size`` (else the
    environment), ``checks``: how the ranks' ops are checked against each
    other, ``"strict"``, ``"fingerprint"`` or ``"off"`` (else
    ``CHORUS_CHECKS``, else ``"fingerprint"``; see "Mismatches" in
    docs/runtime-semantics.md).
    """
    if abort_process_on_timeout_or_error:
        raise ValueError(
            "abort_process_on_timeout_or_error=True is not supported: Chorus fails the ops "
            "with a typed error and aborts the communicator, never the process"
        )
    if enable_reconfigure:
        raise NotSupportedError(
            "enable_reconfigure=True (for reconfigure(uuid, init_handles)) is not supported: "
            "every Chorus communicator can be reconfigured by quorum, "
            "reconfigure(timeout, min_size, wait_joiners), without it"
        )
    host_store = False
    if store is not None and not isinstance(store, str):
        store, secret, host_store = _rendezvous_through(store, name, rank, size, secret)
    if secret is None and _torchrun_without_secret():
        raise ConfigError(
            "no job secret: this looks like a torchrun launch (WORLD_SIZE="
            f"{os.environ.get('WORLD_SIZE')}, MASTER_PORT={os.environ.get('MASTER_PORT')}) "
            "without CHORUS_SECRET. Set the same secret on every node before torchrun, e.g. "
            "`export CHORUS_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')` "
            "(share that one value with every node), or launch with "
            "`python -m chorus.run -n N script.py`, which sets it for you"
        )
    native = _chorus.new_comm(
        backend,
        str(device),
        name,
        timeout=_seconds(timeout),
        connect_timeout=_seconds(connect_timeout),
        store=store,
        secret=secret,
        rank=rank,
        size=size,
        hints={str(k): str(v) for k, v in dict(hints or {}).items()},
        checks=checks,
        host_store=host_store,
    )
    return Comm(native)


def join_comm(backend, device, name, timeout=None, *, connect_timeout=None, store=None, secret=None):
    """Chorus only: join the running communicator ``name`` as a new rank.

    Registers for its next epoch and blocks until the survivors call
    ``reconfigure()`` with this rank admitted (at most ``connect_timeout``,
    120 s by default); returns the new epoch's communicator. The store is
    found as for :func:`new_comm`. Raises ``ExcludedError`` when no epoch
    admitted this rank in time.
    """
    if secret is None and _torchrun_without_secret():
        raise ConfigError("no job secret: set CHORUS_SECRET to the job's secret before join_comm")
    return Comm(
        _chorus.join_comm(
            backend,
            str(device),
            name,
            timeout=_seconds(timeout),
            connect_timeout=_seconds(connect_timeout),
            store=store,
            secret=secret,
        )
    )
