"""A log of op signatures (TorchComms' ``torchcomms.hooks.clog``).

::

    from chorus.hooks import clog

    logger = clog(output="/tmp/clog.log", events=["ALL"])
    logger.register_with_comm(comm)

The log is TorchComms' pipe-delimited format, version 1, one line per
event, written and flushed as it happens:

- ``V|1|base_timestamp=<seconds since the epoch>``: the first line;
- ``new_comm|comm=<name>|rank=<r>|world_size=<n>`` when a communicator is
  registered, ``split|parent=<name>|child=<name>|ranks=<r,...>`` when it
  splits (the child is then logged too);
- ``C<id>|sig|<op>|in_count=...|dtype=f32|red_op=sum|async_op=f|comm=<name>``:
  each distinct op signature once, under a correlation id ``C<id>``;
- ``C<id>|Q|work_id=<w>|+<seconds since the base>`` each time an op of that
  signature is issued, and with ``events`` ``"ALL"`` or ``"LIFECYCLE"``,
  ``C<id>|S|+<t>`` and ``C<id>|E|+<t>`` when it started and ended (both
  written when it completes, ``S`` with the time its turn started);
- ``WARN|comm=<name>|leaked work_id=<w>|corr_id=<id>|pending_events=S,E``
  for ops still unfinished when the last registered communicator finalizes.

``verbose=["buffers"]`` adds the tensors' addresses to the signatures.
Differences from TorchComms': no ``W`` (wait) events, as Chorus's works
have no wait hooks, and no CUDA-graph lines (``G<id>|...``). Memory: one
entry per distinct signature, plus one per op issued and not yet completed.
"""

import threading
import time

from .._hookargs import OpName

_DTYPES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int32": "i32",
    "int64": "i64",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "bool",
    "float8_e4m3fn": "fp8e4m3",
    "float8_e5m2": "fp8e5m2",
}
_RED_OPS = {
    "SUM": "sum",
    "PRODUCT": "prod",
    "MIN": "min",
    "MAX": "max",
    "BAND": "band",
    "BOR": "bor",
    "BXOR": "bxor",
    "PREMUL_SUM": "premul_sum",
    "AVG": "avg",
}


def _dtype(t):
    dtype = getattr(t, "dtype", None)
    return _DTYPES.get(str(dtype).removeprefix("torch."), "other") if dtype is not None else "u8"


def _numel(t):
    numel = getattr(t, "numel", None)
    if callable(numel):
        return int(numel())
    size = getattr(t, "size", None)
    if isinstance(size, int):
        return size
    mv = memoryview(t)
    return mv.nbytes // mv.itemsize


def _ptr(t):
    data_ptr = getattr(t, "data_ptr", None)
    if callable(data_ptr):
        return hex(data_ptr())
    iface = getattr(t, "__array_interface__", None)
    if iface is not None:
        return hex(iface["data"][0])
    return "0x0"


def _counts(ts):
    return ",".join(str(_numel(t)) for t in ts or [])


def _ptrs(ts):
    return ",".join(_ptr(t) for t in ts or [])


def _tf(b):
    return "t" if b else "f"


def _red(op):
    return _RED_OPS.get(op.type.name, "unknown")


def signature(op, args, buffers=False):
    """TorchComms' signature of one op (``SignatureBuilder``), without the
    ``|comm=`` suffix; ``None`` for events that have none."""
    a = args._d
    asy = _tf(a.get("async_op"))
    if op in (OpName.all_reduce, OpName.broadcast, OpName.reduce):
        t = a["tensor"]
        n = _numel(t)
        sig = f"{op}|in_count={n}|out_count={n}|dtype={_dtype(t)}"
        if op != OpName.broadcast:
            sig += f"|red_op={_red(a['reduce_op'])}"
        if op != OpName.all_reduce:
            sig += f"|root={a['root']}"
        sig += f"|async_op={asy}"
        return sig + (f"|buf={_ptr(t)}" if buffers else "")
    if op in (OpName.send, OpName.recv):
        t = a["tensor"]
        n = _numel(t)
        counts = f"in_count={n}|out_count=0" if op == OpName.send else f"in_count=0|out_count={n}"
        sig = f"{op}|{counts}|dtype={_dtype(t)}|peer={a['peer']}|async_op={asy}"
        side = "in" if op == OpName.send else "out"
        return sig + (f"|{side}={_ptr(t)}" if buffers else "")
    if op in (OpName.all_gather_single, OpName.all_to_all_single, OpName.reduce_scatter_single,
              OpName.gather_single):
        i, o = a["input"], a["output"]
        sig = f"{op}|in_count={_numel(i)}|out_count={_numel(o)}|dtype={_dtype(i)}"
        if op == OpName.reduce_scatter_single:
            sig += f"|red_op={_red(a['reduce_op'])}"
        if op == OpName.gather_single:
            sig += f"|root={a['root']}"
        sig += f"|async_op={asy}"
        return sig + (f"|in={_ptr(i)}|out={_ptr(o)}" if buffers else "")
    if op == OpName.all_to_all_v_single:
        i, o = a["input"], a["output"]
        ins = ",".join(str(int(x)) for x in a["input_split_sizes"])
        outs = ",".join(str(int(x)) for x in a["output_split_sizes"])
        sig = f"{op}|in_splits={ins}|out_splits={outs}|dtype={_dtype(i)}|async_op={asy}"
        return sig + (f"|in={_ptr(i)}|out={_ptr(o)}" if buffers else "")
    if op in (OpName.all_gather, OpName.all_gather_v, OpName.gather):
        i, outs = a["input"], a["output"] or []
        sig = f"{op}|in_count={_numel(i)}|out_counts={_counts(outs)}|dtype={_dtype(i)}"
        if op == OpName.gather:
            sig += f"|root={a['root']}"
        sig += f"|async_op={asy}"
        return sig + (f"|in={_ptr(i)}|out={_ptrs(outs)}" if buffers else "")
    if op in (OpName.reduce_scatter, OpName.reduce_scatter_v, OpName.scatter):
        ins, o = a["input"] or [], a["output"]
        sig = f"{op}|in_counts={_counts(ins)}|out_count={_numel(o)}|dtype={_dtype(o)}"
        if op == OpName.scatter:
            sig += f"|root={a['root']}"
        else:
            sig += f"|red_op={_red(a['reduce_op'])}"
        sig += f"|async_op={asy}"
        return sig + (f"|in={_ptrs(ins)}|out={_ptr(o)}" if buffers else "")
    if op == OpName.all_to_all:
        ins, outs = a["input"] or [], a["output"] or []
        if not ins:
            return None
        sig = (f"{op}|in_counts={_counts(ins)}|out_counts={_counts(outs)}|dtype={_dtype(ins[0])}"
               f"|async_op={asy}")
        return sig + (f"|in={_ptrs(ins)}|out={_ptrs(outs)}" if buffers else "")
    if op == OpName.barrier:
        return f"{op}|async_op={asy}"
    if op == OpName.batch_op_issue:
        return f"{op}|num_ops={a['num_ops']}|async_op={asy}"
    return None


class clog:  # noqa: N801 (TorchComms' name)
    """Logs the ops of the communicators it is registered with.

    Args:
        output: the log file (truncated).
        events: ``["ALL"]`` or ``["LIFECYCLE"]`` for start and end events
            besides the signatures and issues; anything else logs those only.
        verbose: ``["buffers"]`` adds the tensors' addresses.
    """

    def __init__(self, output, events, verbose=()):
        self._lifecycle = any(e in ("ALL", "LIFECYCLE") for e in events)
        self._buffers = "buffers" in verbose
        self._lock = threading.Lock()
        self._file = open(output, "w", encoding="utf-8")  # noqa: SIM115 - lives with the hook
        self._base = time.time()
        self._sigs = {}  # signature -> correlation id
        self._pending = {}  # op id -> [work id, corr id, comm]
        self._next_work = 0
        self._comms = []
        self._active = 0
        self._write(f"V|1|base_timestamp={self._base:.3f}")

    def _write(self, line):
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def _event(self, corr, event, at=None):
        self._write(f"C{corr}|{event}|+{(at if at is not None else time.time()) - self._base:.3f}")

    def register_with_comm(self, comm):
        """Log ``comm``'s ops (and those of the communicators split from it)
        from now on. Registering one communicator twice is ``RuntimeError``."""
        self._write(f"new_comm|comm={comm.get_name()}|rank={comm.get_rank()}"
                    f"|world_size={comm.get_size()}")
        self._register(comm)

    def _register(self, comm):
        with self._lock:
            if any(c is comm for c in self._comms):
                raise RuntimeError(f"clog: already registered with comm {comm.get_name()}")
            self._comms.append(comm)
            self._active += 1
        name = comm.get_name()

        def pre(op, op_id, args):
            if op == OpName.split:
                ranks = ",".join(str(r) for r in args.ranks)
                self._write(f"split|parent={name}|child={args.name}|ranks={ranks}")
                return
            sig = signature(op, args, self._buffers)
            if sig is None:
                return
            sig += f"|comm={name}"
            with self._lock:
                corr = self._sigs.get(sig)
                new = corr is None
                if new:
                    corr = self._sigs[sig] = len(self._sigs)
                work = self._next_work
                self._next_work += 1
                self._pending[op_id] = [work, corr, name]
            if new:
                self._write(f"C{corr}|sig|{sig}")
            self._event(corr, f"Q|work_id={work}")

        def post(op_id, args):
            child = args._d.get("new_comm")
            if args._d.get("op") == OpName.split:
                if child is not None:
                    self._register(child)
                return
            if args._d.get("op") == OpName.finalize:
                self._finalized()
                return
            with self._lock:
                entry = self._pending.pop(op_id, None)
            # Ops Chorus issues inside split, new_window and
            # all_gather_p_init have no pre call here: nothing to log.
            if entry is None or not self._lifecycle:
                return
            now = time.time()
            run = getattr(args, "run_duration", None)
            self._event(entry[1], "S", now - run if run is not None else now)
            self._event(entry[1], "E", now)

        comm.register_pre_hook(pre)
        comm.register_post_hook(post)

    def _finalized(self):
        with self._lock:
            self._active -= 1
            last = self._active == 0
            leaked = list(self._pending.values()) if last else []
        for work, corr, comm in leaked:
            events = "S,E" if self._lifecycle else ""
            self._write(f"WARN|comm={comm}|leaked work_id={work}|corr_id={corr}"
                        f"|pending_events={events}")
