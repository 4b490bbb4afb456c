"""DLPack producers for the tests: NumPy arrays seen only through
``__dlpack__`` / ``__dlpack_device__`` (no buffer protocol), as an array of
another framework would be."""


class DLPackOnly:
    """``arr`` exposed only through DLPack.

    ``legacy``: behave like a producer from before DLPack 1.0, which rejects
    ``max_version`` and hands out a ``"dltensor"`` capsule.
    ``device``: what ``__dlpack_device__`` reports (default: the array's).
    ``calls`` counts the capsules handed out.
    """

    def __init__(self, arr, legacy=False, device=None):
        self.arr = arr
        self.legacy = legacy
        self.device = device
        self.calls = 0

    def __dlpack__(self, *, stream=None, **kw):
        if self.legacy and kw:
            raise TypeError(f"__dlpack__() got unexpected keyword arguments {sorted(kw)}")
        self.calls += 1
        return self.arr.__dlpack__(stream=stream, **kw)

    def __dlpack_device__(self):
        return self.device if self.device is not None else self.arr.__dlpack_device__()
