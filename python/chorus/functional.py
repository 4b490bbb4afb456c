"""TorchComms' ``torchcomms.functional`` capability query.

TorchComms can trace its collectives into ``torch.compile`` graphs
(functional collectives, when ``TORCHCOMMS_PATCH_FOR_COMPILE=1``). Chorus's
ops cannot be traced: :func:`is_torch_compile_supported_and_enabled` is
always ``False``, so code (and TorchComms' test helpers) that asks takes
its eager path.
"""

__all__ = ["is_torch_compile_supported_and_enabled"]


def is_torch_compile_supported_and_enabled(min_version=None, _current_version=None):
    """Whether collectives can be compiled with ``torch.compile``: never, on
    Chorus."""
    return False
