"""Exceptions raised by Chorus, one class per kind of ``chorus::Error``.

Every class derives from :class:`ChorusError`, a ``RuntimeError`` (what
TorchComms raises for a failed op, so ``except RuntimeError`` written for
TorchComms catches Chorus's errors too). Some also derive from the builtin
exception a Python caller would expect (``TimeoutError`` from
``builtins.TimeoutError``, ``InvalidArgumentError`` and
``UnknownBackendError`` from ``ValueError``), so ``except TimeoutError``
works with either name.

Attributes of every instance:

- ``failed_ranks``: ranks known to have failed (``PeerFailedError``,
  ``AbortedError``), else ``[]``;
- ``fatal``: whether the communicator can no longer be used.
"""

import builtins

__all__ = [
    "ChorusError",
    "UnknownBackendError",
    "BackendUnavailableError",
    "InvalidArgumentError",
    "MismatchError",
    "TimeoutError",
    "PeerFailedError",
    "StoreUnreachableError",
    "CorruptedError",
    "AbortedError",
    "FinalizedError",
    "UnsupportedOpError",
    "NotSupportedError",
    "NoQuorumError",
    "ExcludedError",
    "ConfigError",
    "TransportError",
    "InternalError",
]


class ChorusError(RuntimeError):
    """Base class of every error from a Chorus communicator."""

    def __init__(self, message, *, failed_ranks=(), fatal=False):
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)
        self.fatal = bool(fatal)


class UnknownBackendError(ChorusError, ValueError):
    """No backend of that name is built into this package."""


class BackendUnavailableError(ChorusError):
    """The backend exists but cannot run here (missing library, no device)."""


class InvalidArgumentError(ChorusError, ValueError):
    """Arguments that can never work (root out of range, sizes that do not
    add up...), found before any communication; the communicator stays usable."""


class MismatchError(ChorusError):
    """The ranks issued different ops, or the same op with different
    arguments (count, dtype, root, split sizes). Raised on every rank."""


class TimeoutError(ChorusError, builtins.TimeoutError):
    """The op did not complete within its timeout; the communicator is aborted."""


class PeerFailedError(ChorusError):
    """A peer died or reported a failure; ``failed_ranks`` names it."""


class StoreUnreachableError(ChorusError):
    """This rank lost the rendezvous store; it is alive, the store is not."""


class CorruptedError(ChorusError):
    """Bytes from a peer failed their checksum (``CHORUS_CHECKSUM=1``)."""


class AbortedError(ChorusError):
    """The communicator was aborted (by ``abort()`` or an earlier failure)."""


class FinalizedError(ChorusError):
    """The communicator was finalized."""


class UnsupportedOpError(ChorusError, ValueError):
    """The reduce op is not defined for the dtype (a bitwise op on floats)."""


class NotSupportedError(ChorusError):
    """The backend cannot do this (e.g. split on some vendor backends)."""


class NoQuorumError(ChorusError):
    """``reconfigure`` found too few survivors to form the next epoch."""


class ExcludedError(ChorusError):
    """This rank was left out of the next epoch."""


class ConfigError(ChorusError):
    """Bootstrap or configuration problem (environment, secret, address)."""


class TransportError(ChorusError):
    """The control plane (store, QUIC, authentication) failed."""


class InternalError(ChorusError):
    """A bug in Chorus; please report it."""
