"""The capacity calculator: the published figures reproduced exactly, JSON, config.json, errors, plot."""

import json
import math
from fractions import Fraction

import pytest

from weightszip import cli
from weightszip.errors import WeightszipError
from weightszip.eval import capacity
from weightszip.eval.capacity import GB, CapacityError, compute

DATA = __import__("pathlib").Path(__file__).parent / "data"
ALL = ["bf16", "fp8", "kv-exact", "kv-exact4", "int4-g32", "q4", "q3.5", "q3"]

# Llama-3.1-8B's and -70B's config.json, as Meta publishes them (the fields the calculator reads).
LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def run_cli(*args) -> int:
    return cli.main([str(a) for a in args])


def sessions(report):
    """Sessions of the stated formats (the lossless kv-exact formats, whose size is measured: below)."""
    return {f.name: f.sessions_per_unit for f in report.formats if not f.name.startswith("kv-exact")}


def test_llama_8b_one_h100_as_the_card_reports():
    r = compute("llama-3.1-8b", "h100-80gb-reported", gpus=1, context=131072)
    assert r.memory_gb == Fraction("85.5")
    assert r.weight_bytes == Fraction("16.06") * GB
    assert r.budget_per_gpu == Fraction("58.6") * GB  # 0.92 x 85.5 - 16.06 - 4, exactly
    assert r.budget_total == r.budget_per_gpu
    bf16 = r.row("bf16")
    assert bf16.kv_bytes_per_session == 2 * 32 * 8 * 128 * 2 * 131072
    assert round(float(bf16.kv_bytes_per_session / GB), 1) == 17.2
    assert sessions(r) == {"bf16": 3, "fp8": 6, "int4-g32": 12, "q4": 13, "q3.5": 15, "q3": 18}
    assert r.unit == "GPU"
    # speedups are ratios of whole-session counts
    assert r.row("q3").vs_bf16 == 6.0 and r.row("q3").vs_fp8 == 3.0
    assert r.row("int4-g32").vs_fp8 == 2.0


def test_llama_8b_memory_as_explicit_input():
    r = compute("llama-3.1-8b", "h100-80gb", gpu_memory_gb="85.5")
    assert r.memory_gb == Fraction("85.5") and r.memory_source == "--gpu-memory-gb"
    assert sessions(r) == {"bf16": 3, "fp8": 6, "int4-g32": 12, "q4": 13, "q3.5": 15, "q3": 18}
    # any GPU, given its memory
    assert sessions(compute("llama-3.1-8b", "my-gpu", gpu_memory_gb="85.5")) == sessions(r)
    # the label's 80 GB is a different, smaller budget
    assert compute("llama-3.1-8b", "h100-80gb").budget_per_gpu == (Fraction("73.6") - Fraction("20.06")) * GB


def test_llama_70b_8x_h100_node():
    r = compute("llama-3.1-70b", "h100-80gb", gpus=8, context=131072)
    assert r.memory_gb == 80
    assert r.weight_bytes == Fraction("141.2") * GB
    assert r.budget_total == (Fraction("588.8") - Fraction("141.2") - 32) * GB
    assert round(float(r.budget_total / GB)) == 416
    bf16 = r.row("bf16")
    assert bf16.kv_bytes_per_session == 2 * 80 * 8 * 128 * 2 * 131072
    assert round(float(bf16.kv_bytes_per_session / GB), 1) == 42.9
    assert sessions(r) == {"bf16": 9, "fp8": 19, "int4-g32": 34, "q4": 38, "q3.5": 44, "q3": 51}
    assert r.unit == "node" and r.unit_gpus == 8 and r.kv_replication == 1


def test_llama_8b_h200():
    r = compute("llama-3.1-8b", "h200")
    assert r.budget_per_gpu == Fraction("109.66") * GB
    assert sessions(r) == {"bf16": 6, "fp8": 12, "int4-g32": 22, "q4": 25, "q3.5": 29, "q3": 34}


def test_fleet():
    r = compute("llama-3.1-8b", "h100-80gb-reported", sessions=1000)
    q3 = r.row("q3")
    assert q3.fleet_units == math.ceil(1000 / 18) == q3.fleet_gpus == 56
    assert q3.cost_reserved == 112 and q3.cost_on_demand == Fraction("202.16")
    r = compute("llama-3.1-70b", "h100-80gb", gpus=8, sessions=1000)
    fp8 = r.row("fp8")
    assert fp8.fleet_units == math.ceil(1000 / 19) == 53 and fp8.fleet_gpus == 424
    assert fp8.cost_reserved == 848
    # 2-GPU replicas are packed four to a node, and bought by the node
    r = compute("llama-3.1-8b", "h100-80gb", gpus=2, sessions=100)
    assert r.replicas_per_unit == 4
    assert r.row("bf16").sessions_per_unit == 4 * r.row("bf16").sessions_per_replica
    assert r.row("bf16").fleet_gpus == 8 * r.row("bf16").fleet_units


def test_register_format_extends_and_replaces():
    saved = dict(capacity.FORMATS)
    try:
        capacity.register_format("q2.25", 2.25, "test")
        r = compute("llama-3.1-8b", "h100-80gb-reported", formats=["bf16", "q2.25"])
        assert r.row("q2.25").bits_per_value == Fraction(9, 4)
        assert r.row("q2.25").sessions_per_unit == math.floor(Fraction("58.6") * GB / (Fraction(17179869184) * 9 / 64))
        capacity.register_format("q3", Fraction(3) + Fraction(1, 64))
        assert compute("llama-3.1-8b", "h100-80gb-reported", formats=["q3"]).row("q3").bits_per_value == Fraction(193, 64)
        with pytest.raises(CapacityError):
            capacity.register_format("bad", 0)
        with pytest.raises(ValueError):
            capacity.register_format("bad", "four")
    finally:
        capacity.FORMATS.clear()
        capacity.FORMATS.update(saved)


def test_text_output(capsys):
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--gpu-memory-gb", "85.5") == 0
    out = capsys.readouterr().out
    assert "85.5 GB each" in out and "58.60 GB of KV per GPU" in out
    assert "sessions/GPU" in out and "Fleet for 1000 concurrent sessions" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] == "q3.5"]
    assert rows[0][1:4] == ["3.50", "3.76", "15"]  # format table: bits, KV GB/session, sessions/GPU
    assert rows[1][1:5] == ["15", "67", "$134.00", "$241.87"]  # fleet table


def test_json_output(capsys):
    assert run_cli("capacity", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--gpus", "8", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpu"]["memory_gb"] == 80.0 and d["gpus"] == 8 and d["unit"] == "node"
    assert round(d["kv_budget_gb_total"]) == 416
    assert [(f["name"], f["sessions_per_unit"]) for f in d["formats"]] == list(
        zip(ALL, [9, 19, 13, 12, 34, 38, 44, 51])
    )
    assert d["fleet"]["sessions"] == 1000 and d["fleet"]["price_reserved_per_gpu_hour"] == 2.0
    assert d["fleet"]["rows"][1]["gpus"] == 424


def test_formats_and_context_flags(capsys):
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb-reported", "--context", "128k",
                   "--formats", "fp8,q3", "--sessions", "36", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["context"] == 131072
    assert [(f["name"], f["sessions_per_unit"]) for f in d["formats"]] == [("fp8", 6), ("q3", 18)]
    assert [row["units"] for row in d["fleet"]["rows"]] == [6, 2]
    # speedups still relative to bf16 even when bf16 is not listed
    assert d["formats"][1]["speedup_vs_bf16"] == 6.0


def test_config_json(tmp_path, capsys):
    p = tmp_path / "Llama-3.1-8B" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(LLAMA_8B_CONFIG))
    # parameters estimated from the config: 8,030,261,248 (Meta's 8.03B)
    r = compute(str(p), "h100-80gb-reported")
    assert r.model.params == 8030261248
    assert (r.model.layers, r.model.kv_heads, r.model.head_dim) == (32, 8, 128)
    assert any("estimated" in n for n in r.notes)
    assert sessions(r) == {"bf16": 3, "fp8": 6, "int4-g32": 12, "q4": 13, "q3.5": 15, "q3": 18}
    # --params, and a directory holding config.json, through the CLI
    assert run_cli("capacity", "--model", p.parent, "--gpu", "h100-80gb-reported", "--params", "8.03B", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["model"]["params"] == 8.03e9 and d["kv_budget_gb_per_gpu"] == 58.6
    # a parameter field in the config; head_dim given directly; MHA when num_key_value_heads is absent
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "head_dim": 64, "num_parameters": 134515008}
    q = tmp_path / "smol.json"
    q.write_text(json.dumps(cfg))
    r = compute(str(q), "l4", context=8192)
    assert r.model.kv_heads == 9 and r.model.params == 134515008
    assert r.row("bf16").kv_bytes_per_session == 2 * 30 * 9 * 64 * 2 * 8192


def test_config_mixture_of_experts_needs_params(tmp_path):
    cfg = dict(LLAMA_8B_CONFIG, num_local_experts=8)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(CapacityError, match="--params"):
        compute(str(p), "h200")
    assert compute(str(p), "h200", params="46.7e9").model.params == Fraction(467, 10) * 10**9


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(model="llama-9"), "unknown model"),
        (dict(gpu="h300"), "unknown GPU"),
        (dict(formats=["q5"]), "unknown format"),
        (dict(gpus=3), "does not divide"),
        (dict(gpus=12), "multiple of 8"),
        (dict(gpu_memory_gb=-1), "positive"),
        (dict(model="llama-3.1-70b"), "no room for any KV cache"),
        (dict(params="many"), "not a number"),
    ],
)
def test_invalid_inputs(kwargs, match):
    args = dict(model="llama-3.1-8b", gpu="h100-80gb")
    args.update(kwargs)
    model, gpu = args.pop("model"), args.pop("gpu")
    with pytest.raises(CapacityError, match=match) as e:
        compute(model, gpu, **args)
    assert isinstance(e.value, ValueError) and isinstance(e.value, WeightszipError)


def test_invalid_config_files(tmp_path):
    with pytest.raises(CapacityError, match="cannot read"):
        compute(str(tmp_path / "missing.json"), "h200")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CapacityError, match="not valid JSON"):
        compute(str(bad), "h200")
    bad.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32}))
    with pytest.raises(CapacityError, match="hidden_size"):
        compute(str(bad), "h200")
    bad.write_text(json.dumps(dict(LLAMA_8B_CONFIG, kv_lora_rank=512)))
    with pytest.raises(CapacityError, match="latent"):
        compute(str(bad), "h200")


def test_cli_errors(capsys):
    # a bad value for a flag: argparse's usage error
    for argv in (["--gpus", "0"], ["--context", "lots"], ["--sessions", "-5"], ["--gpu-memory-gb", "x"]):
        with pytest.raises(SystemExit) as e:
            run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", *argv)
        assert e.value.code == 2
    with pytest.raises(SystemExit):
        run_cli("capacity", "--gpu", "h100-80gb")  # --model is required
    capsys.readouterr()
    # an input the calculator cannot use: a message and exit status 1
    assert run_cli("capacity", "--model", "llama-3.1-70b", "--gpu", "l40s") == 1
    err = capsys.readouterr().err
    assert "no room for any KV cache" in err and "--gpus" in err
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--formats", "bf16,zz") == 1
    assert "unknown format 'zz'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--params", "--gpu-memory-gb", "--weights-gb", "--price-on-demand", "--price-reserved",
                                  "--activations-gb", "--memory-fraction"])
@pytest.mark.parametrize("value", ["1e400", "-1e400", "1e-400", "1e99999999", "inf", "nan"])
def test_cli_rejects_numbers_out_of_range(flag, value, capsys):
    # (1e400 was an OverflowError traceback, 1e99999999 hung parsing): argparse's usage error
    with pytest.raises(SystemExit) as e:
        run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h200", f"{flag}={value}")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and "Traceback" not in err
    assert "out of range" in err or "not a number" in err


@pytest.mark.parametrize("kwargs", [dict(gpu_memory_gb=1e300), dict(weights_gb="1e400"), dict(params="1e400"),
                                    dict(price_reserved=float("inf")), dict(memory_fraction="1e-400")])
def test_compute_rejects_numbers_out_of_range(kwargs):
    with pytest.raises(CapacityError, match="out of range|not a number"):
        compute("llama-3.1-8b", "h200", **kwargs)


def test_kv_heads_replicated_past_one_per_gpu():
    r = compute("llama-3.1-70b", "h100-80gb", gpus=16)
    assert r.kv_replication == 2 and r.unit_gpus == 16
    assert r.row("bf16").kv_bytes_per_session == 2 * 2 * 80 * 8 * 128 * 2 * 131072


def test_plot_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "capacity.png"
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb-reported", "--plot", out) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in capsys.readouterr().out


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(CapacityError, match="pip install matplotlib"):
        capacity._import_pyplot()


def test_lossless_formats_measured_on_a_kv_sample(tmp_path, capsys):
    """kv-exact and kv-exact4 count at their size on our held-out real K/V by default; --kv-sample
    measures them on the user's K/V (the Rust encoders, every page byte and offset counted): on the
    real SmolLM2 K/V in tests/data the encoders' bytes of each stream's second half, KV Exact's tops
    fitted on its first; an all-zero cache at the size the format's layout gives."""
    import numpy as np

    from weightszip import kv_exact

    r = compute("llama-3.1-8b", "h100-80gb", gpus=1, context=131072)
    assert (r.row("kv-exact").sessions_per_unit, r.row("kv-exact4").sessions_per_unit) == (4, 3)
    assert r.row("kv-exact").bits_per_value == Fraction("11.2296")
    # [K/V, layers, tokens, heads, dim] of real SmolLM2 values: 6 streams of 64 tokens
    real = np.load(DATA / "kv_smollm2_64tok.npy").reshape(2, 3, 64, 3, 64)
    got = capacity.measure_exact_formats(real)
    held = real[..., 32:, :, :].reshape(-1, 2, 16, 3, 64)
    want = want4 = 0
    for s, x in enumerate(held):
        bases = kv_exact.cpu_calibrate_bases(real.reshape(-1, 64, 3, 64)[s, :32].reshape(32, 192))
        want += len(kv_exact.cpu_encode_pages(x, bases)[0]) + 16
        want4 += len(kv_exact.cpu_encode_exact4_pages(x)[0]) + 16
    assert got == {"kv-exact": Fraction(16 * want, held.nbytes), "kv-exact4": Fraction(16 * want4, held.nbytes)}
    assert 8 < got["kv-exact"] < got["kv-exact4"] < 16
    p = tmp_path / "kv.npy"
    np.save(p, real.astype(np.uint16))
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--kv-sample", p, "--json") == 0
    d = {f["name"]: f for f in json.loads(capsys.readouterr().out)["formats"]}
    assert d["kv-exact"]["bits_per_value"] == float(got["kv-exact"]) and "kv.npy" in d["kv-exact4"]["description"]
    # an all-zero cache: no plain rows, so a KV Exact4 page is its 16-byte header and 25 bytes per
    # channel, plus the offset, against 32 bytes per channel in bf16
    zeros = capacity.measure_exact_formats(np.zeros((64, 3, 64), np.uint16))
    assert zeros["kv-exact4"] == Fraction(16 * (16 + 25 * 64 * 3 + 8), 32 * 64 * 3)
    # unusable samples: a typed error each, through the CLI too
    for bad in (np.zeros((40, 2, 32), np.uint16), np.zeros((64, 32), np.uint16), np.zeros((64, 2, 32), np.float32)):
        with pytest.raises(CapacityError):
            capacity.measure_exact_formats(capacity.load_kv_sample(str(_save(tmp_path, bad))))
    torch = pytest.importorskip("torch")
    for bad in (torch.zeros(64, 2, 32), torch.zeros(64, 2, 48, dtype=torch.bfloat16)):  # float32; head_dim 48
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises(CapacityError):
            capacity.measure_exact_formats(capacity.load_kv_sample(str(tmp_path / "bad.pt")))
    torch.save(torch.from_numpy(real.astype(np.int16)).view(torch.bfloat16), tmp_path / "kv.pt")
    assert capacity.measure_exact_formats(capacity.load_kv_sample(str(tmp_path / "kv.pt"))) == got
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--kv-sample", tmp_path / "none.npy") == 1
    assert "cannot read" in capsys.readouterr().err
    # a .pt that is not a tensor saved with torch.save (any pickle): refused, not unpickled
    (tmp_path / "x.pt").write_bytes(__import__("pickle").dumps(print))
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--kv-sample", tmp_path / "x.pt") == 1
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "y.npy").write_bytes(b"\x93NUMPY garbage")
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--kv-sample", tmp_path / "y.npy") == 1


def _save(tmp_path, x):
    p = tmp_path / f"s{x.ndim}_{x.shape[0]}_{x.dtype}.npy"
    np_save = __import__("numpy").save
    np_save(p, x)
    return p


# ------------------------------------------------------------------------ the compact formats' budget

SMOLLM2_CAL = DATA.parent.parent / "python" / "weightszip" / "data" / "smollm2.wzcal"


def test_compact_budgets_are_counted_at_the_context(capsys):
    """q4, q3.5 and q3 were counted at a flat 4 / 3.5 / 3 bits at every --context, though those are
    budgets at 131072 tokens with 4 sink + 128 recent tokens kept in bf16 (and tables): at 8k q4 showed
    199 sessions of Llama-3.1-8B on 80 GB, at 128 tokens 4x bf16's. Now the kept tokens and the tables
    are counted at --context; at 131072 the figures are the budgets, exactly."""
    at128k = compute("llama-3.1-8b", "h100-80gb", context=131072)
    assert [at128k.row(n).bits_per_value for n in ("q4", "q3.5", "q3")] == [4, Fraction(7, 2), 3]
    r = compute("llama-3.1-8b", "h100-80gb", context=8192)
    assert sessions(r) == {"bf16": 49, "fp8": 99, "int4-g32": 177, "q4": 190, "q3.5": 215, "q3": 248}  # q4 was 199
    from weightszip import _compact_budget as cb

    for n, target in cb.TARGETS.items():
        assert r.row(n).bits_per_value == cb.budget_bits(target, 8192, 32, 8, 128) > target
        assert r.row(n).budget_bits == Fraction(target)
    assert round(float(r.row("q4").bits_per_value), 3) == 4.194
    # at most 132 tokens every token is kept in bf16: q4 costs more than bf16 (its tables too)
    tiny = compute("llama-3.1-8b", "h100-80gb", context=128)
    assert tiny.row("q4").bits_per_value > 16 and tiny.row("q4").sessions_per_unit < tiny.row("bf16").sessions_per_unit
    # said in the output
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--context", "8k") == 0
    out = capsys.readouterr().out
    assert "budgets at 131072 tokens" in out and "4 sink + 128 recent tokens kept in bf16" in out
    assert "q4 4 -> 4.194" in out
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--context", "8k", "--json") == 0
    q4 = next(f for f in json.loads(capsys.readouterr().out)["formats"] if f["name"] == "q4")
    assert q4["budget_bits_per_value"] == 4.0 and q4["budget_context"] == 131072 and q4["bits_per_value"] > 4.19
    # a format registered at fixed bits (as a measured format is) is counted as given at every context
    saved = dict(capacity.FORMATS)
    try:
        capacity.register_format("q3.5", Fraction(7219, 2048))
        assert compute("llama-3.1-8b", "h100-80gb", context=2048).row("q3.5").bits_per_value == Fraction(7219, 2048)
    finally:
        capacity.FORMATS.clear()
        capacity.FORMATS.update(saved)


def test_compact_budget_bounds_a_real_calibrations_bits():
    """Without a calibration the budget's count is at least, and close to, what a real calibration
    (the one the package ships) gives at every context."""
    pytest.importorskip("torch")
    from weightszip import _compact_budget as cb
    from weightszip.compact.calibrate import Calibration

    cal = Calibration.load(SMOLLM2_CAL)
    assert (cal.sink_tokens, cal.recent_window, cal.meta["budget_context"]) == (cb.SINK_TOKENS, cb.RECENT_WINDOW,
                                                                                cb.BUDGET_CONTEXT)
    for name, target in cb.TARGETS.items():
        for ctx in (100, 132, 133, 2048, 8192, 131072, 1 << 20):
            real = cal.bits_fraction(name, ctx)
            est = cb.budget_bits(target, ctx, cal.layers, cal.kv_heads, cal.head_dim)
            assert real <= est <= real + Fraction(1, 20), (name, ctx, float(real), float(est))


def test_capacity_calibration_honours_params(tmp_path, capsys):
    """`capacity --calibration` resolved the model without --params: a config that needs them (MoE)
    failed with "give --params" though they were given."""
    pytest.importorskip("torch")
    cfg = {"model_type": "mixtral", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152, "num_local_experts": 8}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert run_cli("capacity", "--model", p, "--params", "1B", "--gpu", "l4", "--context", "8k", "--formats",
                   "bf16,q4", "--calibration", SMOLLM2_CAL, "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["model"]["params"] == 1e9
    assert "budget_bits_per_value" not in d["formats"][1] and 4.18 < d["formats"][1]["bits_per_value"] < 4.19


def test_calibration_and_kv_sample_change_only_their_formats_and_only_this_run(tmp_path, capsys):
    """--calibration registered every allocation the file held (one for "bf16" and "fp8" replaced the
    baselines: bf16 at 3.2 bits, 1.00x itself), and both options changed the process-wide table (a
    later run without them printed their figures); at a short context the calibration's exact bits
    (tables over few tokens) were refused as over 64 bits."""
    pytest.importorskip("torch")
    import numpy as np

    from weightszip.compact.calibrate import Calibration

    cal = Calibration.load(SMOLLM2_CAL)
    cal.allocation = dict(cal.allocation, bf16=cal.allocation["q3"], fp8=cal.allocation["q3"])
    evil = tmp_path / "evil.wzcal"
    cal.save(evil)
    kv = tmp_path / "kv.npy"
    np.save(kv, np.load(DATA / "kv_smollm2_64tok.npy").reshape(2, 3, 64, 3, 64).astype(np.uint16))
    smol = tmp_path / "config.json"  # SmolLM2-135M's shape, the calibration's model
    smol.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                                "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576, "intermediate_size": 1536,
                                "vocab_size": 49152, "tie_word_embeddings": True}))
    before = dict(capacity.FORMATS)
    base = ["capacity", "--model", smol, "--gpu", "l4", "--context", "8k", "--json"]

    def rows(*extra):
        assert run_cli(*base, *extra) == 0
        return {f["name"]: f["bits_per_value"] for f in json.loads(capsys.readouterr().out)["formats"]}

    plain = rows()
    got = rows("--calibration", evil, "--kv-sample", kv)
    assert got["bf16"] == 16 and got["fp8"] == plain["fp8"]
    assert got["q3"] != plain["q3"] and got["kv-exact"] != plain["kv-exact"]
    assert rows() == plain and capacity.FORMATS == before
    # a context so short that the tables outweigh the tokens: counted, as the budget is without it
    short = rows("--calibration", SMOLLM2_CAL, "--context", "1")
    assert short["q3"] > 64 and capacity.FORMATS == before


def test_plot_never_replaces_an_input(tmp_path, capsys):
    """--plot naming the model's config, the K/V sample or the calibration replaced it with the chart."""
    pytest.importorskip("matplotlib")
    cfg = tmp_path / "cfg.png"
    cfg.write_text(json.dumps(LLAMA_8B_CONFIG))
    text = cfg.read_text()
    assert run_cli("capacity", "--model", cfg, "--gpu", "h200", "--plot", cfg) == 1
    assert "is the input file" in capsys.readouterr().err and cfg.read_text() == text
    link = tmp_path / "link.svg"
    link.symlink_to(cfg)
    assert run_cli("capacity", "--model", cfg, "--gpu", "h200", "--plot", link) == 1
    assert cfg.read_text() == text
    (tmp_path / "d.png").mkdir()
    assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h200", "--plot", tmp_path / "d.png") == 1
    assert "directory" in capsys.readouterr().err


def test_hostile_configs_samples_and_counts(tmp_path, capsys):
    """Each was a traceback (OverflowError, ValueError, ZeroDivisionError, TypeError), a read of
    /dev/zero until memory ran out, or a hang on a FIFO: CapacityError now."""
    import os

    import numpy as np

    big = tmp_path / "big.json"
    big.write_text('{"num_parameters": ' + "9" * 5000 + "}")
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({k: v for k, v in LLAMA_8B_CONFIG.items()} | {"hidden_size": 10**400}))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, match in ((big, "not valid JSON"), (huge, "hidden_size"), (fifo, "not a regular file"),
                        ("/dev/zero", "not a regular file"), ("a\0/b.json", "cannot read")):
        with pytest.raises(CapacityError, match=match):
            compute(str(path), "h200")
    assert run_cli("capacity", "--model", big, "--gpu", "h200") == 1
    too_big = tmp_path / "too_big.json"
    with open(too_big, "wb") as f:
        f.truncate(capacity.CONFIG_MAX_BYTES + 1)
    with pytest.raises(CapacityError, match="larger than"):
        compute(str(too_big), "h200")
    empty = tmp_path / "empty.npy"
    np.save(empty, np.zeros((0, 64, 1, 32), np.int16))
    for sample in (empty, fifo):
        with pytest.raises(CapacityError):
            capacity.measure_exact_formats(capacity.load_kv_sample(str(sample)))
    nines = "9" * 320
    for flag in ("--context", "--sessions", "--gpus", "--gpus-per-node"):
        assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h200", flag, nines) == 1
        assert "at most 1e15" in capsys.readouterr().err
    for kwargs in (dict(model=123), dict(gpu=["x"]), dict(formats=5), dict(formats="bf16"), dict(formats=[None]),
                   dict(params=10**5000), dict(extra_formats={"x": 3})):
        args = dict(model="llama-3.1-8b", gpu="h200") | kwargs
        with pytest.raises(CapacityError):
            compute(args.pop("model"), args.pop("gpu"), **args)
