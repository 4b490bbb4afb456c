"""NaN checks before ops (TorchComms' ``torchcomms.hooks.NanCheckHook``).

::

    from chorus.hooks import NanCheckHook

    NanCheckHook().register_with_comm(comm)
    comm.all_reduce(grad, chorus.ReduceOp.SUM)  # RuntimeError if grad holds a NaN

The check is a pre hook, so it runs on the calling thread before the op is
issued, and its ``RuntimeError`` reaches the caller with the op not issued
on this rank (the other ranks' ops then wait for it until their timeout, or
fail at once if they check too). Floating-point tensors only; an infinity
is not a NaN. Torch tensors go through ``torch.ops.c10d.check_for_nan`` where
torch has it (else ``torch.isnan``), NumPy arrays through ``numpy.isnan``.
"""

from .._hookargs import OpName

# Ops whose ``tensor`` is both input and output: checked as their input.
_INPLACE_OPS = frozenset({OpName.broadcast, OpName.all_reduce, OpName.reduce})


def _has_nan(tensor):
    """Whether a floating-point ``tensor`` holds a NaN (``False`` for other
    dtypes and for buffers that are neither torch tensors nor NumPy
    arrays)."""
    module = type(tensor).__module__
    if module.startswith("torch"):
        if not tensor.is_floating_point():
            return False
        import torch

        check = getattr(getattr(torch.ops, "c10d", None), "check_for_nan", None)
        if check is not None:
            try:
                check(tensor)
            except RuntimeError:
                return True
            return False
        return bool(torch.isnan(tensor).any())
    if module.startswith("numpy"):
        import numpy as np

        return tensor.dtype.kind == "f" and bool(np.isnan(tensor).any())
    return False


def _check(tensors, label, op_name, comm_name):
    for tensor in tensors:
        if tensor is not None and _has_nan(tensor):
            raise RuntimeError(
                f"NaN detected in {label} tensor for '{op_name}' on comm '{comm_name}'"
            )


class NanCheckHook:
    """A pre hook that raises ``RuntimeError`` ("NaN detected in input tensor
    for 'all_reduce' on comm 'main'") before an op whose tensors hold a NaN.

    Args:
        check_inputs: check the tensors an op sends (default ``True``).
        check_outputs: check the tensors it writes (default ``False``); an
            in-place op's tensor counts as its input.
    """

    def __init__(self, check_inputs=True, check_outputs=False):
        self._check_inputs = check_inputs
        self._check_outputs = check_outputs
        self._registered_count = 0

    def register_with_comm(self, comm):
        """Check every op issued on ``comm`` from now on. Returns the
        :class:`chorus.RemovableHandle` of the pre hook."""
        comm_name = comm.get_name()
        inputs, outputs = self._check_inputs, self._check_outputs

        def pre_hook(name, op_id, args):
            if name in _INPLACE_OPS:
                if inputs or outputs:
                    _check((args.tensor,), "input", name, comm_name)
                return
            ins, outs = args.tensors()
            if inputs:
                _check(ins, "input", name, comm_name)
            if outputs:
                _check(outs, "output", name, comm_name)

        handle = comm.register_pre_hook(pre_hook)
        self._registered_count += 1
        return handle

    def is_enabled(self):
        """Whether it was registered with any communicator."""
        return self._registered_count > 0
