#!/usr/bin/env python3
"""Summarise compare-peers results: busbw table per (ranks, op, size) for
every system (the median over rounds when the run had several), Chorus/peer busbw ratios, small-message latency ratios, and a
busbw-vs-size PNG per (ranks, op).

  python peer_report.py results.jsonl OUTDIR
"""
import collections
import json
import statistics
import sys


def load(path):
    """Per (ranks, op), per system, per size: the (time µs, busbw GB/s)
    medians over the run's rounds; and how many rounds the run had."""
    rows = []
    for line in open(path):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a partial line (run still going) or a stray message
    # Every round of compare-peers.sh (ROUNDS) measures each point once;
    # the report keeps, per point, the median over rounds of time and busbw.
    samples = collections.defaultdict(list)  # (n, op, system, size) -> [(us, busbw)]
    for r in rows:
        ip = r["in_place"]
        samples[(r["nranks"], r["op"], r["system"], r["size"])].append((ip["time_us"], ip["busbw_gbs"]))
    data = collections.defaultdict(dict)  # (n, op) -> {system: {size: (us, busbw)}}
    # (4 ranks measure 8 B as 16 B, the smallest size that splits 4 ways, so
    # that point has two samples a round: report the usual count.)
    counts = collections.Counter(len(v) for v in samples.values())
    rounds = counts.most_common(1)[0][0] if counts else 0
    for (n, op, system, size), v in samples.items():
        data[(n, op)].setdefault(system, {})[size] = (
            statistics.median(t for t, _ in v),
            statistics.median(b for _, b in v),
        )
    return data, rounds


def ratio(mine, theirs, small, label=""):
    """One ratio cell: time ratio below 64 KiB (< 1: ours is faster),
    busbw ratio above (bold where ours is slower); "-" where either is
    missing."""
    if mine is None or theirs is None:
        return "-"
    if small:
        return f"{label}{mine[0] / theirs[0]:.2f}× t"
    r = f"{mine[1] / theirs[1]:.2f}"
    return f"{label}**{r}**" if mine[1] < theirs[1] else f"{label}{r}"


def main():
    path, out = sys.argv[1], sys.argv[2]
    data, rounds = load(path)
    print(f"(median over {rounds} round(s) per point)")
    peers = ["mpich", "openmpi", "gloo", "chorus-tcp", "openmpi-tcp", "tcp-raw"]
    for (n, op), systems in sorted(data.items()):
        print(f"\n### {op}, {n} ranks (busbw GB/s; time µs for sizes < 64 KiB; ratio = chorus / peer)\n")
        present = [s for s in ["chorus"] + peers if s in systems]
        tcp_peers = [p for p in ("openmpi-tcp", "tcp-raw") if p in present]
        hdr = "| size | " + " | ".join(present) + " | " + " | ".join(f"chorus/{p}" for p in present if p != "chorus")
        hdr += "".join(f" | chorus-tcp/{p}" for p in tcp_peers) + " |"
        print(hdr)
        ncols = 1 + len(present) + len([p for p in present if p != "chorus"]) + len(tcp_peers)
        print("|" + "---|" * ncols)
        sizes = sorted(set().union(*[systems[s].keys() for s in present]))
        for size in sizes:
            small = size < 64 << 10
            cells, ratios = [], []
            c = systems.get("chorus", {}).get(size)
            for s in present:
                v = systems[s].get(size)
                cells.append("-" if v is None else (f"{v[0]:.1f} µs" if small else f"{v[1]:.2f}"))
            for s in present:
                if s != "chorus":
                    ratios.append(ratio(c, systems[s].get(size), small))
            # The TCP path against its peers: chorus-tcp / openmpi-tcp and
            # chorus-tcp / tcp-raw.
            t = systems.get("chorus-tcp", {}).get(size)
            for peer in tcp_peers:
                ratios.append(ratio(t, systems[peer].get(size), small, "tcp "))
            print(f"| {size} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: no plot)")
        return
    keys = sorted(data)
    cols = 4
    rows_n = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 4 * rows_n), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        n, op = key
        for s, series in sorted(data[key].items()):
            xs = sorted(series)
            ax.plot(xs, [series[x][1] for x in xs], marker="o", ms=3, label=s)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}, {n} ranks")
        ax.set_xlabel("bytes")
        ax.set_ylabel("busbw GB/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(f"{out}/busbw.png", dpi=80)
    print(f"\nplot: {out}/busbw.png")


if __name__ == "__main__":
    main()
