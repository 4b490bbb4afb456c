#!/usr/bin/env python3
"""Raw speed of a single-copy read (process_vm_readv from another process)
against a local memcpy (numpy.copyto), per size, best of 3 runs of many
reads of the same (cache-warm) buffer. Needs numpy and a kernel that lets a
parent read its child (Yama ptrace_scope <= 1).

    python3 scripts/cma_read_bench.py

docs/performance.md ("Single copy: when it pays") quotes its output.
"""

import ctypes
import os
import subprocess
import sys
import time

import numpy as np

SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def main():
    if sys.argv[1:] == ["child"]:
        a = np.ones(max(SIZES), dtype=np.uint8)
        print(os.getpid(), a.ctypes.data, flush=True)
        sys.stdin.read()  # until the parent is done
        return
    libc = ctypes.CDLL(None, use_errno=True)
    readv = libc.process_vm_readv
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                      ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]
    child = subprocess.Popen([sys.executable, __file__, "child"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pid, addr = map(int, child.stdout.readline().split())
        for size in SIZES:
            dst, src = np.zeros(size, dtype=np.uint8), np.ones(size, dtype=np.uint8)
            reps = max(20, (256 << 20) // size)
            local, remote = IoVec(dst.ctypes.data, size), IoVec(addr, size)
            best_cma = best_copy = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(reps):
                    n = readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
                    if n != size:
                        raise OSError(ctypes.get_errno(), f"process_vm_readv read {n} of {size}")
                best_cma = min(best_cma, (time.perf_counter() - t) / reps)
                t = time.perf_counter()
                for _ in range(reps):
                    np.copyto(dst, src)
                best_copy = min(best_copy, (time.perf_counter() - t) / reps)
            print(f"{size >> 10:6d} KiB  process_vm_readv {size / best_cma / 1e9:6.2f} GB/s "
                  f"({best_cma * 1e6:8.1f} us)  memcpy {size / best_copy / 1e9:6.2f} GB/s "
                  f"({best_copy * 1e6:8.1f} us)")
    finally:
        child.stdin.close()
        child.wait()


if __name__ == "__main__":
    main()
