"""Hooks that come with Chorus, with TorchComms' names (``torchcomms.hooks``):

- :class:`FlightRecorderHook`: records every op of the communicators it is
  registered with, in PyTorch's flight-recorder format (``dump_json``,
  ``dump_file``), which ``torch.distributed.flight_recorder``'s analyzer
  reads.
- :class:`NanCheckHook`: a pre hook that raises ``RuntimeError`` before an
  op whose floating-point tensors hold a NaN is issued.
- :class:`clog`: a log of op signatures and events in TorchComms'
  pipe-delimited format.

Both are built on :meth:`chorus.Comm.register_pre_hook` and
:meth:`chorus.Comm.register_post_hook`; each works with NumPy arrays and
CPU torch tensors.
"""

from .clog import clog
from .fr import FlightRecorderHook
from .nan_check import NanCheckHook

__all__ = ["FlightRecorderHook", "NanCheckHook", "clog"]
