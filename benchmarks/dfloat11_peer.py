"""DFloat11 (PyPI ``dfloat11`` 0.5.0) as a GPU-decoder peer on our KV data.

DFloat11 compresses a bf16 tensor by Huffman-coding its 8-bit exponents (one code for the whole
tensor, built from the tensor itself with ``dahuffman``) and keeping the sign/mantissa bytes raw;
its GPU decoder is a CUDA kernel shipped as PTX (``dfloat11/decode.ptx``) that it launches through
CuPy. Its own encoder (``dfloat11_utils.encode``) is a Python loop over every symbol (about a
microsecond each: minutes per GB), so this module writes the same format with numpy and checks the
bytes against DFloat11's encoder on a prefix (``check_against_reference``); the decoder run on the
GPU box then proves the round trip bit for bit.

Used by ``bench_gpu_codec.py --speed --dfloat11 DIR`` where DIR holds the unpacked dfloat11 and
dahuffman wheels (the box has no package index; CuPy is installed there).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

import numpy as np

BYTES_PER_THREAD = 8  # DFloat11 0.5.0's launch constants (dfloat11.py)
THREADS_PER_BLOCK = 512


def load_utils(root: str | Path):
    """DFloat11's ``dfloat11_utils`` from an unpacked wheel at ``root`` without importing its
    package (whose ``__init__`` pulls in CuPy, accelerate and transformers)."""
    root = Path(root)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # dahuffman beside it
    spec = importlib.util.spec_from_file_location("dfloat11_utils", root / "dfloat11" / "dfloat11_utils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def exponents(bits16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bit patterns -> (8-bit exponents, sign/mantissa bytes) as DFloat11 splits them."""
    w = bits16.astype(np.uint16, copy=False)
    return ((w >> 7) & 0xFF).astype(np.uint8), (((w >> 8) & 0x80) | (w & 0x7F)).astype(np.uint8)


def build_codec(utils, exp: np.ndarray):
    """DFloat11's code for these exponents (its get_codec / get_32bit_codec / get_luts)."""
    from dahuffman import HuffmanCodec

    vals, freqs = np.unique(exp, return_counts=True)
    counter = {int(v): int(f) for v, f in zip(vals, freqs)}
    with contextlib.redirect_stdout(io.StringIO()):  # get_luts prints every table
        codec, _, table = utils.get_32bit_codec(counter)
        luts = utils.get_luts(table)
    assert isinstance(codec, HuffmanCodec)
    return codec, luts.numpy()


def encode(exp: np.ndarray, codec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(encoded exponent bytes, packed 5-bit gaps, uint32 output positions): DFloat11's
    ``encode`` output for ``exp``, vectorized. The stream is every code MSB first, then the EOF
    code, padded with zeros to a byte (DFloat11's own loop keeps only the first byte of what is
    left at the end; the decoder stops at the element count and never reads it)."""
    table = codec.get_code_table()
    lens = np.zeros(257, np.int64)
    vals = np.zeros(257, np.uint64)
    for s, (b, v) in table.items():
        k = s if isinstance(s, int) else 256  # the EOF symbol
        lens[k], vals[k] = b, v
    if lens.max() > 32:
        raise ValueError("DFloat11 codes are at most 32 bits")
    sym = np.concatenate([exp.astype(np.int64), [256]])
    ln = lens[sym]
    if (ln[:-1] == 0).any():
        raise ValueError("an exponent without a code")
    starts = np.cumsum(ln) - ln
    total = int(starts[-1] + ln[-1])
    # Codes into big-endian 32-bit words: a code starting at bit `off` of word w fills at most
    # words w and w + 1; codes never overlap, so summing the parts equals or-ing them.
    w = starts // 32
    off = (starts % 32).astype(np.uint64)
    v64 = vals[sym] << (np.uint64(64) - off - ln.astype(np.uint64))
    nw = int(w[-1]) + 2
    hi = np.bincount(w, weights=(v64 >> np.uint64(32)).astype(np.float64), minlength=nw)
    lo = np.bincount(w + 1, weights=(v64 & np.uint64(0xFFFFFFFF)).astype(np.float64), minlength=nw)
    words = (hi + lo).astype(np.uint64).astype(">u4")
    encoded = np.frombuffer(words.tobytes(), np.uint8)[: (total + 7) // 8]
    # gaps: per thread (64 bits), where its first code starts; positions: per block, its first element
    tbits = 8 * BYTES_PER_THREAD
    n_gaps = int(starts[-1]) // tbits + 1
    idx = np.searchsorted(starts, np.arange(n_gaps) * tbits)
    gaps = starts[idx] - np.arange(n_gaps) * tbits
    if (gaps >= 32).any() or (gaps < 0).any():
        raise ValueError("a thread's first code starts 32 bits or more into it")
    bbits = tbits * THREADS_PER_BLOCK
    n_pos = int(starts[-1]) // bbits + 1
    positions = np.concatenate([np.searchsorted(starts, np.arange(n_pos) * bbits), [len(exp)]]).astype(np.uint32)
    blocks = -(-len(encoded) // (THREADS_PER_BLOCK * BYTES_PER_THREAD))
    gaps = np.concatenate([gaps, np.zeros(THREADS_PER_BLOCK * blocks - n_gaps, np.int64)])
    gap_bits = ((gaps[:, None] >> np.arange(4, -1, -1)) & 1).astype(np.uint8).reshape(-1)
    return encoded, np.packbits(gap_bits), positions


def check_against_reference(utils, exp: np.ndarray, codec) -> dict:
    """Our encoder against DFloat11's own Python encoder on ``exp`` (keep it short: ~1 us/symbol)."""
    ours = encode(exp, codec)
    with contextlib.redirect_stderr(io.StringIO()):
        ref = utils.encode(exp.tolist(), codec, BYTES_PER_THREAD, THREADS_PER_BLOCK)
    n = min(len(ours[0]), len(ref[0])) - 1  # the last byte differs (see encode)
    return {"encoded_prefix_equal": bool(np.array_equal(ours[0][:n], ref[0][:n])),
            "gaps_equal": bool(np.array_equal(ours[1], ref[1])),
            "positions_equal": bool(np.array_equal(ours[2], ref[2]))}


def shared_mem_bytes(positions: np.ndarray) -> int:
    """The decode kernel's dynamic shared memory, as dfloat11.py computes it."""
    return THREADS_PER_BLOCK * 4 + 4 + int((positions[1:].astype(np.int64) - positions[:-1]).max()) * 2


def compressed_bytes(encoded, sign_mantissa_n, positions, gaps) -> int:
    """What DFloat11 stores (its own 'Compression factor' sum; the LUTs, ~1 KB, aside)."""
    return len(encoded) + sign_mantissa_n + 4 * len(positions) + len(gaps)
