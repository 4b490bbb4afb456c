"""A flight recorder over hooks (TorchComms' ``torchcomms.hooks.FlightRecorderHook``).

::

    from chorus.hooks import FlightRecorderHook

    recorder = FlightRecorderHook(max_entries=1024)
    recorder.register_with_comm(comm)
    ...
    trace = recorder.dump_json()          # JSON text
    recorder.dump_file(comm.get_rank())   # pickle, as torch's flight recorder writes

Its traces are in PyTorch's flight-recorder format (version ``"2.10"``:
``pg_config``, ``pg_status`` and ``entries`` with ``record_id``,
``process_group``, ``collective_seq_id``, ``p2p_seq_id``, ``op_id``,
``profiling_name`` such as ``"cpu:all_reduce"``, tensor sizes and dtypes,
``state``, ``duration_ms``, ...), so ``torch.distributed.flight_recorder``'s
analyzer (``fr_trace``) reads the traces of every rank together.

An entry is recorded by the op's pre hook (state ``"scheduled"``, with the
sizes and dtypes of its tensors) and retired by its post hook (state
``"completed"``, ``duration_ms`` from issue to completion; an op that failed
is retired too). Chorus's own recorder (:meth:`chorus.Comm.flight_record`)
keeps running beside it; this one is for tools that read PyTorch's format.

Sends and receives are named as PyTorch names them (``"cpu:send 0->1"``,
``"cpu:recv 1<-0"``), each op of a batch gets an entry of its own, and
``gather_single`` is recorded as ``gather``; ``split`` and ``new_window``
are recorded (as TorchComms does), window ops and ``finalize`` are not.

Memory: at most ``max_entries`` entries, each O(number of tensors of its
op); the index from op id to entries holds only those entries.
"""

import collections
import json
import os
import pickle
import threading
import time

from .._hookargs import OpName

VERSION = "2.10"

# c10's dtype names, as PyTorch's flight recorder writes them.
_C10_DTYPES = {
    "float16": "Half",
    "bfloat16": "BFloat16",
    "float32": "Float",
    "float64": "Double",
    "int8": "Char",
    "uint8": "Byte",
    "int16": "Short",
    "uint16": "UInt16",
    "int32": "Int",
    "uint32": "UInt32",
    "int64": "Long",
    "uint64": "UInt64",
    "bool": "Bool",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
}

# Events with no entry: finalize (not an op of the sequence, as in
# TorchComms' recorder), and Chorus's window ops, which PyTorch's analyzer
# does not know. split and new_window are recorded, as TorchComms does.
_UNRECORDED = frozenset({
    OpName.finalize, OpName.window_put, OpName.window_signal,
    OpName.window_wait_signal, OpName.window_read,
})
# Names the analyzer reads under another.
_ANALYZER_NAMES = {OpName.gather_single: "gather"}


def _dtype_name(t):
    dtype = getattr(t, "dtype", None)
    if dtype is None:
        return "Byte"
    name = str(dtype).removeprefix("torch.")
    return _C10_DTYPES.get(name, name)


def _sizes(t):
    shape = getattr(t, "shape", None)
    if shape is not None:
        return [int(d) for d in shape]
    try:
        return [memoryview(t).nbytes]
    except TypeError:
        return []


def _p2p_name(desc, op, rank, peer):
    """PyTorch's profiling name of a send (``"cpu:send 0->1"``) or receive
    (``"cpu:recv 1<-0"``)."""
    if op == OpName.send:
        return f"{desc}:send {rank}->{peer}"
    return f"{desc}:recv {rank}<-{peer}"


class _Entry:
    __slots__ = ("record_id", "pg_id", "pg_name", "thread_name", "thread_id",
                 "collective_seq_id", "p2p_seq_id", "is_p2p", "op_id", "profiling_name",
                 "time_created_ns", "duration_ms", "input_sizes", "input_dtypes",
                 "output_sizes", "output_dtypes", "started_ns", "completed_ns", "retired",
                 "timeout_ms")

    def as_dict(self, missing):
        """The entry in the trace format; ``missing`` stands for a time not
        known (0 in JSON, ``None`` in the pickle, as PyTorch writes them)."""
        if self.completed_ns is not None:
            state = "completed"
        elif self.started_ns is not None:
            state = "started"
        else:
            state = "scheduled"
        d = {
            "record_id": self.record_id,
            "pg_id": self.pg_id,
            "process_group": list(self.pg_name),
            "thread_name": self.thread_name,
            "thread_id": self.thread_id,
            "collective_seq_id": self.collective_seq_id,
            "p2p_seq_id": self.p2p_seq_id,
            "op_id": self.op_id,
            "profiling_name": self.profiling_name,
            "time_created_ns": self.time_created_ns,
            "input_sizes": self.input_sizes,
            "input_dtypes": self.input_dtypes,
            "output_sizes": self.output_sizes,
            "output_dtypes": self.output_dtypes,
            "state": state,
            "time_discovered_started_ns": self.started_ns if self.started_ns else missing,
            "time_discovered_completed_ns": self.completed_ns if self.completed_ns else missing,
            "retired": self.retired,
            "timeout_ms": self.timeout_ms,
            "is_p2p": self.is_p2p,
        }
        if self.duration_ms is not None:
            d["duration_ms"] = self.duration_ms
        return d


class _Recorder:
    """The entries of one recorder: a ring of at most ``max_entries``, the
    per-group sequence counters and group configs. Thread-safe."""

    def __init__(self, max_entries):
        self.max_entries = int(max_entries)
        self.lock = threading.Lock()
        self.entries = collections.deque()
        self.by_op_id = {}
        self.next_id = 0  # record ids of this epoch (since the last reset)
        self.pg_ranks = {}  # (name, desc) -> [ranks]
        self.seq = {}  # pg_id -> [collective seq, p2p seq, last completed seq]
        self.rank = -1
        self.comm_lib_version = ""

    def record(self, pg_id, pg_name, op_id, profiling_name, is_p2p, inputs, outputs, timeout_ms):
        if self.max_entries <= 0:
            return
        e = _Entry()
        e.pg_id, e.pg_name, e.op_id, e.is_p2p = pg_id, pg_name, op_id, is_p2p
        e.profiling_name, e.timeout_ms = profiling_name, timeout_ms
        thread = threading.current_thread()
        e.thread_name, e.thread_id = thread.name, str(threading.get_ident())
        e.time_created_ns = time.time_ns()
        e.duration_ms = e.started_ns = e.completed_ns = None
        e.retired = False
        e.input_sizes = [_sizes(t) for t in inputs]
        e.input_dtypes = [_dtype_name(t) for t in inputs]
        e.output_sizes = [_sizes(t) for t in outputs]
        e.output_dtypes = [_dtype_name(t) for t in outputs]
        with self.lock:
            seq = self.seq.setdefault(pg_id, [0, 0, -1])
            if is_p2p:
                seq[1] += 1
            else:
                seq[0] += 1
            e.collective_seq_id, e.p2p_seq_id = seq[0], seq[1]
            e.record_id = self.next_id
            self.next_id += 1
            if len(self.entries) >= self.max_entries:
                old = self.entries.popleft()
                same = self.by_op_id.get(old.op_id)
                if same is not None:
                    same = [x for x in same if x is not old]
                    if same:
                        self.by_op_id[old.op_id] = same
                    else:
                        del self.by_op_id[old.op_id]
            self.entries.append(e)
            self.by_op_id.setdefault(op_id, []).append(e)

    def retire(self, op_id, duration_s, run_duration_s):
        now = time.time_ns()
        with self.lock:
            for e in self.by_op_id.pop(op_id, ()):
                e.retired = True
                e.completed_ns = now
                if run_duration_s is not None:
                    e.started_ns = now - int(run_duration_s * 1e9)
                e.duration_ms = float(duration_s) * 1e3
                seq = self.seq.get(e.pg_id)
                if seq is not None and not e.is_p2p:
                    seq[2] = max(seq[2], e.collective_seq_id)

    def reset(self):
        with self.lock:
            self.entries.clear()
            self.by_op_id.clear()
            self.next_id = 0

    def size(self):
        with self.lock:
            return self.next_id

    def trace(self, only_active, missing, status_as_str):
        with self.lock:
            entries = [e.as_dict(missing) for e in self.entries if not (only_active and e.retired)]
            pg_config = {
                name: {"name": name, "desc": desc, "ranks": "[" + ",".join(map(str, r)) + "]"}
                for (name, desc), r in self.pg_ranks.items()
            }
            conv = str if status_as_str else int
            pg_status = {
                str(pg): {
                    "last_enqueued_collective": conv(s[0]),
                    "last_started_collective": conv(s[2]),
                    "last_completed_collective": conv(s[2]),
                }
                for pg, s in self.seq.items()
            }
            return {
                "version": VERSION,
                "comm_lib_version": self.comm_lib_version,
                "pg_config": pg_config,
                "pg_status": pg_status,
            }, entries


_GLOBAL = None
_GLOBAL_LOCK = threading.Lock()


def _global_recorder(max_entries):
    global _GLOBAL
    with _GLOBAL_LOCK:
        if _GLOBAL is None:
            _GLOBAL = _Recorder(max_entries)
        return _GLOBAL


def _dump_path(rank):
    """Where ``dump_file`` writes, as TorchComms' ``DebugInfoWriter``:
    ``TORCHCOMM_FR_DUMP_TEMP_FILE`` itself when
    ``TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME`` is set, else that prefix (by
    default ``$XDG_CACHE_HOME/torch/comm_lib_trace_rank_``, or
    ``~/.cache/torch/...``) followed by the rank."""
    prefix = os.environ.get("TORCHCOMM_FR_DUMP_TEMP_FILE")
    if prefix and os.environ.get("TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME", "0") not in ("", "0"):
        return prefix
    if not prefix:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(
            os.environ.get("HOME", "/tmp"), ".cache"
        )
        os.makedirs(os.path.join(cache, "torch"), exist_ok=True)
        prefix = os.path.join(cache, "torch", "comm_lib_trace_rank_")
    return f"{prefix}{rank}"


class FlightRecorderHook:
    """Records the ops of the communicators it is registered with.

    Args:
        max_entries: the most entries kept (the oldest go first); 2048 by
            default, as in TorchComms.
        isolated: a recorder of its own; otherwise (the default) every
            non-isolated ``FlightRecorderHook`` of the process shares one, as
            TorchComms' do.
    """

    def __init__(self, max_entries=2048, isolated=False):
        self._recorder = _Recorder(max_entries) if isolated else _global_recorder(max_entries)
        self._registrations = []
        self._lock = threading.Lock()

    def register_with_comm(self, comm):
        """Record every op issued on ``comm`` from now on, and on the
        communicators split from it. When ``comm`` is aborted and
        ``TORCHCOMM_FR_DUMP_TEMP_FILE`` is set, the trace is written there
        (as :meth:`dump_file`) before its ops fail."""
        rec = self._recorder
        name, desc = comm.get_name(), comm.get_backend()
        pg_name = (name, desc)
        with self._lock:
            pg_id = len(self._registrations)
            self._registrations.append(comm)
        timeout_ms = max(1, int(comm.get_timeout().total_seconds() * 1000))
        rank = comm.get_rank()
        with rec.lock:
            rec.pg_ranks[pg_name] = list(range(comm.get_size()))
            rec.rank = rank
            rec.comm_lib_version = comm.get_backend_version()

        def pre(op, op_id, args):
            if op in _UNRECORDED:
                return
            if op == OpName.batch_op_issue:
                # One entry per send and receive, as PyTorch records a
                # coalesced group of point-to-point ops.
                for p in args.ops:
                    send = p.type.name == "SEND"
                    one = OpName.send if send else OpName.recv
                    t = [p.tensor]
                    rec.record(pg_id, pg_name, op_id, _p2p_name(desc, one, rank, p.peer), True,
                               t if send else [], t, timeout_ms)
                return
            if op in (OpName.send, OpName.recv):
                profiling = _p2p_name(desc, op, rank, args.peer)
            else:
                profiling = f"{desc}:{_ANALYZER_NAMES.get(op, op)}"
            inputs, outputs = args.tensors()
            if op == OpName.send:
                outputs = inputs  # as TorchComms' recorder lists a send
            rec.record(pg_id, pg_name, op_id, profiling, op in (OpName.send, OpName.recv),
                       inputs, outputs, timeout_ms)

        def post(op_id, args):
            rec.retire(op_id, getattr(args, "duration", 0.0) or 0.0,
                       getattr(args, "run_duration", None))
            child = args._d.get("new_comm")
            if child is not None:
                self.register_with_comm(child)

        def aborted():
            if os.environ.get("TORCHCOMM_FR_DUMP_TEMP_FILE"):
                self.dump_file(rank)

        comm.register_pre_hook(pre)
        comm.register_post_hook(post)
        comm.register_abort_hook(aborted)

    def dump_json(self, include_completed=True):
        """The trace as JSON text; without ``include_completed``, only the
        entries not yet completed."""
        head, entries = self._recorder.trace(not include_completed, 0, True)
        if entries:
            head["entries"] = entries
        return json.dumps(head)

    def dump_file(self, rank, include_completed=True):
        """Write the trace, pickled as PyTorch's recorder writes it, where
        ``TORCHCOMM_FR_DUMP_TEMP_FILE`` says (see TorchComms); returns the
        path."""
        head, entries = self._recorder.trace(not include_completed, None, False)
        head["entries"] = entries
        path = _dump_path(rank)
        with open(path, "wb") as f:
            pickle.dump(head, f)
        return path

    def reset(self):
        """Forget every entry so far (the sequence counters go on)."""
        self._recorder.reset()

    def is_enabled(self):
        """Whether it was registered with any communicator."""
        with self._lock:
            return bool(self._registrations)

    def size(self):
        """Entries recorded since it was made or last reset (also those the
        ring no longer holds)."""
        return self._recorder.size()
