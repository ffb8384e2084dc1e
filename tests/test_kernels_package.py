"""The kernels in triton_kernels/ ship inside the package as weightszip.kernels: one link per module."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "triton_kernels"
PKG = ROOT / "python" / "weightszip" / "kernels"


def test_every_kernel_module_is_linked_into_the_package():
    modules = sorted(p.name for p in SRC.glob("*.py"))
    assert "paged_decode.py" in modules
    for name in modules:
        link = PKG / name
        assert link.is_symlink(), f"python/weightszip/kernels/{name} must link to triton_kernels/{name}"
        assert link.resolve() == (SRC / name).resolve()
    extra = sorted(p.name for p in PKG.glob("*.py") if not (SRC / p.name).exists())
    assert not extra, f"links without a module in triton_kernels/: {extra}"
