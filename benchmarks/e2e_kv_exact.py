"""End to end on a GPU: greedy generation through KV Exact (``kv_exact.generate``: the lossless paged
cache read inside attention by the default kernels, the Gluon kernel for exact4 on Hopper) against
the same kernel over the pages decoded to bf16 (``reference=True``) and against plain transformers
generation (its own cache, no weightszip), whole model, real text.

    python benchmarks/e2e_kv_exact.py --model <SmolLM2-135M-Instruct.Q4_1.gguf> \
        --text tests/data/text/austen-emma-excerpt.txt:200 --text tests/data/text:1000 \
        --new 32 --formats exact4,exact --out benchmarks/results/e2e_kv_exact.json

For each text, prompt length and page format: whether the tokens and every step's logits equal the
reference path's (they must: the format is lossless), whether the tokens equal transformers' (run
once per prompt) and the first step where they differ, the cache's bytes against bf16, and the wall
time of the two KV Exact generations (not a serving speed: one sequence, a small model).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF path or a model name weightszip.models knows")
    p.add_argument("--text", action="append", default=None,
                   help="PATH:PROMPT_TOKENS (a file or a folder of .txt); repeatable")
    p.add_argument("--new", type=int, default=32, help="tokens generated per case")
    p.add_argument("--formats", default="exact4,exact")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "python"))
    import torch
    from tqdm import tqdm

    from weightszip.kv_exact import generate
    from weightszip.models import load_causal_lm, tokenize_text

    texts = a.text or [f"{ROOT / 'tests/data/text/austen-emma-excerpt.txt'}:200", f"{ROOT / 'tests/data/text'}:1000"]
    prompts = []
    for spec in texts:
        path, _, n = spec.rpartition(":")
        if not path or not n.isdigit():
            p.error(f"--text wants PATH:PROMPT_TOKENS, got {spec!r}")
        prompts.append((pathlib.Path(path), int(n)))
    formats = a.formats.split(",")
    lm = load_causal_lm(a.model, verbose=False)
    model = lm.model.to(a.device)
    res, failed = {}, False
    bar = tqdm(total=len(prompts) * len(formats), desc="generate", file=sys.stdout)
    for path, n_prompt in prompts:
        # the prompt and transformers' own generation once per prompt: neither depends on the format
        ids, _ = tokenize_text(lm.tokenizer, path, n_prompt)
        ids = ids.to(a.device)
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new, do_sample=False)
        hf_toks = hf[0, ids.shape[1]:].tolist()
        for fmt in formats:
            t = time.time()
            toks, logits, stats = generate(model, ids, a.new, page_format=fmt)
            ref_toks, ref_logits, _ = generate(model, ids, a.new, page_format=fmt, reference=True)
            r = dict(tokens_equal_reference=toks == ref_toks,
                     logits_equal_reference=len(logits) == len(ref_logits) and all(
                         torch.equal(x, y) for x, y in zip(logits, ref_logits)),
                     tokens_equal_transformers=toks == hf_toks,
                     first_diff_transformers=next((i for i, (x, y) in enumerate(zip(toks, hf_toks)) if x != y), None),
                     ratio_vs_bf16=stats.get("ratio_vs_bf16"), seconds=round(time.time() - t, 3))
            failed |= not (r["tokens_equal_reference"] and r["logits_equal_reference"])
            res[f"{path}:{n_prompt}:{fmt}"] = r
            bar.update()
            tqdm.write(f"{path.name} prompt {n_prompt} {fmt}: {r}", file=sys.stdout)
    bar.close()
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
