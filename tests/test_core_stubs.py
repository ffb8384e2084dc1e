"""python/weightszip/_core.pyi against the compiled module: every function and method the stub
declares takes the parameters the Rust side declares (names, order, which have defaults), and the
stub declares every function and constant the module has. A type checker trusts the stub, so a
parameter added in Rust and missing there (as ``level`` was) reads as a type error to users."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from weightszip import _core

STUB = Path(__file__).resolve().parents[1] / "python" / "weightszip" / "_core.pyi"


def _stub():
    tree = ast.parse(STUB.read_text())
    funcs, consts, classes = {}, set(), {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            funcs[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            consts.add(node.target.id)
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    return funcs, consts, classes


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, bool]]:
    """(name, has a default) of each parameter, ``self`` left out."""
    args = fn.args.args
    first_default = len(args) - len(fn.args.defaults)
    return [(a.arg, i >= first_default) for i, a in enumerate(args) if a.arg != "self"]


def _module_params(obj) -> list[tuple[str, bool]]:
    sig = inspect.signature(obj)  # from PyO3's __text_signature__
    return [(p.name, p.default is not inspect.Parameter.empty) for p in sig.parameters.values()
            if p.name not in ("self", "$self")]


def test_stub_functions_take_the_compiled_parameters():
    funcs, _, classes = _stub()
    module_funcs = {n for n in dir(_core) if not n.startswith("_") and inspect.isbuiltin(getattr(_core, n))}
    assert set(funcs) == module_funcs, (sorted(set(funcs) ^ module_funcs))
    for name, node in funcs.items():
        assert _stub_params(node) == _module_params(getattr(_core, name)), name
    for cls, methods in classes.items():
        if not methods:  # the exception classes
            continue
        for name, node in methods.items():
            obj = getattr(_core, cls) if name == "__init__" else getattr(getattr(_core, cls), name)
            assert _stub_params(node) == _module_params(obj), f"{cls}.{name}"


def test_stub_declares_every_constant():
    _, consts, _ = _stub()
    module_consts = {n for n in dir(_core) if n.isupper() and isinstance(getattr(_core, n), int)}
    assert module_consts <= consts, sorted(module_consts - consts)
    assert all(hasattr(_core, c) for c in consts), sorted(c for c in consts if not hasattr(_core, c))
