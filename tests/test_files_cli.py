"""Whole files through the API and the `weightszip` CLI: restored byte for byte, tensor-aware."""

import filecmp
import itertools
import json
import os
import stat
import struct
import subprocess
import sys

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


def test_fast_level_from_the_cli_and_the_api_round_trips(tmp_path, safetensors_file):
    """`weightszip compress --level 1` and save_file(level=1): same bytes back, a container any
    reader takes; --level outside 1..2 is argparse's usage error."""
    out, back = tmp_path / "m.wz", tmp_path / "back.safetensors"
    assert run_cli("compress", safetensors_file, "-o", out, "-q", "--level", "1") == 0
    assert run_cli("decompress", out, "-o", back, "-q") == 0
    assert filecmp.cmp(back, safetensors_file, shallow=False)
    with pytest.raises(SystemExit) as e:
        run_cli("compress", safetensors_file, "-o", tmp_path / "x.wz", "--level", "3")
    assert e.value.code == 2 and not (tmp_path / "x.wz").exists()
    t = {"w": np.linspace(-2, 2, 64 * 96, dtype=np.float32).reshape(64, 96), "ids": np.arange(5)}
    weightszip.save_file(t, tmp_path / "t.wz", level=1)
    got = weightszip.load_file(tmp_path / "t.wz")
    assert all(np.array_equal(got[k], v) for k, v in t.items())


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


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("command", ["compress", "info", "verify", "decompress"])
def test_inputs_that_are_not_regular_files_are_refused(tmp_path, capsys, command):
    """A FIFO (a read would block until a writer comes) and a directory are refused with one error
    line and exit 1, before anything is read or written; so is the Python API."""
    fifo = tmp_path / "pipe.wz"
    os.mkfifo(fifo)
    for src in (fifo, tmp_path):
        extra = ["-o", str(tmp_path / "out.bin")] if command == "decompress" else []
        assert run_cli(command, src, *extra) == 1
        assert "not a regular file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.wz"]
    for fn in (lambda: weightszip.compress_file(fifo, tmp_path / "x.wz"), lambda: weightszip.file_info(fifo),
               lambda: weightszip.verify_file(fifo), lambda: weightszip.load_file(fifo)):
        with pytest.raises(weightszip.InvalidArgumentError, match="not a regular file"):
            fn()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="no /proc")
def test_a_file_that_reports_no_size_but_has_data_is_refused(tmp_path, capsys):
    """/proc files report 0 bytes and then have data: compressing one would give an empty archive
    (silently losing its contents), so it is refused."""
    assert os.path.getsize("/proc/self/status") == 0
    assert run_cli("compress", "/proc/self/status", "-o", tmp_path / "s.wz") == 1
    assert "reports 0 bytes but has data" in capsys.readouterr().err
    assert not (tmp_path / "s.wz").exists()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert run_cli("compress", empty, "-q") == 0  # a truly empty file still compresses
    weightszip.decompress_file(tmp_path / "empty.wz", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == b""


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


def test_a_huge_thread_count_is_capped_not_spawned(tmp_path, safetensors_file):
    """--threads 1000000 (a typo) runs on at most the core's MAX_THREADS workers: it had spawned a
    thread a chunk and hung; a byte file and a .safetensors file (tensor-aware) still round-trip."""
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    assert run_cli("compress", p, "-q", "--threads", "1000000", "--chunk-size", 65536) == 0
    assert run_cli("decompress", tmp_path / "f.bin.wz", "-o", tmp_path / "back.bin", "-q", "--threads", "1000000") == 0
    assert (tmp_path / "back.bin").read_bytes() == data
    assert run_cli("compress", safetensors_file, "-o", tmp_path / "m.wz", "-q", "--threads", "1000000") == 0
    assert run_cli("decompress", tmp_path / "m.wz", "-o", tmp_path / "m2.safetensors", "-q") == 0
    assert filecmp.cmp(safetensors_file, tmp_path / "m2.safetensors", shallow=False)


def test_output_onto_a_directory_fails_and_leaves_no_partial_file(tmp_path, capsys):
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    (tmp_path / "out" / "sub").mkdir(parents=True)
    # (--force: past the overwrite guard, to the rename that fails)
    assert run_cli("compress", p, "-o", tmp_path / "out", "-q", "--force") == 1
    assert run_cli("compress", p, "-o", tmp_path / "f.wz", "-q") == 0
    assert run_cli("decompress", tmp_path / "f.wz", "-o", tmp_path / "out", "-q", "--force") == 1
    assert "error" in capsys.readouterr().err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.bin", "f.wz", "out"]
    # without --force, the guard refuses the existing directory before any work
    assert run_cli("compress", p, "-o", tmp_path / "out", "-q") == 1
    assert "already exists; not overwritten" in capsys.readouterr().err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.bin", "f.wz", "out"]


def test_existing_output_is_refused_without_force(tmp_path, capsys):
    """Like gzip and zstd: an output that exists (given with -o, or the default name derived from
    the input) is an error, exit status 1, and stays as it was; -f/--force overwrites it."""
    p, wz, mine = tmp_path / "f.bin", tmp_path / "f.bin.wz", tmp_path / "mine"
    p.write_bytes(b"hello, world")
    assert run_cli("compress", p, "-q") == 0  # (INPUT.wz is new: written)
    container = wz.read_bytes()
    mine.write_bytes(b"mine")
    for args, out in [(("compress", p, "-o", mine), mine), (("compress", p), wz), (("decompress", wz, "-o", mine), mine)]:
        assert run_cli(*args, "-q") == 1
        err = capsys.readouterr().err
        assert err == f"weightszip: error: {out}: already exists; not overwritten (use -f/--force to overwrite it)\n"
        assert mine.read_bytes() == b"mine" and wz.read_bytes() == container
    # --force / -f overwrite it
    wz.write_bytes(b"mine too")
    assert run_cli("compress", p, "-q", "--force") == 0
    assert wz.read_bytes() == container
    assert run_cli("compress", p, "-o", mine, "-q", "-f") == 0
    assert files.file_info(mine)["kind"] == 1
    # decompress's default output (INPUT without .wz) is the original, usually still there
    p.write_bytes(b"changed")
    assert run_cli("decompress", str(p) + ".wz", "-q") == 1
    assert "already exists" in capsys.readouterr().err and p.read_bytes() == b"changed"
    assert run_cli("decompress", str(p) + ".wz", "-q", "-f") == 0
    assert p.read_bytes() == b"hello, world"
    # a tensor archive (written as a .safetensors file) too
    weightszip.save_file({"i": np.arange(3, dtype=np.int32)}, tmp_path / "a.wz")
    mine.write_bytes(b"mine")
    assert run_cli("decompress", tmp_path / "a.wz", "-o", mine, "-q") == 1
    assert mine.read_bytes() == b"mine"
    assert run_cli("decompress", tmp_path / "a.wz", "-o", mine, "-q", "--force") == 0
    assert st_load(str(mine))["i"].tolist() == [0, 1, 2]
    assert not list(tmp_path.glob("*partial*"))


@pytest.mark.parametrize("how", ["same path", "dot dot", "symlink", "hard link"])
def test_output_that_is_the_input_is_refused_even_with_force(tmp_path, capsys, how):
    """`compress f -o f` (or through a link, or a path that resolves to it) used to replace the
    input with its own compressed form; now it is refused, exit status 1, --force or not."""
    p = tmp_path / "f.bin"
    p.write_bytes(b"precious")
    (tmp_path / "sub").mkdir()
    out = {"same path": p, "dot dot": tmp_path / "sub" / ".." / "f.bin", "symlink": tmp_path / "link",
           "hard link": tmp_path / "hard"}[how]
    if how == "symlink":
        out.symlink_to(p)
    elif how == "hard link":
        out.hardlink_to(p)
    for force in ([], ["--force"], ["-f"]):
        assert run_cli("compress", p, "-o", out, "-q", *force) == 1
        assert capsys.readouterr().err == (f"weightszip: error: {out}: is the input file {p}; "
                                           "not overwritten (not even with --force)\n")
        assert p.read_bytes() == b"precious"
    wz = tmp_path / "f.wz"
    assert run_cli("compress", p, "-o", wz, "-q") == 0
    assert run_cli("decompress", wz, "-o", wz, "-q", "--force") == 1
    assert "is the input file" in capsys.readouterr().err
    assert files.file_info(wz)["kind"] == 1
    assert not list(tmp_path.glob("*partial*"))


def test_help_describes_the_overwrite_guard(capsys):
    for cmd in ("compress", "decompress"):
        with pytest.raises(SystemExit):
            run_cli(cmd, "--help")
        text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # (argparse wraps lines at hyphens)
        assert "-f, --force" in text and "not overwritten" in text and ".wz-partial" in text
        assert "permission mode" in text and "130" in text


@pytest.mark.parametrize("cmd", [["kv", "dump", "--tokens", "16"], ["calibrate"]])
def test_kv_dump_and_calibrate_refuse_an_existing_output_before_any_work(tmp_path, capsys, cmd):
    """The other subcommands that write an -o OUTPUT refuse it the same way (exit status 2, as
    their other errors), before the model is loaded: nothing is read or written."""
    text = tmp_path / "book.txt"
    text.write_text("call me Ishmael. " * 10)
    args = [*cmd, "--model", "no-such-model", "--text", text]
    assert run_cli(*args, "-o", text, "--force") == 2
    assert "is the input file" in capsys.readouterr().err
    assert text.read_text() == "call me Ishmael. " * 10
    (tmp_path / "out.wz").write_bytes(b"mine")
    assert run_cli(*args, "-o", tmp_path / "out.wz") == 2
    assert "already exists; not overwritten" in capsys.readouterr().err
    assert (tmp_path / "out.wz").read_bytes() == b"mine"
    # with --force the guard lets it through (and the unknown model is the error)
    assert run_cli(*args, "-o", tmp_path / "out.wz", "--force") == 2
    assert "already exists" not in capsys.readouterr().err


def test_calibrate_and_capacity_refuse_bad_outputs_before_any_work(tmp_path, capsys):
    """Found by session 37's review: calibrate's --seed -1 was numpy's traceback, -o "" and -o into a
    file-as-folder failed only after calibrating; capacity's --plot x.xyz was matplotlib's traceback
    after the work (and a path without a suffix was written as PATH.png, reported as PATH)."""
    text = tmp_path / "book.txt"
    text.write_text("call me Ishmael. " * 10)
    (tmp_path / "file").write_text("x")
    cal = ["calibrate", "--model", "no-such-model", "--text", text]
    for extra, why in ((["--seed", "-1", "-o", tmp_path / "c.wzcal"], "--seed"), (["-o", ""], "empty"),
                       (["-o", tmp_path / "file" / "c.wzcal"], "not a folder")):
        assert run_cli(*cal, *extra) == 2
        assert why in capsys.readouterr().err
    assert run_cli(*cal, "-o", tmp_path / "new" / "c.wzcal") == 2  # a missing folder is made: the model's error
    assert "no-such-model" in capsys.readouterr().err and (tmp_path / "new").is_dir()
    for plot in ("x.xyz", "x.json", "noext"):
        assert run_cli("capacity", "--model", "llama-3.1-8b", "--gpu", "h100", "--plot", tmp_path / plot) == 1
        assert ".png" in capsys.readouterr().err
        assert not list(tmp_path.glob(plot + "*"))


def test_temporary_files_never_touch_a_file_of_a_fixed_name(tmp_path):
    """The writers (the Rust core's, and a Python one for tensor archives until session 28) used fixed
    temporary names (.NAME.wz-partial, NAME.wz-partial), truncating and renaming away a user's file
    of that name; now each takes a new file of a unique name, created exclusively."""
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 50)
    weightszip.save_file({"i": np.arange(3, dtype=np.int32)}, tmp_path / "a.wz")
    mine = {n: f"mine: {n}".encode() for n in [".f.wz.wz-partial", "f.wz.wz-partial", ".back.bin.wz-partial",
                                             "back.bin.wz-partial", ".a.safetensors.wz-partial",
                                             "a.safetensors.wz-partial"]}
    for n, b in mine.items():
        (tmp_path / n).write_bytes(b)
    assert run_cli("compress", p, "-o", tmp_path / "f.wz", "-q") == 0
    assert run_cli("decompress", tmp_path / "f.wz", "-o", tmp_path / "back.bin", "-q") == 0
    assert run_cli("decompress", tmp_path / "a.wz", "-o", tmp_path / "a.safetensors", "-q") == 0
    assert (tmp_path / "back.bin").read_bytes() == p.read_bytes()
    assert st_load(str(tmp_path / "a.safetensors"))["i"].tolist() == [0, 1, 2]
    for n, b in mine.items():
        assert (tmp_path / n).read_bytes() == b
    made = {"f.bin", "a.wz", "f.wz", "back.bin", "a.safetensors"}
    assert {x.name for x in tmp_path.iterdir()} == made | set(mine)


def test_a_damaged_tensor_archive_leaves_no_safetensors_file(tmp_path, capsys):
    """A tensor archive is written as a .safetensors file by the core's streaming writer: a chunk that
    fails its checksum part-way leaves neither the output nor a temporary file."""
    src = tmp_path / "a.wz"
    weightszip.save_file({"a": np.arange(50_000, dtype=np.float32), "b": np.arange(50_000, dtype=np.int32)}, src,
                         chunk_bytes=4096)
    b = bytearray(src.read_bytes())
    last = weightszip.file_info(src)["entries"][-1]
    assert last["name"] == "b" and last["chunks"] > 1
    b[len(b) // 2] ^= 1  # (in entry "b"'s chunks, after "a" has been written out)
    src.write_bytes(bytes(b))
    assert run_cli("decompress", src, "-o", tmp_path / "a.safetensors", "-q") == 1
    assert "ChecksumMismatchError" in capsys.readouterr().err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.wz"]


def _racing_refusal(monkeypatch, theirs: bytes):
    """Make the CLI's existence check pass, then create its output, as another program might
    between the check and the end of the write."""
    real = cli._refused

    def refused(output, inputs, force):
        if real(output, inputs, force):
            return True
        with open(output, "wb") as f:
            f.write(theirs)
        return False

    monkeypatch.setattr(cli, "_refused", refused)


@pytest.mark.parametrize("what", ["compress", "decompress file", "decompress tensors"])
def test_an_output_created_after_the_check_is_not_replaced_without_force(tmp_path, capsys, monkeypatch, what):
    """Without --force the output is published with no-replace semantics (a hard link, not a rename
    after a check): a file created at OUTPUT after the existence check, while the output was being
    written, is left as it is, with the same one-line error and exit status 1. --force replaces it."""
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 100)
    assert run_cli("compress", p, "-o", tmp_path / "f.wz", "-q") == 0
    weightszip.save_file({"i": np.arange(3, dtype=np.int32)}, tmp_path / "a.wz")
    args = {"compress": ["compress", p], "decompress file": ["decompress", tmp_path / "f.wz"],
            "decompress tensors": ["decompress", tmp_path / "a.wz"]}[what]
    out = tmp_path / "out"
    _racing_refusal(monkeypatch, b"theirs")
    assert run_cli(*args, "-o", out, "-q") == 1
    assert capsys.readouterr().err == (f"weightszip: error: {out}: already exists; not overwritten "
                                       "(use -f/--force to overwrite it)\n")
    assert out.read_bytes() == b"theirs"
    assert not list(tmp_path.glob("*partial*"))
    assert run_cli(*args, "-o", out, "-q", "--force") == 0
    assert out.read_bytes() != b"theirs"
    assert not list(tmp_path.glob("*partial*"))


def test_the_api_writers_refuse_an_existing_output_with_overwrite_false(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    mine = tmp_path / "mine"
    mine.write_bytes(b"mine")
    weightszip.save_file({"i": np.arange(3, dtype=np.int32)}, tmp_path / "a.wz")
    calls = [lambda: weightszip.compress_file(p, mine, overwrite=False),
             lambda: weightszip.decompress_file(tmp_path / "a.wz", mine, overwrite=False),
             lambda: weightszip.save_file({"i": np.arange(3)}, mine, overwrite=False)]
    for call in calls:
        with pytest.raises(weightszip.OutputExistsError, match="already exists; not overwritten"):
            call()
        assert mine.read_bytes() == b"mine"
    # a dangling symbolic link is a taken name too (the Python writer's; the Rust one's in its tests)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(weightszip.OutputExistsError):
        weightszip.decompress_file(tmp_path / "a.wz", tmp_path / "link", overwrite=False)
    assert not (tmp_path / "nowhere").exists()
    # a free name is written; the default (overwrite=True) replaces, as before
    weightszip.decompress_file(tmp_path / "a.wz", tmp_path / "new.safetensors", overwrite=False)
    assert st_load(str(tmp_path / "new.safetensors"))["i"].tolist() == [0, 1, 2]
    weightszip.compress_file(p, mine)
    assert weightszip.file_info(mine)["kind"] == 1
    assert not list(tmp_path.glob("*partial*"))


@pytest.mark.parametrize("what", ["compress", "decompress file", "decompress tensors"])
def test_force_keeps_the_mode_of_the_file_it_replaces(tmp_path, what):
    """Like gzip -f: the replaced file's permission bits are kept (not reset to 0o666 less umask)."""
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    assert run_cli("compress", p, "-o", tmp_path / "f.wz", "-q") == 0
    weightszip.save_file({"i": np.arange(3, dtype=np.int32)}, tmp_path / "a.wz")
    args = {"compress": ["compress", p], "decompress file": ["decompress", tmp_path / "f.wz"],
            "decompress tensors": ["decompress", tmp_path / "a.wz"]}[what]
    out = tmp_path / "out"
    out.write_bytes(b"old")
    out.chmod(0o640)
    assert run_cli(*args, "-o", out, "-q", "-f") == 0
    assert out.read_bytes() != b"old" and stat.S_IMODE(out.stat().st_mode) == 0o640
    out.chmod(0o604)
    assert run_cli(*args, "-o", out, "-q", "-f") == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o604


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not os.path.exists(f"/proc/{child.pid}")
    return child.pid


@pytest.mark.skipif(not os.path.exists("/proc/self"), reason="stale temporary files are found through /proc (Linux)")
@pytest.mark.parametrize("what", ["compress", "decompress tensors"])
def test_temporary_files_of_a_killed_run_are_removed_by_the_next(tmp_path, what):
    """A run killed with SIGKILL leaves its full-size temporary file; the next run writing that
    output removes it (its PID no longer runs), for a file and for a tensor archive (written as a
    .safetensors file); live writers' files and other names are left alone."""
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    weightszip.save_file({"i": np.arange(3, dtype=np.int32)}, tmp_path / "a.wz")
    args = {"compress": ["compress", p], "decompress tensors": ["decompress", tmp_path / "a.wz"]}[what]
    dead, me = _dead_pid(), os.getpid()
    stale = [f".out.{dead}.0.0123abcd.wz-partial", f".out.{dead}.12.ffffffff.wz-partial"]
    kept = [f".out.{me}.3.0123abcd.wz-partial", ".out.1.3.0123abcd.wz-partial", f".out.1.{dead}.0.0123abcd.wz-partial",
            f".out.{dead}.0123abcd.wz-partial", f"out.{dead}.0.0123abcd.wz-partial", f".other.{dead}.0.0123abcd.wz-partial"]
    for n in stale + kept:
        (tmp_path / n).write_bytes(b"partial")
    assert run_cli(*args, "-o", tmp_path / "out", "-q") == 0
    assert {x.name for x in tmp_path.glob("*partial*")} == set(kept)


def test_a_killed_run_leaves_a_temporary_file_that_the_next_run_removes(tmp_path):
    """The real thing: `weightszip compress` killed (SIGKILL) mid-write, then run again."""
    if not os.path.exists("/proc/self"):
        pytest.skip("stale temporary files are found through /proc (Linux)")
    import signal
    import time

    p = tmp_path / "f.bin"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 96 << 20, dtype=np.uint8).tobytes())
    out = tmp_path / "f.wz"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(weightszip.__file__)),
                                                         os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-m", "weightszip.cli", "compress", str(p), "-o", str(out), "-q",
                              "--threads", "1"], env=env)
    try:
        for _ in range(600):
            if list(tmp_path.glob(".f.wz.*.wz-partial")) or child.poll() is not None:
                break
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    if out.exists():
        pytest.skip("the run finished before it could be killed")
    assert len(list(tmp_path.glob(".f.wz.*.wz-partial"))) == 1
    assert run_cli("compress", p, "-o", out, "-q") == 0
    assert not list(tmp_path.glob("*partial*"))


@pytest.mark.parametrize("cmd", [["compress", "f"], ["decompress", "f.wz"], ["verify", "f.wz"], ["demo"],
                                 ["calibrate", "--model", "m", "--text", "t", "-o", "o"],
                                 ["eval", "kl", "--model", "m", "--format", "q4", "--text", "t", "--window", "8"],
                                 ["eval", "niah", "--model", "m", "--length", "2k"],
                                 ["kv", "dump", "--model", "m", "--text", "t", "--tokens", "8", "-o", "o"]])
def test_thread_counts_are_checked_and_capped_everywhere(capsys, cmd):
    """--threads of every command: negative or not a number is a usage error (exit 2); one above
    the core's cap of 256 is taken as 256 (a 23-digit one was an OverflowError traceback, and the
    torch commands passed any count to torch.set_num_threads)."""
    parser = cli.build_parser()
    assert weightszip._core.MAX_THREADS == 256
    assert parser.parse_args([*cmd, "--threads", "99999999999999999999999"]).threads == 256
    assert parser.parse_args([*cmd, "--threads", "3"]).threads == 3
    for bad in ("-1", "x"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([*cmd, "--threads", bad])
        assert e.value.code == 2 and "--threads" in capsys.readouterr().err


def test_huge_counts_are_usage_errors_or_capped(tmp_path, capsys):
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    assert run_cli("compress", p, "-q", "--threads", "99999999999999999999999") == 0
    assert run_cli("decompress", tmp_path / "f.bin.wz", "-o", tmp_path / "b", "-q", "--threads", "1" + "0" * 30) == 0
    assert (tmp_path / "b").read_bytes() == b"hello"
    with pytest.raises(SystemExit) as e:
        run_cli("compress", p, "-o", tmp_path / "g.wz", "-q", "--chunk-size", "99999999999999999999999")
    assert e.value.code == 2 and "must be at most" in capsys.readouterr().err
    # (the library takes a huge count as the cap too)
    assert weightszip.decompress(weightszip.compress(np.arange(4), threads=10**30), threads=10**30).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("change", ["append", "truncate", "rewrite"])
def test_a_file_changed_while_being_compressed_is_an_error_and_no_output(tmp_path, change):
    """A file written while compress reads it (a checkpoint still being saved) was archived as the
    bytes that happened to be there: a prefix when it grew, silently. Now a WeightszipIOError and no
    output. The change is made from the progress callback, which runs before the first read."""
    src, dst = tmp_path / "data.bin", tmp_path / "data.wz"
    src.write_bytes(np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes())
    os.utime(src, (1_000_000_000, 1_000_000_000))  # an old mtime, so that a rewrite moves it
    calls = []

    def progress(done, total):
        if not calls:
            if change == "append":
                with open(src, "ab") as f:
                    f.write(b"more")
            elif change == "truncate":
                os.truncate(src, 1000)
            else:
                with open(src, "r+b") as f:
                    f.seek(200_000)
                    f.write(b"\0" * 16)
        calls.append(done)

    with pytest.raises(weightszip.WeightszipIOError, match="changed while being compressed"):
        files.compress_file(src, dst, progress=progress)
    assert calls and not dst.exists() and list(tmp_path.iterdir()) == [src]


def _interrupt_at_second_call(what):
    """A progress callback that interrupts the run at its second call (the first comes before any
    chunk): raises KeyboardInterrupt or SystemExit, or sends this process SIGINT (Python's handler
    raises KeyboardInterrupt), or raises an ordinary error (printed; the work goes on)."""
    import signal

    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == 2:
            if what == "KeyboardInterrupt":
                raise KeyboardInterrupt
            if what == "SystemExit":
                raise SystemExit(3)
            if what == "SIGINT":
                os.kill(os.getpid(), signal.SIGINT)
            if what == "ValueError":
                raise ValueError("an ordinary error of the callback")

    return progress, calls


@pytest.mark.parametrize("what", ["KeyboardInterrupt", "SystemExit", "SIGINT"])
@pytest.mark.parametrize("call", ["compress_file", "decompress_file", "decompress_file tensors", "verify_file"])
def test_an_interrupt_stops_the_codec_and_leaves_no_file(tmp_path, what, call):
    """Ctrl-C while Rust works reaches Python only in the progress callback: it was printed and
    swallowed, so the run went on and published its output. Now the codec stops, its temporary file
    is removed, nothing is published, and the interrupt is raised."""
    import signal

    # Python's own SIGINT handler, as in a terminal: a job started in the background of a
    # non-interactive shell (a CI runner) inherits SIGINT ignored, and Python then installs none
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _run_interrupt_case(tmp_path, what, call)
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_interrupt_case(tmp_path, what, call):
    p = tmp_path / "f.bin"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    files.compress_file(p, tmp_path / "f.wz", chunk_bytes=1 << 14)
    weightszip.save_file({"a": np.arange(1 << 18, dtype=np.int32)}, tmp_path / "t.wz", chunk_bytes=1 << 14)
    before = sorted(x.name for x in tmp_path.iterdir())
    progress, calls = _interrupt_at_second_call(what)
    run = {"compress_file": lambda: files.compress_file(p, tmp_path / "out", chunk_bytes=1 << 14, threads=1,
                                                        progress=progress),
           "decompress_file": lambda: files.decompress_file(tmp_path / "f.wz", tmp_path / "out", threads=1,
                                                            progress=progress),
           "decompress_file tensors": lambda: files.decompress_file(tmp_path / "t.wz", tmp_path / "out", threads=1,
                                                                    progress=progress),
           "verify_file": lambda: files.verify_file(tmp_path / "f.wz", threads=1, progress=progress)}[call]
    with pytest.raises(SystemExit if what == "SystemExit" else KeyboardInterrupt):
        run()
    assert len(calls) == 2, "stopped at once"
    assert sorted(x.name for x in tmp_path.iterdir()) == before


def test_an_ordinary_error_of_the_progress_callback_is_printed_and_the_work_goes_on(tmp_path, capsys):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 1000)
    progress, calls = _interrupt_at_second_call("ValueError")
    files.compress_file(p, tmp_path / "f.wz", chunk_bytes=1 << 12, threads=1, progress=progress)
    assert len(calls) > 2 and "an ordinary error of the callback" in capsys.readouterr().err
    files.decompress_file(tmp_path / "f.wz", tmp_path / "g.bin")
    assert (tmp_path / "g.bin").read_bytes() == p.read_bytes()


@pytest.mark.parametrize("cmd", ["compress", "decompress", "verify"])
def test_ctrl_c_in_the_cli_exits_130_with_one_line_and_no_output(tmp_path, capsys, monkeypatch, cmd):
    p = tmp_path / "f.bin"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    assert run_cli("compress", p, "-o", tmp_path / "f.wz", "-q", "--chunk-size", 1 << 14) == 0
    before = sorted(x.name for x in tmp_path.iterdir())
    progress, calls = _interrupt_at_second_call("KeyboardInterrupt")
    monkeypatch.setattr(cli._Progress, "__call__", lambda self, done, total: progress(done, total))
    args = {"compress": ["compress", p, "-o", tmp_path / "out", "--chunk-size", 1 << 14],
            "decompress": ["decompress", tmp_path / "f.wz", "-o", tmp_path / "out"],
            "verify": ["verify", tmp_path / "f.wz"]}[cmd]
    assert run_cli(*args, "-q", "--threads", 1) == 130
    assert capsys.readouterr().err == "weightszip: interrupted\n"
    assert len(calls) == 2 and sorted(x.name for x in tmp_path.iterdir()) == before


def test_a_tensor_archive_decompresses_streaming_with_progress(tmp_path):
    """A tensor archive is written as .safetensors by the core's streaming writer: its header, then
    the entries' bytes in order (the data section), reporting progress (the bar stayed at 0% while
    each whole tensor was decoded into memory); the file is the one safetensors reads back."""
    t = {"w": np.arange(300_000, dtype=np.float32).reshape(600, 500), "e": np.zeros((0, 3), np.int8),
         "b": (np.arange(7) % 2).astype(bool), "z": np.float16(1.5).reshape(())}
    weightszip.save_file(t, tmp_path / "t.wz", chunk_bytes=1 << 15)
    calls = []
    index = files.decompress_file(tmp_path / "t.wz", tmp_path / "t.safetensors", threads=1,
                                  progress=lambda d, n: calls.append((d, n)))
    raw = sum(e["raw_bytes"] for e in index["entries"])
    assert calls[0] == (0, raw) and calls[-1] == (raw, raw) and len(calls) > 3
    back = st_load(str(tmp_path / "t.safetensors"))
    assert list(back) == list(t) or sorted(back) == sorted(t)
    for k, v in t.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and (back[k] == v).all()
    (n,) = struct.unpack("<Q", (tmp_path / "t.safetensors").read_bytes()[:8])
    assert (tmp_path / "t.safetensors").stat().st_size == 8 + n + raw


@pytest.mark.parametrize("how", ["same path", "dot dot", "symlink", "hard link"])
def test_the_api_writers_never_replace_their_input(tmp_path, how):
    """compress_file(p, p) replaced a model file with its .wz (and decompress_file(w, w) a container
    with its output), silently: now InvalidArgumentError, the input untouched, as the CLI refuses it."""
    p = tmp_path / "f.bin"
    p.write_bytes(b"precious" * 100)
    w = tmp_path / "f.wz"
    files.compress_file(p, w)
    container = w.read_bytes()
    (tmp_path / "sub").mkdir()
    for src in (p, w):
        out = {"same path": src, "dot dot": tmp_path / "sub" / ".." / src.name, "symlink": tmp_path / "link",
               "hard link": tmp_path / "hard"}[how]
        if how == "symlink":
            out.symlink_to(src)
        elif how == "hard link":
            out.hardlink_to(src)
        call = files.compress_file if src == p else files.decompress_file
        with pytest.raises(weightszip.InvalidArgumentError, match="is the input file"):
            call(src, out)
        if how in ("symlink", "hard link"):
            out.unlink()
    assert p.read_bytes() == b"precious" * 100 and w.read_bytes() == container
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.bin", "f.wz", "sub"]


@pytest.mark.parametrize("what", ["compress", "decompress file", "decompress tensors"])
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755])
def test_outputs_keep_the_input_permission_bits(tmp_path, what, mode):
    """Like gzip and zstd: a 0600 checkpoint's .wz (and the file restored from it) was 0644 (0666 less
    the umask), readable by every user; the output now gets the input's permission bits, through the
    CLI and the API (with --force / overwrite, a file replaced keeps its own: see above)."""
    p = tmp_path / "f.bin"
    p.write_bytes(b"secret" * 100)
    files.compress_file(p, tmp_path / "f.wz")
    weightszip.save_file({"i": np.arange(3, dtype=np.int32)}, tmp_path / "a.wz")
    src = {"compress": p, "decompress file": tmp_path / "f.wz", "decompress tensors": tmp_path / "a.wz"}[what]
    src.chmod(mode)
    cmd = "compress" if what == "compress" else "decompress"
    assert run_cli(cmd, src, "-o", tmp_path / "cli.out", "-q") == 0
    (files.compress_file if what == "compress" else files.decompress_file)(src, tmp_path / "api.out")
    for out in ("cli.out", "api.out"):
        assert stat.S_IMODE((tmp_path / out).stat().st_mode) == mode, out


@pytest.mark.parametrize("cmd", ["compress", "decompress"])
def test_an_empty_output_path_is_a_usage_error(tmp_path, capsys, cmd):
    """`compress f -o ''` (-o "$OUT" with OUT unset) wrote f.wz, a place the user did not name, and
    reported success; now argparse's usage error (exit status 2), nothing written."""
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    assert run_cli("compress", p, "-o", tmp_path / "f.wz", "-q") == 0
    with pytest.raises(SystemExit) as e:
        run_cli(cmd, p if cmd == "compress" else tmp_path / "f.wz", "-o", "", "-q")
    assert e.value.code == 2 and "empty path" in capsys.readouterr().err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.bin", "f.wz"]


def test_info_escapes_names_that_are_not_printable(tmp_path, capsys):
    """A tensor name from a hostile file reached the terminal raw: escape sequences (window title,
    colours) and a newline that forged a table line. `info` prints such names escaped."""
    name = "\x1b]0;pwned\x07\x1b[31mRED\nfake line"
    st_save({name: torch.zeros(4), "plain.weight": torch.ones(2)}, str(tmp_path / "esc.safetensors"))
    assert run_cli("compress", tmp_path / "esc.safetensors", "-o", tmp_path / "esc.wz", "-q") == 0
    capsys.readouterr()
    assert run_cli("info", tmp_path / "esc.wz", "--all") == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "fake line" not in out.splitlines()[-1]
    lines = out.splitlines()
    assert len(lines) == 3 + len(files.file_info(tmp_path / "esc.wz")["entries"])  # (3 lines, then one per entry)
    assert any(line.lstrip().startswith("\\x1b]0;pwned\\x07") for line in lines)
    assert any(line.lstrip().startswith("plain.weight ") for line in lines)


def test_io_errors_name_the_file(tmp_path, capsys):
    """The core's I/O errors said only 'No such file or directory': now they name the input or output."""
    p = tmp_path / "f.bin"
    p.write_bytes(b"hello")
    (tmp_path / "d1").mkdir()
    for args, path in [(["compress", p, "-o", tmp_path / "nodir" / "x.wz"], tmp_path / "nodir" / "x.wz"),
                       (["info", tmp_path / "nonexist"], tmp_path / "nonexist"),
                       (["verify", tmp_path / "nonexist", "-q"], tmp_path / "nonexist"),
                       (["compress", p, "-o", tmp_path / "d1", "-f"], tmp_path / "d1"),
                       (["compress", tmp_path / "nonexist"], tmp_path / "nonexist")]:
        assert run_cli(*args) == 1
        err = capsys.readouterr().err
        assert err.startswith("weightszip: error:") and f"{path}:" in err and len(err.splitlines()) == 1, err
    with pytest.raises(weightszip.WeightszipIOError, match=str(tmp_path / "nonexist")):
        files.compress_file(tmp_path / "nonexist", tmp_path / "x.wz")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["d1", "f.bin"]

