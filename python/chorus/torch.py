"""Chorus as a ``torch.distributed`` backend.

::

    import torch.distributed as dist
    import chorus.torch  # registers the "chorus" backend

    dist.init_process_group("chorus")  # env:// under torchrun or chorus.run
    model = torch.nn.parallel.DistributedDataParallel(model)

Importing this module registers ``"chorus"`` with
``torch.distributed.Backend.register_backend`` for CPU tensors. Every process
group torch creates with it (``init_process_group``, ``new_group``,
``init_device_mesh(..., backend="chorus")`` where torch passes a backend
through) runs its collectives and point-to-point ops on a Chorus
communicator of its own, found through the group's torch store (rank 0 of
the group hosts Chorus's QUIC store and publishes its address and a fresh job
secret there; see ``new_comm(store=...)``). For CUDA tensors, name another
backend per device: ``init_process_group("cpu:chorus,cuda:nccl")``.

This module owns the adapter only: :class:`ChorusBackend` (a c10d
``Backend`` over a :class:`chorus.Comm`, TorchComms' ``_BackendWrapper``) and
:class:`ChorusWork` (a c10d ``Work`` over Chorus's work handles). Costs: one
``Work`` object per op; a future (``get_future``, as DDP uses) is completed
by one waiter thread per backend, started on first use, which waits on the
ops in issue order (Chorus completes them in that order), so a blocking op
never crosses a thread. Non-contiguous outputs go through a contiguous copy
that is copied back when the op completes; contiguous CPU tensors are used in
place.

Differences from ``gloo``: the ``tag`` of ``send``/``recv`` is carried as the
op's ``chorus.tag`` hint (hooks and the flight recorder see it), but messages
between two ranks match in the order they were issued, whatever their tags;
``recv`` from any source is not supported; an op's timeout is the group's
(``init_process_group(timeout=...)``) or the op's own, and ``Work.wait``'s
timeout argument is not used.
"""

import collections
import datetime
import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import Work as _C10dWork

import chorus

__all__ = ["BACKEND", "ChorusBackend", "ChorusWork", "create_backend"]

BACKEND = "chorus"
"""The name this module registers with ``torch.distributed``."""

_RED = dist.ReduceOp.RedOpType


def _seconds(timeout):
    """An op's ``opts.timeout`` as seconds, or ``None`` when unset (c10d's
    unset timeout is negative)."""
    if timeout is None:
        return None
    secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return secs if secs > 0 else None


def _reduce_op(rop, tensor):
    """A c10d ``ReduceOp`` as a :class:`chorus.ReduceOp`."""
    kind = rop.op if hasattr(rop, "op") else rop
    if tensor.is_complex() and kind not in (_RED.SUM, _RED.AVG, _RED.PREMUL_SUM):
        raise ValueError(f"ReduceOp.{kind.name} is not defined on complex tensors")
    if kind == _RED.PREMUL_SUM:
        return chorus.ReduceOp.PREMUL_SUM(rop.factor)
    return getattr(chorus.ReduceOp, kind.name)


class _Staged:
    """A tensor as a C-contiguous real buffer for a Chorus op: ``buf`` is the
    tensor itself when it is contiguous and real (no copy), else a
    contiguous copy (complex tensors as pairs of reals); for an output,
    :meth:`finish` copies the result back."""

    __slots__ = ("tensor", "buf", "_copied")

    def __init__(self, tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(
                f"the chorus torch.distributed backend takes CPU tensors, got one on "
                f"{tensor.device}; name a device backend for it, e.g. "
                "init_process_group('cpu:chorus,cuda:nccl')"
            )
        self.tensor = tensor
        dense = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._copied = dense is not tensor
        self.buf = torch.view_as_real(dense) if dense.is_complex() else dense

    def finish(self):
        if self._copied:
            src = torch.view_as_complex(self.buf) if self.tensor.is_complex() else self.buf
            self.tensor.copy_(src)


def _stage(tensors):
    return [_Staged(t) for t in tensors]


class _Failed:
    """A failed op's error as a future's value: torch's Python futures keep
    ``set_exception`` in Python, so C++ readers would see a success;
    :func:`_unwrap` raises it inside a ``then`` callback, which fails the
    chained future in C++."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


def _unwrap(fut):
    value = fut.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class ChorusWork(_C10dWork):
    """A c10d ``Work`` over the Chorus work handles of one c10d op (one per
    tensor for the multi-tensor forms). ``wait()`` blocks until they have
    all finished and copies staged outputs back; ``get_future()`` returns a
    ``torch.futures.Future`` completed with ``result()`` (the op's output
    tensors) when they have, or with the op's error."""

    def __init__(self, backend, works, outputs, staged=()):
        super().__init__()
        self._backend = backend
        self._works = list(works)
        self._outputs = list(outputs)
        self._staged = list(staged)
        self._lock = threading.Lock()
        self._done = False
        self._error = None
        self._future = None
        self._chained = None

    def _settle(self):
        """Wait for the Chorus works once (any thread); later calls return
        what the first found."""
        with self._lock:
            if not self._done:
                try:
                    for w in self._works:
                        w.wait()
                    for s in self._staged:
                        s.finish()
                except Exception as e:  # noqa: BLE001 (kept for every waiter)
                    # (A KeyboardInterrupt leaves the op pending: a later
                    # wait resumes, as for chorus.Work.)
                    self._error = e
                self._done = True
                self._works = []
        return self._error

    def wait(self, timeout=None):
        error = self._settle()
        if error is not None:
            raise error
        return True

    def is_completed(self):
        if self._done:
            return True
        if all(w.is_completed() for w in self._works):
            self._settle()
            return True
        return False

    def is_success(self):
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error if self._done else None

    def result(self):
        return self._outputs

    def synchronize(self):
        """Host memory only: nothing to order against a stream."""

    def get_future(self):
        """A future completed with :meth:`result` when the op has finished,
        failed (in C++ too, where DDP reads it) when the op has failed."""
        with self._lock:
            if self._future is not None:
                return self._chained
            self._future = torch.futures.Future()
            self._chained = self._future.then(_unwrap)
            pending = not self._done
        if pending:
            self._backend._waiter().put(self)
        else:
            self._complete_future()
        return self._chained

    def _complete_future(self):
        error = self._settle()
        fut = self._future
        if fut is None or fut.done():
            return
        fut.set_result(_Failed(error) if error is not None else self._outputs)


# How long shutdown and abort wait for the future callbacks still running.
_WAITER_JOIN_S = 60.0


class _Waiter:
    """One daemon thread completing the futures of one backend's works, in
    issue order. O(outstanding works with a future) memory."""

    def __init__(self, name):
        self._cond = threading.Condition()
        self._queue = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"chorus-futures-{name}", daemon=True)
        self._thread.start()

    def put(self, work):
        with self._cond:
            if not self._closed:
                self._queue.append(work)
                self._cond.notify()
                return
        # Closed (the backend shut down): complete it here.
        work._complete_future()

    def close(self):
        """Stop taking works: the thread completes those queued, then ends."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def join(self, timeout):
        """Wait (at most ``timeout`` seconds) until every queued future was
        completed, so that no future callback runs after the backend shut
        down (or while the interpreter exits: its thread is a daemon)."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self):
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                work = self._queue.popleft()
            work._complete_future()


class ChorusBackend(_C10dBackend):
    """A c10d ``Backend`` whose every op runs on one :class:`chorus.Comm`
    (TorchComms' ``_BackendWrapper``). ``store``: the group's torch store,
    used only by :meth:`monitored_barrier` (``None``: it falls back to a
    barrier with the timeout)."""

    def __init__(self, comm, store=None):
        super().__init__(comm.get_rank(), comm.get_size())
        self._comm = comm
        self._store = store
        self._waiter_thread = None
        self._waiter_lock = threading.Lock()
        self._barriers = 0
        # Inside a coalescing block: the ops' (works, outputs, staged), and
        # the point-to-point ops, held back to go out as one batch.
        self._coalesced = None
        self._batch = None

    # ------------------------------------------------------------ plumbing

    @property
    def comm(self):
        """The :class:`chorus.Comm` this backend runs on."""
        return self._comm

    def _waiter(self):
        with self._waiter_lock:
            if self._waiter_thread is None:
                self._waiter_thread = _Waiter(self._comm.get_name())
            return self._waiter_thread

    def _each(self, outputs, inputs, opts, issue):
        """One Chorus op per (output, input) pair, ``issue(staged_output,
        input, timeout)``, as one c10d ``Work``."""
        t = _seconds(opts.timeout)
        staged = _stage(outputs)
        works = [issue(o, i, t) for o, i in zip(staged, inputs, strict=True)]
        return self._work(works, outputs, staged, opts=opts)

    def _work(self, works, outputs, staged=(), opts=None):
        """The c10d ``Work`` of an op; inside a coalescing block, the op's
        works join the block's instead (``end_coalescing`` returns one
        ``Work`` for them all)."""
        if self._coalesced is not None:
            self._coalesced.append((works, outputs, staged))
            return ChorusWork(self, [], outputs)
        return ChorusWork(self, works, outputs, staged)

    @property
    def supports_coalescing(self):
        """NCCL-style coalescing: ``batch_isend_irecv`` and
        ``_coalescing_manager(device=...)`` open a block with
        :meth:`start_coalescing`. (Defined here: the inherited property would
        look itself up through the Python override and recurse.)"""
        return True

    # c10d's capability properties call back into Python by their own name,
    # so each one a Python backend inherits recurses: answer them here.

    @property
    def supports_splitting(self):
        """``split_group`` is not supported (``new_group`` is)."""
        return False

    @property
    def supports_shrinking(self):
        return False

    @property
    def supports_reconfigure(self):
        """Chorus's reconfigure is on :attr:`comm`, not through c10d."""
        return False

    @property
    def supports_window(self):
        return False

    @property
    def _supports_time_estimate(self):
        return False

    @property
    def options(self):
        return _C10dBackend.Options(BACKEND, self._comm.get_timeout())

    def start_coalescing(self):
        """Open a coalescing block: collectives still go out at once (Chorus
        runs them in issue order); sends and receives wait for
        :meth:`end_coalescing` and go out as one batch, so a ring of sends
        and receives cannot deadlock on ranks that each send first."""
        if self._coalesced is not None:
            raise chorus.InvalidArgumentError("start_coalescing inside a coalescing block")
        self._coalesced, self._batch = [], []

    def end_coalescing(self):
        """Close the block: issue its sends and receives as one batch and
        return one ``Work`` for every op of the block."""
        if self._coalesced is None:
            raise chorus.InvalidArgumentError("end_coalescing without start_coalescing")
        parts, batch = self._coalesced, self._batch
        self._coalesced = self._batch = None
        works, outputs, staged = [], [], []
        if batch:
            b = self._comm.batch_op_create()
            for kind, st, peer in batch:
                (b.send if kind == "send" else b.recv)(st.buf, peer)
                outputs.append(st.tensor)
                if kind == "recv":
                    staged.append(st)
            works.append(b.issue(async_op=True))
        for w, o, st in parts:
            works += w
            outputs += o
            staged += st
        return ChorusWork(self, works, outputs, staged)

    def getBackendName(self):  # noqa: N802 (c10d's name)
        return BACKEND

    def name(self):
        return BACKEND

    # ------------------------------------------------------------ collectives

    def allreduce(self, tensors, opts):
        staged = _stage(tensors)
        t = _seconds(opts.timeout)
        works = [
            self._comm.all_reduce(s.buf, _reduce_op(opts.reduceOp, s.tensor), True, timeout=t)
            for s in staged
        ]
        return self._work(works, tensors, staged, opts=opts)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        staged = _stage(tensors)
        t = _seconds(opts.timeout)
        works = [self._comm.broadcast(s.buf, opts.rootRank, True, timeout=t) for s in staged]
        return self._work(works, tensors, staged, opts=opts)

    def reduce(self, tensors, opts):
        staged = _stage(tensors)
        t = _seconds(opts.timeout)
        works = [
            self._comm.reduce(s.buf, opts.rootRank, _reduce_op(opts.reduceOp, s.tensor), True, timeout=t)
            for s in staged
        ]
        return self._work(works, tensors, staged, opts=opts)

    def allgather(self, output_lists, inputs, opts):
        t = _seconds(opts.timeout)
        works, staged = [], []
        for outs, inp in zip(output_lists, inputs, strict=True):
            o = _stage(outs)
            staged += o
            even = all(x.tensor.numel() == inp.numel() for x in o)
            gather = self._comm.all_gather if even else self._comm.all_gather_v
            works.append(gather([x.buf for x in o], _Staged(inp).buf, True, timeout=t))
        return self._work(works, output_lists, staged, opts=opts)

    def _allgather_base(self, output, input, opts):  # noqa: A002
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        return self._each(
            outputs,
            inputs,
            opts,
            lambda o, i, t: self._comm.all_gather_single(o.buf, _Staged(i).buf, True, timeout=t),
        )

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts):
        return self.allgather(output_lists, inputs, opts)

    def reduce_scatter(self, outputs, input_lists, opts):
        return self._each(
            outputs,
            input_lists,
            opts,
            lambda o, ins, t: self._comm.reduce_scatter_v(
                o.buf, [_Staged(x).buf for x in ins], _reduce_op(opts.reduceOp, o.tensor), True, timeout=t
            ),
        )

    def _reduce_scatter_base(self, output, input, opts):  # noqa: A002
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return self._each(
            outputs,
            inputs,
            opts,
            lambda o, i, t: self._comm.reduce_scatter_single(
                o.buf, _Staged(i).buf, _reduce_op(opts.reduceOp, o.tensor), True, timeout=t
            ),
        )

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):  # noqa: A002
        o = _Staged(output)
        i = _Staged(input)
        t = _seconds(opts.timeout)
        if not output_split_sizes and not input_split_sizes:
            w = self._comm.all_to_all_single(o.buf, i.buf, True, timeout=t)
        else:
            n = self._comm.get_size()
            outs = list(output_split_sizes) or [output.shape[0] // n] * n
            ins = list(input_split_sizes) or [input.shape[0] // n] * n
            w = self._comm.all_to_all_v_single(o.buf, i.buf, outs, ins, True, timeout=t)
        return self._work([w], [output], [o], opts=opts)

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts):
        staged = _stage(outputs)
        w = self._comm.all_to_all(
            [o.buf for o in staged], [_Staged(i).buf for i in inputs], True, timeout=_seconds(opts.timeout)
        )
        return self._work([w], outputs, staged, opts=opts)

    def barrier(self, opts):
        return self._work([self._comm.barrier(True, timeout=_seconds(opts.timeout))], [], opts=opts)

    def gather(self, output_lists, inputs, opts):
        root = opts.rootRank
        (inp,) = inputs
        staged = _stage(output_lists[0]) if self._comm.get_rank() == root else []
        w = self._comm.gather([o.buf for o in staged], _Staged(inp).buf, root, True, timeout=_seconds(opts.timeout))
        return self._work([w], output_lists, staged, opts=opts)

    def gather_into_tensor(self, output, input, opts):  # noqa: A002
        root = opts.rootRank
        o = _Staged(output) if self._comm.get_rank() == root else None
        w = self._comm.gather_single(
            o.buf if o else _Staged(output).buf,
            _Staged(input).buf,
            root,
            True,
            timeout=_seconds(opts.timeout),
        )
        return self._work([w], [output], [o] if o else [], opts=opts)

    gather_single = gather_into_tensor

    def scatter(self, outputs, input_lists, opts):
        root = opts.rootRank
        (out,) = _stage(outputs)
        ins = [_Staged(x).buf for x in input_lists[0]] if self._comm.get_rank() == root else None
        w = self._comm.scatter(out.buf, ins, root, True, timeout=_seconds(opts.timeout))
        return self._work([w], outputs, [out], opts=opts)

    # ------------------------------------------------------------ point to point

    def _hints(self, tag):
        return {"chorus.tag": str(tag)} if tag else None

    def send(self, tensors, dst, tag):
        if self._batch is not None:
            self._batch += [("send", _Staged(x), dst) for x in tensors]
            return ChorusWork(self, [], tensors)
        works = [self._comm.send(_Staged(x).buf, dst, True, hints=self._hints(tag)) for x in tensors]
        return self._work(works, tensors)

    def recv(self, tensors, src, tag):
        staged = _stage(tensors)
        if self._batch is not None:
            self._batch += [("recv", st, src) for st in staged]
            return ChorusWork(self, [], tensors)
        works = [self._comm.recv(s.buf, src, True, hints=self._hints(tag)) for s in staged]
        return self._work(works, tensors, staged)

    def recv_anysource(self, tensors, tag):
        raise chorus.NotSupportedError(
            "the chorus backend cannot receive from any source: pass the sender's rank"
        )

    # ------------------------------------------------------------ diagnostics

    def monitored_barrier(self, opts, wait_all_ranks=False):
        """gloo's ``monitored_barrier``: every rank reports to rank 0 through
        the group's store; rank 0 waits for each at most the timeout and
        raises naming the first rank (or, with ``wait_all_ranks``, every
        rank) that did not arrive; then it releases the others, which wait
        for that as long, and a barrier of the communicator ends it (rank 0
        may host the store: it leaves only once every rank read its
        release). Without a store (a wrapped communicator), a barrier with
        the timeout."""
        timeout = _seconds(opts.timeout) or self._comm.get_timeout().total_seconds()
        if self._store is None:
            self._comm.barrier(False, timeout=timeout)
            return
        self._barriers += 1
        prefix = f"chorus/monitored_barrier/{self._barriers}"
        me, n = self._comm.get_rank(), self._comm.get_size()
        deadline = datetime.timedelta(seconds=timeout)
        if me != 0:
            self._store.set(f"{prefix}/{me}", b"1")
            try:
                self._store.wait([f"{prefix}/done"], deadline)
            except Exception as e:  # noqa: BLE001 (the store's own error, reworded)
                raise chorus.TimeoutError(
                    f"rank {me}: rank 0 did not release monitored_barrier within {timeout:g} s "
                    f"(it timed out waiting for another rank, or is itself stuck): {e}"
                ) from e
            self._released(timeout)
            return
        start = datetime.datetime.now()
        missing = []
        for r in range(1, n):
            key = f"{prefix}/{r}"
            left = deadline - (datetime.datetime.now() - start)
            if missing:
                # After the deadline: only whether it is there already.
                if not self._store.check([key]):
                    missing.append(r)
                continue
            try:
                self._store.wait([key], max(left, datetime.timedelta(milliseconds=1)))
            except Exception:  # noqa: BLE001 (a timeout of the store's wait)
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            if wait_all_ranks:
                raise chorus.TimeoutError(
                    f"ranks {missing} failed to pass monitored_barrier within {timeout:g} s"
                )
            raise chorus.TimeoutError(
                f"rank {missing[0]} failed to pass monitored_barrier within {timeout:g} s"
            )
        for r in range(1, n):
            self._store.delete_key(f"{prefix}/{r}")
        self._store.set(f"{prefix}/done", b"1")
        self._released(timeout)

    def _released(self, timeout):
        """The last step of a monitored barrier that passed: a barrier of the
        communicator, so that rank 0, whose process may host the store,
        stays until every rank has read its release from it."""
        self._comm.barrier(False, timeout=timeout)

    # ------------------------------------------------------------ lifecycle

    def shutdown(self):
        """Finish the outstanding ops and close the communicator; returns
        once their futures are completed."""
        waiter = self._waiter_thread
        if waiter is not None:
            waiter.close()
        if not self._comm.is_aborted():
            self._comm.finalize()
        if waiter is not None:
            # Every op has ended: the futures left are completed at once
            # (the bound only covers a future callback that blocks).
            waiter.join(_WAITER_JOIN_S)

    def abort(self):
        """Fail the outstanding ops on every rank and close."""
        waiter = self._waiter_thread
        if waiter is not None:
            waiter.close()
        self._comm.abort("aborted through torch.distributed")
        if waiter is not None:
            waiter.join(_WAITER_JOIN_S)


def create_backend(dist_opts, backend_options=None):
    """The creator ``register_backend`` calls (extended API): a Chorus
    ``cpu`` communicator named ``torch-<group name>`` (``/`` as ``_``) for the group's ranks,
    found through the group's store, with the group's timeout."""
    comm = chorus.new_comm(
        "cpu",
        "cpu",
        "torch-" + str(dist_opts.group_id).replace("/", "_"),
        timeout=dist_opts.timeout,
        store=dist_opts.store,
        rank=dist_opts.group_rank,
        size=dist_opts.group_size,
    )
    return ChorusBackend(comm, dist_opts.store)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, create_backend, extended_api=True, devices=["cpu"])
