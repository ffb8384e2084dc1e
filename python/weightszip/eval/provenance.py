"""Which calibration an evaluation used, and whether an evaluation text is one of its
calibration texts (the held-out claim of docs/EVALUATION.md, checked on each run)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _texts(cal) -> list[dict]:
    """The calibration texts its meta records: the entries that are objects whose ``text`` and
    ``sha256`` (where there) are strings. Anything else a hand-edited meta holds (``"texts": 5``, a
    list for a hash) is left out, as an entry that is not an object always was."""
    texts = cal.meta.get("texts")
    if not isinstance(texts, list):
        return []
    return [t for t in texts if isinstance(t, dict) and all(isinstance(t.get(k, ""), str) for k in ("text", "sha256"))]


def describe(path, cal, text_overlap: list[str]) -> dict:
    """The report's ``calibration`` entry: the file, its SHA-256, the per-format calibration ids
    (the XXH3 of the tables a format's codes depend on, as compact chunks record them), the model it
    was made on, its calibration texts (path, tokens, SHA-256) as its meta records them, and the
    evaluation texts found among them (``held_out``)."""
    from weightszip.integrations.compact_chunks import calibration_id

    return {
        "path": str(path),
        "sha256": file_sha256(path),
        "ids": {f: f"{calibration_id(cal, f):016x}" for f in cal.allocation},
        "model": cal.meta.get("model"),
        "texts": _texts(cal),
        "text_overlap": list(text_overlap),
    }


def overlap(cal, files) -> list[str]:
    """The evaluation text ``files`` (in the order they are read) that are calibration texts of
    ``cal``, each said in words: a file whose SHA-256, or the first files' joined bytes' (how
    ``weightszip calibrate`` hashes a folder), equals a calibration text's; or a file that is a
    calibration text's path, or lies in its folder (the path as recorded, from the current folder)."""
    texts = _texts(cal)
    if not texts:
        return []
    by_hash = {t.get("sha256"): t.get("text") for t in texts if t.get("sha256")}
    found: list[str] = []
    joined = hashlib.sha256()
    for i, f in enumerate(files):
        f = Path(f)
        try:
            data = f.read_bytes()
        except OSError:
            continue
        joined.update(data)
        digests = [(hashlib.sha256(data).hexdigest(), str(f))]
        if i:
            digests.append((joined.hexdigest(), f"the first {i + 1} files of {f.parent} joined"))
        for digest, what in digests:
            if digest in by_hash:
                found.append(f"{what} has the SHA-256 of calibration text {by_hash[digest]}")
        for t in texts:
            if not t.get("text"):  # (a hash alone: Path("") is the current folder)
                continue
            p = Path(t["text"])
            try:  # (a recorded path too long for this system, or in a folder we may not read: no match)
                if not p.exists():
                    continue
                same = os.path.samefile(p, f) or (p.is_dir() and any(os.path.samefile(p, q) for q in f.parents))
            except OSError:
                same = False
            if same:
                found.append(f"{f} is calibration text {t.get('text')}" + (" (a file of that folder)" if p.is_dir() else ""))
    return list(dict.fromkeys(found))


def held_out(cal, cal_path, files, allow: bool) -> tuple[list[str], str | None]:
    """The evaluation text ``files`` found among the calibration's texts (``overlap``; none without a
    calibration), and the error line that refuses the evaluation on them, or None (after a warning on
    stderr when ``allow``, the ``--allow-calibration-text`` option)."""
    found = overlap(cal, files) if cal is not None else []
    return found, _refuse_or_warn(cal_path, found, allow)


def _refuse_or_warn(cal_path, found: list[str], allow: bool, flag: str = "--allow-calibration-text") -> str | None:
    import sys

    if not found:
        return None
    what = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    if not allow:
        return (f"the evaluation text is calibration text of --calibration {cal_path} ({what}): the result would not "
                f"be held out; use other text, or {flag} to run it anyway")
    print(f"weightszip: warning: evaluating on calibration text of {cal_path} ({what}); the result is not held out",
          file=sys.stderr)
    return None
