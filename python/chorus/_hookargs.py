"""What hooks see: op names, the typed argument classes of pre and post
hooks (TorchComms' ``*PreHookArgs`` / ``*PostHookArgs``), and the handle
that removes a hook.

Owned here: the data model only. Where hooks run (the caller's thread for
pre hooks, before the op is issued; Chorus's hook path for post and abort
hooks) is :class:`chorus.Comm`'s business (``Comm._run``).
"""

import enum


class OpName(str, enum.Enum):
    """The name of an op (TorchComms' ``OpName``, with all of its names, and
    Chorus's window ops). A ``str``: ``name == "all_reduce"`` works. Pre
    hooks see the name of the method called (``all_gather_single``,
    ``reduce_scatter_v``, ``batch_op_issue``, ``split``, ``finalize``, ...).
    Post hooks see the op's Chorus kind (``all_gather_single`` and
    ``all_gather_v`` as ``all_gather``, a batch as ``batch_p2p``), except for
    ``split``, ``new_window`` and ``finalize``, which they see by name. A
    name not listed here arrives as a plain ``str``."""

    send = "send"
    recv = "recv"
    batch_p2p = "batch_p2p"
    batch_op_issue = "batch_op_issue"
    broadcast = "broadcast"
    all_reduce = "all_reduce"
    reduce = "reduce"
    all_gather = "all_gather"
    all_gather_single = "all_gather_single"
    all_gather_v = "all_gather_v"
    reduce_scatter = "reduce_scatter"
    reduce_scatter_single = "reduce_scatter_single"
    reduce_scatter_v = "reduce_scatter_v"
    all_to_all_single = "all_to_all_single"
    all_to_all_v_single = "all_to_all_v_single"
    all_to_all = "all_to_all"
    barrier = "barrier"
    scatter = "scatter"
    gather = "gather"
    gather_single = "gather_single"
    split = "split"
    finalize = "finalize"
    new_window = "new_window"
    free_window = "free_window"
    window_put = "window_put"
    window_signal = "window_signal"
    window_wait_signal = "window_wait_signal"
    window_read = "window_read"

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)


def _op_name(name):
    try:
        return OpName(name)
    except ValueError:
        return name


# The op id TorchComms gives finalize's hooks (finalize is not an op and
# takes no id of the sequence).
FINALIZE_OP_ID = 2**64 - 1


class _HookArgs:
    __slots__ = ("_d",)

    def __init__(self, d=None, **fields):
        self._d = dict(d or {}, **fields)

    def __getattr__(self, key):
        try:
            return self._d[key]
        except KeyError:
            raise AttributeError(key) from None

    def __repr__(self):
        shown = {k: v for k, v in self._d.items() if k not in ("tensor", "input", "output")}
        return f"{type(self).__name__}({shown!r})"


class PreHookArgs(_HookArgs):
    """What a pre hook sees, on the thread that called the op, before the op
    is issued. Every op's args have ``op_id``, ``name`` (an
    :class:`OpName`) and ``op`` (the same, as a ``str``), ``comm`` (its
    name), ``rank``, ``async_op``, ``tag`` (the ``"chorus.tag"`` hint),
    ``hints`` (the communicator's hints with the op's over them), ``dtype``
    (a Chorus dtype name, ``None`` without data), ``count`` and ``bytes``
    (this rank's input; for ``recv``, and ``scatter`` off the root, its
    output), ``root`` (rooted ops, else ``None``) and ``peers``
    (point-to-point, else ``[]``); the subclass of each op adds the fields
    TorchComms gives it, the caller's own tensors among them
    (``tensor``, or ``input`` and ``output``). A hook may read them; it must
    not resize them. ``tensors()`` gives ``(inputs, outputs)``: the tensors
    the op reads and those it writes (an in-place op's tensor is both),
    whatever its shape of arguments."""


def _listed(x):
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _tensors(args):
    """``(inputs, outputs)`` of the op ``args`` describes: the tensors it
    reads and those it writes (an in-place op's ``tensor`` is both; a send
    only reads, a receive only writes; a batch by the direction of each of
    its ops)."""
    d = args._d
    name = d.get("op")
    if name == "recv":
        return [], [d["tensor"]]
    if name == "batch_op_issue":
        ops = d.get("ops", [])
        return ([p.tensor for p in ops if p.type.name == "SEND"],
                [p.tensor for p in ops if p.type.name == "RECV"])
    if "tensor" in d:
        t = d["tensor"]
        if t is None:
            return [], []
        return ([t], []) if name in ("send", "window_put", "new_window") else ([t], [t])
    return _listed(d.get("input")), _listed(d.get("output"))


PreHookArgs.tensors = _tensors


class SendPreHookArgs(PreHookArgs):
    """``send``: ``tensor``, ``peer``."""


class RecvPreHookArgs(PreHookArgs):
    """``recv``: ``tensor`` (the output), ``peer``."""


class BroadcastPreHookArgs(PreHookArgs):
    """``broadcast``: ``tensor``, ``root``."""


class AllReducePreHookArgs(PreHookArgs):
    """``all_reduce``: ``tensor``, ``reduce_op``."""


class ReducePreHookArgs(PreHookArgs):
    """``reduce``: ``tensor``, ``root``, ``reduce_op``."""


class AllGatherPreHookArgs(PreHookArgs):
    """``all_gather``: ``input``, ``output`` (a list)."""


class AllGatherVPreHookArgs(PreHookArgs):
    """``all_gather_v``: ``input``, ``output`` (a list)."""


class AllGatherSinglePreHookArgs(PreHookArgs):
    """``all_gather_single``: ``input``, ``output``."""


class ReduceScatterPreHookArgs(PreHookArgs):
    """``reduce_scatter``: ``input`` (a list), ``output``, ``reduce_op``."""


class ReduceScatterVPreHookArgs(PreHookArgs):
    """``reduce_scatter_v``: ``input`` (a list), ``output``, ``reduce_op``."""


class ReduceScatterSinglePreHookArgs(PreHookArgs):
    """``reduce_scatter_single``: ``input``, ``output``, ``reduce_op``."""


class AllToAllSinglePreHookArgs(PreHookArgs):
    """``all_to_all_single``: ``input``, ``output``."""


class AllToAllVSinglePreHookArgs(PreHookArgs):
    """``all_to_all_v_single``: ``input``, ``output``,
    ``input_split_sizes``, ``output_split_sizes``."""


class AllToAllPreHookArgs(PreHookArgs):
    """``all_to_all``: ``input`` and ``output`` (lists)."""


class BarrierPreHookArgs(PreHookArgs):
    """``barrier``: no tensors."""


class ScatterPreHookArgs(PreHookArgs):
    """``scatter``: ``output``, ``input`` (a list, on the root), ``root``."""


class GatherPreHookArgs(PreHookArgs):
    """``gather``: ``input``, ``output`` (a list, on the root), ``root``."""


class GatherSinglePreHookArgs(PreHookArgs):
    """``gather_single``: ``input``, ``output``, ``root``."""


class BatchOpIssuePreHookArgs(PreHookArgs):
    """``batch_op_issue`` (a :class:`chorus.BatchSendRecv`'s ``issue``):
    ``num_ops``, ``ops`` (its :class:`chorus.P2POp` list)."""


class SplitPreHookArgs(PreHookArgs):
    """``split``: ``ranks``, ``name`` (of the new communicator; the op's name
    is ``split``, as ``op``)."""


class NewWindowPreHookArgs(PreHookArgs):
    """``new_window``: ``tensor`` (or ``None``), ``size`` (bytes)."""


class FinalizePreHookArgs(PreHookArgs):
    """``finalize``: nothing more (its ``op_id`` is ``2**64 - 1``, not one
    of the sequence, as in TorchComms)."""


class WindowPreHookArgs(PreHookArgs):
    """A window op (Chorus only: ``window_put``, ``window_signal``,
    ``window_wait_signal``): ``tensor`` (for a put, else ``None``) and the
    peer in ``peers``."""


class PostHookArgs(_HookArgs):
    """What a post hook sees, once the op completed and before waiting for
    it returns: ``op_id`` (the one its pre hook saw), ``op`` (the op's kind;
    ``name`` too, as an :class:`OpName`, for a one-argument hook), ``comm``,
    ``rank``, ``seq`` (its sequence number, ``None`` if it never ran),
    ``duration`` and ``run_duration`` (seconds from issue / from the start
    of its turn to completion), and ``error`` (the exception its work
    raises, or ``None``)."""


CollectivePostHookArgs = PostHookArgs
"""TorchComms' name of the post-hook args of an op with a work."""


class SplitPostHookArgs(PostHookArgs):
    """After ``split`` returned: ``new_comm`` (the new
    :class:`chorus.Comm`, ``None`` on a rank outside it)."""


class NewWindowPostHookArgs(PostHookArgs):
    """After ``new_window`` returned: ``new_window`` (the
    :class:`chorus.Window`)."""


class FinalizePostHookArgs(PostHookArgs):
    """After ``finalize`` returned (``op_id`` ``2**64 - 1``)."""


class AbortHookArgs(_HookArgs):
    """What an abort hook taking an argument sees: ``comm``, ``rank``,
    ``epoch`` and ``cause`` (the exception the outstanding ops fail with)."""


class RemovableHandle:
    """A registered hook (TorchComms' ``RemovableHandle``): ``remove()``
    unregisters it, once; later calls do nothing. Dropping the handle
    leaves the hook registered."""

    __slots__ = ("_remove",)

    def __init__(self, remove):
        self._remove = remove

    def remove(self):
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()

    def __repr__(self):
        state = "registered" if self._remove is not None else "removed"
        return f"RemovableHandle({state})"


PRE_HOOK_ARGS = (
    SendPreHookArgs,
    RecvPreHookArgs,
    BroadcastPreHookArgs,
    AllReducePreHookArgs,
    ReducePreHookArgs,
    AllGatherPreHookArgs,
    AllGatherVPreHookArgs,
    AllGatherSinglePreHookArgs,
    ReduceScatterPreHookArgs,
    ReduceScatterVPreHookArgs,
    ReduceScatterSinglePreHookArgs,
    AllToAllSinglePreHookArgs,
    AllToAllVSinglePreHookArgs,
    AllToAllPreHookArgs,
    BarrierPreHookArgs,
    ScatterPreHookArgs,
    GatherPreHookArgs,
    GatherSinglePreHookArgs,
    BatchOpIssuePreHookArgs,
    SplitPreHookArgs,
    NewWindowPreHookArgs,
    FinalizePreHookArgs,
    WindowPreHookArgs,
)

POST_HOOK_ARGS = (
    CollectivePostHookArgs,
    SplitPostHookArgs,
    NewWindowPostHookArgs,
    FinalizePostHookArgs,
)
