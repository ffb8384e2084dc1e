"""End to end on a GPU: greedy generation through the paged compact cache (the Triton write and
decode-attention kernels) against generation through the reference codec, same model, prompt and
calibration.

    python benchmarks/e2e_generate.py --model smollm2 --calibration python/weightszip/data/smollm2.wzcal \
        --text ../shared/data/text/books/austen-emma.txt --prompt 2048 --new 64 --formats q4,q3.5,q3 \
        --out benchmarks/results/e2e_generate

For each format: whether the two token sequences are equal, the first step where they differ (if
any), the largest difference of the two paths' logits while they agree, and the wall time of each
path (the paged path one token per forward; the reference path re-runs the whole sequence per token:
its time is not a serving speed).

Then the paged path again, teacher-forced on the reference's tokens (each step fed the reference's
token, whatever its own argmax), so that the two paths are compared at every step even after a
near tie sent free generation apart: the steps whose argmax differs, the reference's top-2 gap and
the logit difference at each, and the largest logit difference over all steps.

The yardstick, measured first in the same run: the model without any format, decoding through its
own bf16 KV cache one token at a time (teacher-forced) against whole-sequence forwards, the rounding
floor of incremental decoding. Exit status 0 when, for every format, every teacher-forced logit
difference is within twice that floor (at least 4 units in the last place of bf16 at the largest
logit) and every differing argmax is at a near tie (the reference's top-2 gap no larger than the
logit difference there); 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _differs(splits) -> str:
    """``forced_agreement``'s differing steps as "step (gap / logit diff), ..." ("" for none)."""
    return ", ".join(f"{d['step']} ({d['margin']:.3g} / {d['logit_diff']:.3g})" for d in splits)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--calibration", default=str(ROOT / "python" / "weightszip" / "data" / "smollm2.wzcal"))
    p.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "text" / "books" / "austen-emma.txt"))
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--formats", default="q4,q3.5,q3")
    p.add_argument("--device", default="cuda")
    p.add_argument("--force-gluon", action="store_true",
                   help="the Gluon decode kernel however small the step (KernelConfig.gluon_min_work and "
                        "gluon_rope_min_work = 0)")
    p.add_argument("--config", default="",
                   help="field=value,... changes to the compact pages' KernelConfig (DEFAULT_CONFIGS), e.g. "
                        "gluon_rope_pos=1")
    p.add_argument("--no-rope", action="store_true",
                   help="drop the calibration's rotary K offsets (both decode kernels have the rotary term; "
                        "this runs the format without it)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e_generate"))
    a = p.parse_args(argv)

    import torch
    from tqdm import tqdm

    from weightszip.compact.calibrate import Calibration
    from weightszip.compact.paged_cache import (
        bf16_logit_tolerance,
        forced_agreement,
        generate_cached,
        generate_paged,
        generate_reference,
    )
    from weightszip.models import load_causal_lm, tokenize_text

    lm = load_causal_lm(a.model, verbose=False)
    lm.model.to(a.device)
    cal = Calibration.load(a.calibration)
    if a.no_rope:
        cal = dataclasses.replace(cal, rope_m=None, rope_phase=None)
    if a.force_gluon or a.config:
        from bench_decode_attention import config_changes

        from weightszip.kernels import DEFAULT_CONFIGS
        from weightszip.kernels.paged_decode import PAGE_COMPACT

        changes = dict(gluon_min_work=0, gluon_rope_min_work=0) if a.force_gluon else {}
        DEFAULT_CONFIGS[PAGE_COMPACT] = dataclasses.replace(DEFAULT_CONFIGS[PAGE_COMPACT],
                                                              **changes, **config_changes(a.config))
    ids, files = tokenize_text(lm.tokenizer, pathlib.Path(a.text), a.prompt)
    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    # the floor: bf16, the model's own cache one token at a time against whole-sequence forwards
    whole = generate_reference(lm.model, None, None, ids, a.new)
    floor = forced_agreement(generate_cached(lm.model, ids, a.new, forced=whole.tokens), whole, math.inf)
    del floor["ok"], floor["tolerance"]  # (a yardstick, not a check)
    print(f"floor (bf16, own cache against whole-sequence forwards): {floor}", flush=True)
    rows = []
    for fmt in tqdm(a.formats.split(","), desc="formats", file=sys.stdout):
        sync()
        t0 = time.perf_counter()
        paged = generate_paged(lm.model, cal, fmt, ids, a.new)
        sync()
        t1 = time.perf_counter()
        ref = generate_reference(lm.model, cal, fmt, ids, a.new)
        sync()
        t2 = time.perf_counter()
        forced = generate_paged(lm.model, cal, fmt, ids, a.new, forced=ref.tokens)
        fa = forced_agreement(forced, ref, max(2 * floor["max_logit_diff"], bf16_logit_tolerance(ref)))
        first = next((i for i, (x, y) in enumerate(zip(paged.tokens, ref.tokens)) if x != y), None)
        agree = len(paged.tokens) if first is None else first
        diffs = [float((x - y).abs().max()) for x, y in zip(paged.logits[:agree], ref.logits[:agree])]
        # Where the paths part: the reference's gap between its two best tokens there, and how far
        # the two paths' logits are apart at that step (a gap under it is a near tie that rounding
        # can flip).
        split = {}
        if first is not None:
            top2 = ref.logits[first].float().topk(2).values
            split = dict(split_margin=float(top2[0] - top2[1]),
                         split_logit_diff=float((paged.logits[first] - ref.logits[first]).abs().max()))
        rows.append(dict(format=fmt, equal=first is None, first_difference=first, steps=a.new, **split,
                         max_logit_diff=max(diffs) if diffs else None,
                         max_logit=float(max(y.abs().max() for y in ref.logits)),
                         paged_seconds=t1 - t0, reference_seconds=t2 - t1, forced=fa,
                         paged_text=lm.tokenizer.decode(paged.tokens), reference_text=lm.tokenizer.decode(ref.tokens)))
        print(f"{fmt}: equal={first is None} first_difference={first} {split} max_logit_diff={rows[-1]['max_logit_diff']} "
              f"paged {t1 - t0:.1f} s, reference {t2 - t1:.1f} s; teacher-forced: {fa}", flush=True)
    dev = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    res = dict(model=lm.name, calibration=a.calibration, rotary_offsets=not a.no_rope, force_gluon=a.force_gluon,
               config=a.config, floor=floor,
               text=files, prompt_tokens=a.prompt, new_tokens=a.new,
               device=dev, torch=torch.__version__, cmd=" ".join(sys.argv), rows=rows)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = ["| format | tokens equal | first difference | there: reference's top-2 gap / logit diff "
             "| max logit diff (max logit) | teacher-forced: argmax differs at step (gap / logit diff) "
             "| teacher-forced: max logit diff (tolerance) | near ties only | paged s | reference s |",
             "|---|---|---:|---:|---:|---|---:|---|---:|---:|"]
    for r in rows:
        at = f"{r['split_margin']:.3g} / {r['split_logit_diff']:.3g}" if "split_margin" in r else "-"
        fa = r["forced"]
        mld = "-" if r["max_logit_diff"] is None else f"{r['max_logit_diff']:.3g}"  # (None: apart from step 0)
        differs = _differs(fa["argmax_differs"])
        lines.append(f"| {r['format']} | {'yes' if r['equal'] else 'no'} | {r['first_difference'] if r['first_difference'] is not None else '-'} "
                     f"| {at} | {mld} ({r['max_logit']:.3g}) | {differs or 'none'} "
                     f"| {fa['max_logit_diff']:.3g} ({fa['tolerance']:.3g}) | {'yes' if fa['ok'] else '**no**'} "
                     f"| {r['paged_seconds']:.1f} | {r['reference_seconds']:.1f} |")
    differs = _differs(floor["argmax_differs"])
    lines += ["", f"Floor (no format; the model's own bf16 cache, one token at a time, teacher-forced on its "
              f"whole-sequence greedy tokens): max logit diff {floor['max_logit_diff']:.3g}; argmax differs at "
              f"{differs or 'no step'}. Tolerance: twice the floor, at least 4 bf16 ulps of the largest logit."]
    md = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(r["forced"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
