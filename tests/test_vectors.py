"""Golden vectors of the container format (tests/vectors, see its README.md).

Every valid vector decodes to its expected output and passes `verify`; every invalid vector is
rejected with exactly the exception class in invalid/EXPECTED.json, through every decoder entry
point; the expected arrays survive a round trip through the current encoder; and the reference
reader in generate.py (written from docs/FORMAT.md alone) agrees with all of it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import weightszip
from weightszip import errors

VECTORS = Path(__file__).parent / "vectors"
MANIFEST = json.loads((VECTORS / "MANIFEST.json").read_text())
EXPECTED = json.loads((VECTORS / "invalid" / "EXPECTED.json").read_text())
VALID = sorted(MANIFEST["valid"])
INVALID = sorted(EXPECTED)

NP_DTYPE = {
    "uint8": np.uint8, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
    "float32": np.float32, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2, "float64": np.float64, "int8": np.int8,
    "int16": np.int16, "int32": np.int32, "int64": np.int64, "uint16": np.uint16,
    "uint32": np.uint32, "uint64": np.uint64, "bool": np.bool_,
}


def expected_arrays(vector: str) -> list[tuple[str, np.ndarray]]:
    """(entry name, array) of a valid vector's expected output, in entry order, with the
    container dtype (the files hold bfloat16 / float8 as their bit patterns)."""
    m = MANIFEST["valid"][vector]
    path = VECTORS / "valid" / m["expected"]
    if path.suffix == ".npy":
        stored = [("", np.load(path, allow_pickle=False))]
    else:
        with np.load(path, allow_pickle=False) as z:
            stored = [(k, z[k]) for k in z.files]
    assert [n for n, _ in stored] == [e["name"] for e in m["entries"]]
    out = []
    for (name, a), e in zip(stored, m["entries"]):
        assert a.dtype == np.dtype(e["npy_dtype"]) and list(a.shape) == e["shape"]
        out.append((name, a.view(NP_DTYPE[e["dtype"]])))
    return out


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def test_vector_lists_are_complete():
    assert sorted(p.name for p in (VECTORS / "invalid").glob("*.wz")) == INVALID
    assert sorted(p.name for p in (VECTORS / "valid").glob("*.wz")) == VALID
    expected_files = {m["expected"] for m in MANIFEST["valid"].values()}
    assert {p.name for p in (VECTORS / "valid").iterdir() if p.suffix != ".wz"} == expected_files
    assert set(MANIFEST["invalid"]) == set(INVALID)


@pytest.mark.parametrize("vector", VALID)
def test_valid_vector_decodes(vector, tmp_path):
    m = MANIFEST["valid"][vector]
    path = VECTORS / "valid" / vector
    data = path.read_bytes()
    weightszip.verify(data)
    weightszip.verify_file(path)
    if m["decode_with"] == "decompress_file":
        weightszip.decompress_file(path, tmp_path / "out")
        assert (tmp_path / "out").read_bytes() == (VECTORS / "valid" / m["expected"]).read_bytes()
        return
    want = expected_arrays(vector)
    if m["decode_with"] == "decompress":
        ((_, a),) = want
        assert_same(weightszip.decompress(data, out="numpy"), a)
    got = weightszip.load_file(path, out="numpy")
    assert list(got) == [n for n, _ in want]
    for name, a in want:
        assert_same(got[name], a)


def _decoders(vector: str, data: bytes, path: Path, tmp_path: Path):
    yield "verify", lambda: weightszip.verify(data)
    yield "load_file", lambda: weightszip.load_file(path, out="numpy")
    yield "decompress_file", lambda: weightszip.decompress_file(path, tmp_path / "out")
    base = MANIFEST["invalid"][vector]["from"]
    if len(MANIFEST["valid"][base]["entries"]) == 1:
        yield "decompress", lambda: weightszip.decompress(data, out="numpy")


@pytest.mark.parametrize("vector", INVALID)
def test_invalid_vector_rejected(vector, tmp_path):
    cls = getattr(errors, EXPECTED[vector])
    path = VECTORS / "invalid" / vector
    data = path.read_bytes()
    for api, call in _decoders(vector, data, path, tmp_path):
        with pytest.raises(cls) as info:
            call()
        assert type(info.value) is cls, f"{api}: {type(info.value).__name__}: {info.value}"
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir()], "a failed decode left a file behind"


REENCODE = [(v, n) for v in VALID if MANIFEST["valid"][v]["decode_with"] != "decompress_file"
            for n in (e["name"] for e in MANIFEST["valid"][v]["entries"])]


@pytest.mark.parametrize(("vector", "entry"), REENCODE)
def test_expected_arrays_reencode(vector, entry):
    """The current encoder, default options, round-trips every expected array bit for bit (its
    bytes may differ from the vector's: only decoding is frozen)."""
    a = dict(expected_arrays(vector))[entry]
    assert_same(weightszip.decompress(weightszip.compress(a), out="numpy"), a)


def _generator():
    spec = importlib.util.spec_from_file_location("wz_vectors_generate", VECTORS / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_reference_reader_agrees():
    """generate.py's reader, written from docs/FORMAT.md, decodes the valid vectors to the same
    bytes and rejects each invalid one with the error kind its class stands for."""
    gen = _generator()
    for vector in VALID:
        m = MANIFEST["valid"][vector]
        kind, entries = gen.ref_read((VECTORS / "valid" / vector).read_bytes())
        if m["decode_with"] == "decompress_file":
            assert kind == 1
            assert b"".join(e["raw"] for e in entries) == (VECTORS / "valid" / m["expected"]).read_bytes()
        else:
            assert kind == 0
            want = expected_arrays(vector)
            assert [(e["name"], e["raw"]) for e in entries] == [(n, a.tobytes()) for n, a in want]
    for vector in INVALID:
        with pytest.raises(gen.Reject) as info:
            gen.ref_read((VECTORS / "invalid" / vector).read_bytes())
        assert gen.KIND_TO_CLASS[info.value.kind] == EXPECTED[vector], (vector, str(info.value))


def _group_map_without_top_group() -> tuple[bytes, bytes]:
    """bf16_grouped_contexts re-declared with n_groups = 9 while its map still uses groups 0-7 and
    every listed key k re-keyed to (k // 8) * 9 + k % 8: the same context for every unit, so by
    FORMAT.md ("The map need not use every group value below n_groups") it decodes to the same
    bytes. Returns (container, expected raw bytes)."""
    gen = _generator()
    vector = "bf16_grouped_contexts.wz"
    c = gen.parse((VECTORS / "valid" / vector).read_bytes())
    ch = c.entries[0].chunks[0]
    r = gen.Rans.parse(ch.payload)
    assert r.n_groups == 8 and max(r.groups) == 7
    r.listed = [((k // 8) * 9 + k % 8, cid) for k, cid in r.listed]
    r.n_groups = 9
    ch.payload = r.build()
    ((_, a),) = expected_arrays(vector)
    return gen.build(c), a.tobytes()


def test_reference_reader_group_map_need_not_use_every_group():
    """FORMAT.md: "The map need not use every group value below n_groups"."""
    data, raw = _group_map_without_top_group()
    _, entries = _generator().ref_read(data)
    assert entries[0]["raw"] == raw


def test_decoder_group_map_need_not_use_every_group():
    """The decoder once took the group count from the map (its largest value + 1) instead of
    n_groups, and panicked on an assertion for this input."""
    data, raw = _group_map_without_top_group()
    weightszip.verify(data)
    assert weightszip.decompress(data, out="numpy").tobytes() == raw
