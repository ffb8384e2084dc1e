"""`ChunkStore` options given in a serving framework's config (SGLang's HiCache extra config,
LMCache's ``extra_config``): one parser, so both integrations take every `StoreConfig` option under
its own name, read yes/no values one way, and refuse a key they do not know (a misspelt option
silently left at its default is worse than an error). Framework-free."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from weightszip import _core
from weightszip._tensors import check_level
from weightszip.errors import InvalidArgumentError
from weightszip.store import StoreConfig

#: The options a config may give, as `ChunkStore` names them (new StoreConfig fields come along).
STORE_OPTIONS = tuple(f.name for f in dataclasses.fields(StoreConfig))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(StoreConfig)}
_DIGITS = re.compile(r"[0-9]{1,30}")


def flag(x: Any, name: str, where: str) -> bool:
    """A yes/no option: a bool, 0 or 1, or the strings true/false/1/0 (JSON, YAML and environment
    variables spell them differently; bool("false") would be True)."""
    if isinstance(x, bool) or (isinstance(x, int) and x in (0, 1)):
        return bool(x)
    if isinstance(x, str) and x.strip().lower() in ("true", "false", "1", "0"):
        return x.strip().lower() in ("true", "1")
    raise InvalidArgumentError(f"{where}: {name} must be true or false, not {x!r}")


def integer(x: Any, name: str, where: str) -> int:
    """A count option: an int or a string of ASCII decimal digits, at most 30 of them (not a float,
    which would be truncated, nor a bool; ``str.isdigit`` also accepts digits such as "²" that
    ``int`` refuses, and ``int`` refuses strings past 4300 digits)."""
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    if isinstance(x, str) and _DIGITS.fullmatch(x.strip()):
        return int(x.strip())
    raise InvalidArgumentError(f"{where}: {name} must be a whole number, not {x!r}")


def store_kwargs(options: Mapping[str, Any], where: str, *, ignore: Iterable[str] = (),
                 subfolder: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `ChunkStore` from a config's options: each `STORE_OPTIONS` key given,
    parsed by its kind (flags with `flag`, sizes with `integer`, text as str; None only where the
    default is None), the rest left to `ChunkStore`'s defaults. Keys in `ignore` belong to the
    framework; any other key is an `InvalidArgumentError` naming it and the accepted ones.
    `subfolder` (this worker's or rank's, or None): the store opens ``path/subfolder``."""
    ignore = set(ignore)
    unknown = sorted(str(k) for k in options if k not in STORE_OPTIONS and k not in ignore)
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown option{'s' if len(unknown) > 1 else ''} "
                                   f"{', '.join(map(repr, unknown))}; accepted: {', '.join(STORE_OPTIONS)}")
    out: dict[str, Any] = {}
    for name in STORE_OPTIONS:
        if name not in options:
            continue
        x, default = options[name], _DEFAULTS[name]
        if isinstance(default, bool):
            out[name] = flag(x, name, where)
        elif isinstance(default, int):
            out[name] = integer(x, name, where)
        elif x is None and default is None:
            out[name] = None
        elif isinstance(x, str) or (name == "path" and isinstance(x, os.PathLike)):
            out[name] = x
        else:
            raise InvalidArgumentError(f"{where}: {name} must be a string, not {x!r}")
    if out.get("path") is not None and subfolder is not None:
        out["path"] = os.path.join(out["path"], subfolder)
    return out


#: Options the integrations take beside the store's: the exact codec's encoder level.
ENCODER_OPTIONS = ("level",)


def encoder_level(options: Mapping[str, Any], where: str) -> int:
    """The ``level`` option (1 fast, 2 the default: `weightszip.compress`), the default where absent;
    an int or a string of digits, else `InvalidArgumentError`."""
    if "level" not in options:
        return _core.DEFAULT_LEVEL
    value = integer(options["level"], "level", where)  # (its error names `where` already)
    try:
        return check_level(value)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{where}: {e}") from None
