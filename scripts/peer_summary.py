#!/usr/bin/env python3
"""The summary tables of docs/performance.md from compare-peers results:
one row per (ranks, op) with the smallest size and 2 KiB latencies, busbw
at 128 KiB / 2 MiB / 32 MiB / 128 MiB, and how many sizes from 128 KiB
have Chorus at or above the best MPI; then the small-size speed ratios;
then, for a second results file (the 1-16 MiB run), one row per point.

  python3 scripts/peer_summary.py MAIN_results.jsonl [MID_results.jsonl]

Every point is the median over the rounds of the run, loaded by
scripts/peer_report.py's `load`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_report import load as load_rounds  # noqa: E402

MPIS = ("mpich", "openmpi")


def load(path):
    return load_rounds(path)[0]


def size_name(b):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def main():
    data = load(sys.argv[1])
    ops = []
    for (n, op) in data:
        if op not in ops:
            ops.append(op)
    print(
        "| ranks | op | smallest size, µs: chorus / chorus-tcp / MPICH / Open MPI "
        "| 2 KiB, µs | 128 KiB busbw | 2 MiB busbw | 32 MiB busbw | 128 MiB busbw "
        "| sizes ≥ 128 KiB with chorus ≥ best MPI |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    small = {}
    for n in sorted({n for n, _ in data}):
        for op in ops:
            s = data.get((n, op))
            if not s or "chorus" not in s:
                continue
            ch = s["chorus"]
            lo = min(ch)

            def lat(size, systems=("chorus", "chorus-tcp") + MPIS):
                return " / ".join(
                    f"{s[x][size][0]:.1f}" if size in s.get(x, {}) else "-" for x in systems
                )

            def bw(size):
                return " / ".join(
                    f"{s[x][size][1]:.2f}" if size in s.get(x, {}) else "-"
                    for x in ("chorus",) + MPIS
                )

            big = [z for z in sorted(ch) if z >= 128 << 10]
            behind = []
            for z in big:
                best = max((s[m][z][1] for m in MPIS if z in s.get(m, {})), default=None)
                if best and ch[z][1] < best:
                    behind.append(f"{size_name(z)} {ch[z][1] / best:.2f}")
            met = len(big) - len(behind)
            tail = f"{met}/{len(big)}" + (f" (behind: {', '.join(behind)})" if behind else "")
            print(
                f"| {n} | {op} | {size_name(lo)}: {lat(lo)} | {lat(2048)} | {bw(128 << 10)} "
                f"| {bw(2 << 20)} | {bw(32 << 20)} | {bw(128 << 20)} | {tail} |"
            )
            ratios = []
            for z in (lo, 2048):
                best = min((s[m][z][0] for m in MPIS if z in s.get(m, {})), default=None)
                ratios.append(f"{best / ch[z][0]:.2f}" if best and z in ch else "-")
            small.setdefault(n, []).append(f"{op} {ratios[0]}/{ratios[1]}")
    print(
        "\nSmall sizes, speed ratio chorus / best MPI (best MPI time / chorus time), "
        "smallest size and 2 KiB:"
    )
    for n, items in sorted(small.items()):
        print(f"- {n} ranks: " + ", ".join(items))
    if len(sys.argv) > 2:
        mid = load(sys.argv[2])
        print("\n| op (2 ranks) | size | chorus | MPICH | Open MPI | chorus / best MPI |")
        print("|---|---|---|---|---|---|")
        for (n, op), s in sorted(mid.items()):
            for z in sorted(s.get("chorus", {})):
                best = max((s[m][z][1] for m in MPIS if z in s.get(m, {})), default=None)
                cells = " | ".join(
                    f"{s[x][z][1]:.2f}" if z in s.get(x, {}) else "-" for x in ("chorus",) + MPIS
                )
                ratio = f"{s['chorus'][z][1] / best:.2f}" if best else "-"
                print(f"| {op} | {size_name(z)} | {cells} | {ratio} |")


if __name__ == "__main__":
    main()
