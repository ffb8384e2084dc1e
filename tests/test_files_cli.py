"""Whole files through the API and the `weightszip` CLI: restored byte for byte, tensor-aware."""

import filecmp
import json
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as st_load
from safetensors.torch import save_file as st_save

import weightszip
from weightszip import cli, files


def run_cli(*args) -> int:
    return cli.main([str(a) for a in args])


@pytest.fixture
def safetensors_file(tmp_path, real_kv):
    p = tmp_path / "model.safetensors"
    st_save(
        {
            "k": torch.from_numpy(np.ascontiguousarray(real_kv[0])).view(torch.bfloat16),
            "w32": torch.randn(33, 17, generator=torch.Generator().manual_seed(1)),
            "ids": torch.arange(5),
        },
        str(p),
        metadata={"format": "pt"},
    )
    return p


def write_gguf(path, tensors):
    """A minimal GGUF v3: one metadata string, tensors given as (name, ggml type, dims, bytes)."""
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1)
    head += s("general.architecture") + struct.pack("<I", 8) + s("llama")
    offset, infos, blobs = 0, b"", []
    for name, gtype, dims, data in tensors:
        infos += s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        infos += struct.pack("<IQ", gtype, offset)
        pad = -len(data) % 32
        blobs.append(data + bytes(pad))
        offset += len(data) + pad
    body = head + infos
    body += bytes(-len(body) % 32)
    path.write_bytes(body + b"".join(blobs))


def test_safetensors_round_trip_is_byte_exact_and_tensor_aware(tmp_path, safetensors_file):
    out = tmp_path / "m.wz"
    assert run_cli("compress", safetensors_file, "-o", out, "-q") == 0
    index = files.file_info(out)
    dtypes = {e["name"]: e["dtype"] for e in index["entries"]}
    assert dtypes["k"] == "bfloat16" and dtypes["w32"] == "float32" and dtypes["ids"] == "int64"
    assert run_cli("verify", out, "-q") == 0
    back = tmp_path / "back.safetensors"
    assert run_cli("decompress", out, "-o", back, "-q") == 0
    assert filecmp.cmp(back, safetensors_file, shallow=False)


def test_gguf_float_tensors_are_coded_as_tensors(tmp_path, real_kv):
    k = np.ascontiguousarray(real_kv[0, 0]).view(ml_dtypes.bfloat16).astype(np.float32)
    q = bytes(range(256)) * 10  # stands in for Q4_1 blocks (20 bytes each)
    g = tmp_path / "m.gguf"
    write_gguf(g, [("blk.0.w", 0, [192, 64], k.tobytes()), ("blk.0.q", 3, [256, 2], q[:2000]), ("n", 1, [7], bytes(14))])
    kind, segs = files.file_segments(g)
    assert kind == "gguf"
    assert ("blk.0.w", "float32", [64, 192]) in [(s[0], s[1], s[2]) for s in segs]
    assert ("n", "float16", [7]) in [(s[0], s[1], s[2]) for s in segs]
    out, back = tmp_path / "m.wz", tmp_path / "back.gguf"
    weightszip.compress_file(g, out)
    weightszip.decompress_file(out, back)
    assert filecmp.cmp(g, back, shallow=False)


def test_npy_file_is_tensor_aware(tmp_path, real_kv):
    p = tmp_path / "kv.npy"
    np.save(p, real_kv)
    kind, segs = files.file_segments(p)
    assert kind == "npy" and segs[1][1] == "uint16" and segs[1][2] == list(real_kv.shape)
    weightszip.compress_file(p, tmp_path / "kv.wz")
    weightszip.decompress_file(tmp_path / "kv.wz", tmp_path / "back.npy")
    assert filecmp.cmp(p, tmp_path / "back.npy", shallow=False)


@pytest.mark.parametrize("payload", [b"", b"x", bytes(range(256)) * 3, b"GGUF\x03\x00\x00\x00garbage", b"\x10" + bytes(7) + b"{nope"])
def test_any_file_round_trips(tmp_path, payload):
    p = tmp_path / "f.bin"
    p.write_bytes(payload)
    assert run_cli("compress", p, "-q") == 0
    assert run_cli("decompress", str(p) + ".wz", "-o", tmp_path / "g.bin", "-q") == 0
    assert (tmp_path / "g.bin").read_bytes() == payload


def test_info_json(tmp_path, safetensors_file, capsys):
    out = tmp_path / "m.wz"
    run_cli("compress", safetensors_file, "-o", out, "-q")
    capsys.readouterr()
    assert run_cli("info", out, "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "file" and info["format_version"] == 1
    assert info["container_bytes"] == out.stat().st_size
    assert sum(e["raw_bytes"] for e in info["entries"]) == safetensors_file.stat().st_size


def test_damaged_container_fails_with_typed_error_and_no_output(tmp_path, safetensors_file, capsys):
    out = tmp_path / "m.wz"
    run_cli("compress", safetensors_file, "-o", out, "-q")
    b = bytearray(out.read_bytes())
    b[100] ^= 1
    out.write_bytes(bytes(b))
    assert run_cli("verify", out, "-q") == 1
    assert "ChecksumMismatchError" in capsys.readouterr().err
    assert run_cli("decompress", out, "-o", tmp_path / "x", "-q") == 1
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob("*partial*"))


def test_progress_bar_on_large_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "PROGRESS_MIN_BYTES", 0)
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(3 << 20))
    assert run_cli("compress", p, "--chunk-size", 65536) == 0
    assert "compress" in capsys.readouterr().err


def test_tensor_archive_decompresses_to_safetensors(tmp_path, real_kv):
    k = np.ascontiguousarray(real_kv[1]).view(ml_dtypes.bfloat16)
    weightszip.save_file({"v": k, "i": np.arange(3, dtype=np.int32)}, tmp_path / "a.wz")
    assert run_cli("decompress", tmp_path / "a.wz", "-o", tmp_path / "a.safetensors", "-q") == 0
    loaded = st_load(str(tmp_path / "a.safetensors"))
    assert loaded["i"].tolist() == [0, 1, 2]
    assert loaded["v"].shape == k.shape


def test_missing_input_exits_nonzero(tmp_path, capsys):
    assert run_cli("info", tmp_path / "missing.wz") == 1
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("args", [("--threads", "-1"), ("--chunk-size", "-5")])
def test_negative_counts_are_usage_errors(tmp_path, capsys, args):
    """A negative --threads / --chunk-size is argparse's usage error (exit 2), not an OverflowError
    traceback from the core's unsigned arguments."""
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    with pytest.raises(SystemExit) as e:
        run_cli("compress", p, "-q", *args)
    assert e.value.code == 2 and ">= 0" in capsys.readouterr().err
    assert not (tmp_path / "f.bin.wz").exists()


def test_output_onto_a_directory_fails_and_leaves_no_partial_file(tmp_path, capsys):
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    (tmp_path / "out" / "sub").mkdir(parents=True)
    assert run_cli("compress", p, "-o", tmp_path / "out", "-q") == 1
    assert run_cli("compress", p, "-o", tmp_path / "f.wz", "-q") == 0
    assert run_cli("decompress", tmp_path / "f.wz", "-o", tmp_path / "out", "-q") == 1
    assert "error" in capsys.readouterr().err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.bin", "f.wz", "out"]
