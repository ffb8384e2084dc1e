"""benchmarks/probe_uniform3.py, the timing probe of a uniform 3-bit page format (BENCHMARKS.md,
session 36): the bf16 arithmetic its docstring and the results rest on, and that its probe kernels
still build from the decode kernel's source (it swaps two of that kernel's functions by name, so a
change of their signatures would break it silently until a GPU run)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def _bf16(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16).float())


@pytest.mark.parametrize("bits", [3, 4])
def test_codes_or_ed_into_bf16_128_are_128_plus_the_code(bits):
    """A code c in bits 0.. of a bf16 128's mantissa is 128 + c, and in bits 3.. 128 + 8 c, for every
    code of the width (4-bit codes reach bit 6, the mantissa's top); a mask of a 32-bit word gives two
    such values, one per half."""
    for c in range(2**bits):
        assert _bf16(0x4300 | c) == 128 + c
        assert _bf16(0x4300 | (c << 3)) == 128 + 8 * c
    word = 0x00050003 | (0x0002 << 3) | (0x0006 << 19)  # codes 3 and 5 at bits 0-2, 2 and 6 at bits 3-5
    lo = (word & 0x00070007) | 0x43004300
    hi = (word & 0x00380038) | 0x43004300
    assert [_bf16(lo & 0xFFFF), _bf16(lo >> 16)] == [131, 133]
    assert [_bf16(hi & 0xFFFF), _bf16(hi >> 16)] == [128 + 16, 128 + 48]


_PROBE = r"""
import sys
root = sys.argv[1]
sys.path[:0] = [root + "/benchmarks", root + "/scripts"]
import probe_uniform3 as P
from ptx_fingerprint import compact_launch, loop_mix
import weightszip.kernels.paged_decode_gluon as pg
for name, kern in P.kernels(["tree", "s0", "r0"]).items():
    k, spills = pg.compile_for_hopper(kern, *compact_launch(3, 3))
    print("mix", name, spills, loop_mix(k.asm["cubin"]))
"""


def test_probe_kernels_compile_for_hopper_without_the_table_loads(compile_in_child):
    """The probe's kernels compile for sm_90 without spills (a child process without the interpreter),
    and their main loops lose the 64 pair-table loads a page and warp: the planned format's (s0) with
    fewer instructions in all than the tree's, the register tables' (r0) with more (what its timing
    showed: 1.16x and 0.94x on an H100)."""
    out = compile_in_child(_PROBE, ROOT)
    mix = {}
    for line in out.splitlines():
        if line.startswith("mix"):
            _, name, spills, *fields = line.split()
            assert spills == "0", line
            mix[name] = {k: int(v) for k, v in (f.split("=") for f in fields)}
    assert set(mix) == {"tree", "s0", "r0"}, out
    for name in ("s0", "r0"):
        assert mix["tree"]["lds"] - mix[name]["lds"] >= 64, mix
    assert mix["s0"]["loop"] < mix["tree"]["loop"] < mix["r0"]["loop"], mix
