"""The `weightszip` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from weightszip import files
from weightszip.cli_args import nonnegative_int as _nonnegative_int
from weightszip.cli_args import thread_count
from weightszip.errors import InvalidArgumentError, OutputExistsError, WeightszipError

# Files at least this large get a progress bar (smaller ones finish before a bar is useful).
PROGRESS_MIN_BYTES = 32 << 20


class _Progress:
    """tqdm bar fed by the core's (done, total) callbacks; silent for small inputs."""

    def __init__(self, desc: str, size: int, quiet: bool):
        self.bar = None
        if not quiet and size >= PROGRESS_MIN_BYTES:
            from tqdm import tqdm

            self.bar = tqdm(total=size, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def output_path(text: str) -> str:
    """-o OUTPUT: a path, not an empty string (argparse's usage error): `-o "$OUT"` with OUT unset
    must not write somewhere else."""
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    return text


def _printable(name: str) -> str:
    """A name from a file as `info` prints it: control and other non-printable characters escaped
    (a hostile name cannot move the cursor, recolour the terminal or forge a line)."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def refuse_output(output: str, inputs: list[str], force: bool) -> str | None:
    """Why `output` must not be written, or None: it is one of `inputs` (never written, even with
    force), or it exists and `force` is not set (like gzip and zstd without -f). Every subcommand
    that writes an -o OUTPUT (compress, decompress, kv dump, calibrate) asks this before any work;
    without force, each then publishes its output with no-replace semantics (`overwrite=False`:
    `OutputExistsError` if a file was created at OUTPUT meanwhile), so none is ever replaced."""
    if not os.path.lexists(output):
        return None
    for i in inputs:
        if files.same_file(i, output):
            return f"{output}: is the input file {i}; not overwritten (not even with --force)"
    if not force:
        return f"{output}: already exists; not overwritten (use -f/--force to overwrite it)"
    try:
        files.check_output(output, True)  # (a device or FIFO would be replaced, not written into)
    except InvalidArgumentError as e:
        return f"{e} (not even with --force)"
    return None


def _refused(output: str, inputs: list[str], force: bool) -> bool:
    """Print the reason `output` is refused, as the CLI prints errors; True if it is."""
    why = refuse_output(output, inputs, force)
    if why is not None:
        print(f"weightszip: error: {why}", file=sys.stderr)
    return why is not None


def _cmd_compress(a) -> int:
    out = a.input + ".wz" if a.output is None else a.output
    if _refused(out, [a.input], a.force):
        return 1
    kind, segs = files.file_segments(a.input)
    size = os.path.getsize(a.input)
    p = _Progress("compress", size, a.quiet)
    t = time.perf_counter()
    try:
        index = files._core.encode_file(a.input, out, segs, a.chunk_size, a.threads, files._core.DEFAULT_LANES_LOG2, p,
                                        overwrite=a.force, mode=files._mode_of(a.input), level=a.level)
    finally:
        p.close()
    dt = time.perf_counter() - t
    stored = os.path.getsize(out)
    if not a.quiet:
        tensors = sum(1 for e in index["entries"] if e["layout"] == 0)
        print(
            f"{a.input} ({kind}, {tensors} tensors): {_human(size)} -> {_human(stored)} "
            f"({stored / max(size, 1):.4f}) in {dt:.2f} s ({size / max(dt, 1e-9) / 1e6:.0f} MB/s)"
        )
    return 0


def _cmd_decompress(a) -> int:
    out = a.output
    if out is None:
        if not a.input.endswith(".wz"):
            raise SystemExit("weightszip: error: give -o OUTPUT (input does not end in .wz)")
        out = a.input[:-3]
    index = files.file_info(a.input)
    if _refused(out, [a.input], a.force):
        return 1
    size = sum(e["raw_bytes"] for e in index["entries"])
    p = _Progress("decompress", size, a.quiet)
    t = time.perf_counter()
    try:
        files.decompress_file(a.input, out, threads=a.threads, progress=p, overwrite=a.force)
    finally:
        p.close()
    dt = time.perf_counter() - t
    if not a.quiet:
        print(f"{a.input} -> {out}: {_human(size)} in {dt:.2f} s ({size / max(dt, 1e-9) / 1e6:.0f} MB/s)")
    return 0


def _cmd_info(a) -> int:
    index = files.file_info(a.input)
    stored_total = os.path.getsize(a.input)
    raw_total = sum(e["raw_bytes"] for e in index["entries"])
    if a.json:
        json.dump(
            {
                "format_version": files._core.FORMAT_VERSION,
                "kind": "file" if index["kind"] == 1 else "tensors",
                "container_bytes": stored_total,
                "raw_bytes": raw_total,
                "ratio": stored_total / raw_total if raw_total else None,
                "entries": index["entries"],
            },
            sys.stdout,
            indent=1,
        )
        print()
        return 0
    kind = "file (restores the original byte for byte)" if index["kind"] == 1 else "named tensors"
    print(f"{a.input}: weightszip format {files._core.FORMAT_VERSION}, {kind}")
    print(f"  {len(index['entries'])} entries, {_human(raw_total)} -> {_human(stored_total)}", end="")
    print(f" ({stored_total / raw_total:.4f})" if raw_total else "")
    shown = index["entries"] if a.all else index["entries"][:40]
    print(f"  {'name':40s} {'dtype':14s} {'shape':22s} {'ratio':>7s} {'chunks':>6s}")
    for e in shown:
        r = e["stored_bytes"] / e["raw_bytes"] if e["raw_bytes"] else 0.0
        name = _printable(e["name"])[:40]
        print(f"  {name:40s} {e['dtype']:14s} {str(e['shape'])[:22]:22s} {r:7.4f} {e['chunks']:6d}")
    if len(shown) < len(index["entries"]):
        print(f"  ... {len(index['entries']) - len(shown)} more (--all)")
    return 0


def _cmd_verify(a) -> int:
    index = files.file_info(a.input)
    size = sum(e["raw_bytes"] for e in index["entries"])
    p = _Progress("verify", size, a.quiet)
    try:
        files.verify_file(a.input, threads=a.threads, progress=p)
    finally:
        p.close()
    if not a.quiet:
        print(f"{a.input}: OK ({len(index['entries'])} entries, every chunk decoded and checksummed)")
    return 0


def _cmd_demo(a) -> int:
    from weightszip import demo

    return demo.main(quick=a.quick, threads=a.threads)


_OUTPUT_NOTE = (
    "An OUTPUT that exists is not overwritten (error, exit status 1) unless -f/--force is given, not "
    "even one created while the output was being written; one that is the input file itself (or a link "
    "to it) is never overwritten. The output gets the input's permission mode, as with gzip and zstd (with "
    "--force, a file it replaces keeps its own). It is written to a new temporary file beside it, of a "
    "unique name (.OUTPUT.PID.N.RANDOM.wz-partial), then moved into place, so a failed or interrupted run "
    "(Ctrl-C: exit status 130) leaves no partial file; on Linux, temporary files of OUTPUT left by a run "
    "that was killed (PID no longer running) are removed by the next run writing OUTPUT."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightszip", description="Bit-exact compression of LLM tensors and files.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--threads", type=thread_count, default=0, help="worker threads (default: one per core; at most 256)")
    common.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("compress", parents=[common], help="compress any file (.safetensors, .gguf, .npy tensor-aware)",
                       description="Compress any file (.safetensors, .gguf, .npy tensor-aware; anything else as bytes). "
                       + _OUTPUT_NOTE)
    c.add_argument("input")
    c.add_argument("-o", "--output", type=output_path,
                   help="output path (default INPUT.wz); an existing one is refused without --force")
    c.add_argument("-f", "--force", action="store_true",
                   help="overwrite OUTPUT if it exists (never the input itself)")
    c.add_argument("--chunk-size", type=_nonnegative_int, default=files._core.DEFAULT_CHUNK_BYTES,
                   help="bytes per chunk")
    c.add_argument("--level", type=int, choices=(files._core.LEVEL_FAST, files._core.DEFAULT_LEVEL),
                   default=files._core.DEFAULT_LEVEL,
                   help="encoder level: 1 tries fewer models per chunk (bf16 KV 1.2-1.7x faster, at most "
                   "0.2%% larger), 2 (default) tries them all")
    c.set_defaults(fn=_cmd_compress)

    d = sub.add_parser("decompress", parents=[common], help="restore the original file",
                       description="Restore the original file, byte for byte (a container of named tensors is "
                       "written as a .safetensors file). " + _OUTPUT_NOTE)
    d.add_argument("input")
    d.add_argument("-o", "--output", type=output_path,
                   help="output path (default: INPUT without .wz); an existing one is refused without --force")
    d.add_argument("-f", "--force", action="store_true",
                   help="overwrite OUTPUT if it exists (never the input itself)")
    d.set_defaults(fn=_cmd_decompress)

    i = sub.add_parser("info", help="show what a .wz file holds")
    i.add_argument("input")
    i.add_argument("--json", action="store_true")
    i.add_argument("--all", action="store_true", help="list every entry")
    i.set_defaults(fn=_cmd_info)

    v = sub.add_parser("verify", parents=[common], help="decode everything and check every checksum")
    v.add_argument("input")
    v.set_defaults(fn=_cmd_verify)

    m = sub.add_parser("demo", help="compress a real KV cache and real weights, prove it bit-exact")
    m.add_argument("--threads", type=thread_count, default=0, help="threads (default: one per core; at most 256)")
    m.add_argument("--quick", action="store_true", help="shorter context (for CI)")
    m.set_defaults(fn=_cmd_demo)
    from weightszip.eval import capacity
    capacity.add_parser(sub)
    from weightszip.eval import cli as eval_cli
    eval_cli.add_parsers(sub)
    from weightszip.compact import cli as compact_cli
    compact_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # (Ctrl-C: the codec stopped, its temporary file removed, nothing written)
        print("weightszip: interrupted", file=sys.stderr)
        return 130
    except OutputExistsError as e:  # (created since refuse_output's check: still not replaced)
        print(f"weightszip: error: {e} (use -f/--force to overwrite it)", file=sys.stderr)
        return 1
    except WeightszipError as e:
        print(f"weightszip: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"weightszip: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
