#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's per-instruction source counters: the stall
reasons over all samples, the instructions with the most samples (with their main reason and the
instruction before them: a stall is charged to the instruction that could not issue, so its cause
is often what it waits for), each ``LDGSTS`` copy's L2 sectors and shared-memory wavefronts per
execution on the common path (a warp's 512-byte copy needs 16 sectors and 4 wavefronts; more means
split requests), and the shared loads there with bank conflicts (wavefronts per execution against
Nsight's ideal).

    ncu --clock-control none -k regex:exact4_split --launch-skip 2 --launch-count 1 --set full \\
        --import-source yes -o x4 python ...
    ncu --import x4.ncu-rep --page source --csv --print-source sass > x4_source.csv
    python benchmarks/ncu_stalls.py x4_source.csv --top 12

(the ``x4_stalls.txt`` / ``*_stalls.txt`` files of ``benchmarks/results/box/s24_run*`` were made so).
"""

from __future__ import annotations

import argparse
import collections
import csv


def _num(row, ix, key):
    try:
        return float(row[ix[key]].replace(",", ""))
    except (KeyError, ValueError, IndexError):
        return 0.0


def summarize(path: str, top: int = 12) -> str:
    rows = list(csv.reader(open(path, newline="")))
    # line 0 names the kernel, line 1 holds the column names
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tot = collections.Counter()
    for r in data:
        for s in stalls:
            tot[s] += _num(r, ix, s)
    n = sum(tot.values()) or 1.0
    out = [f"samples {n:.0f}", " ".join(f"{s[6:]}={v / n * 100:.1f}" for s, v in tot.most_common(8))]
    order = sorted(range(len(data)), key=lambda i: -_num(data[i], ix, "Warp Stall Sampling (All Samples)"))
    for i in order[:top]:
        r = data[i]
        main = max(stalls, key=lambda s: _num(r, ix, s))
        prev = data[i - 1][1].strip()[:40] if i else ""
        out.append(f"{i} {r[1].strip()[:60]} {_num(r, ix, 'Warp Stall Sampling (All Samples)'):.0f} "
                   f"{main[6:]} {_num(r, ix, main):.0f} | prev: {prev}")
    # the copies on the loop's common path: executed at least a tenth as often as the most executed
    most = max((_num(r, ix, "Instructions Executed") for r in data), default=0.0)
    for i, r in enumerate(data):
        execs = _num(r, ix, "Instructions Executed")
        if "LDGSTS" in r[1] and execs > 0 and execs >= most / 10:
            out.append(f"{i} {r[1].strip()[:50]} sect {_num(r, ix, 'L2 Theoretical Sectors Global') / execs:.1f} "
                       f"smem wf {_num(r, ix, 'L1 Wavefronts Shared') / execs:.1f} "
                       f"thr {_num(r, ix, 'Avg. Predicated-On Threads Executed'):.0f}")
    # shared loads on the common path with bank conflicts: wavefronts per execution against the ideal
    for i, r in enumerate(data):
        execs = _num(r, ix, "Instructions Executed")
        excess = _num(r, ix, "L1 Wavefronts Shared Excessive")
        if r[1].strip().startswith("LDS") and execs >= most / 10 and excess > 0:
            out.append(f"{i} {r[1].strip()[:50]} smem wf {_num(r, ix, 'L1 Wavefronts Shared') / execs:.2f} "
                       f"ideal {_num(r, ix, 'L1 Wavefronts Shared Ideal') / execs:.2f}")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=12, help="instructions listed by stall samples")
    args = p.parse_args(argv)
    print(summarize(args.csv, args.top))


if __name__ == "__main__":
    main()
