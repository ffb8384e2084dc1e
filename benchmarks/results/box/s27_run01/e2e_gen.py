"""Generation end to end on the GPU through KVExactCache with the default kernel configs (exact4:
the Gluon kernel), against the same kernel over the pages decoded to bf16 (reference=True) and
against plain transformers generation (DynamicCache). Whole SmolLM2-135M (30 layers), real text."""
import json, os, sys, time
from pathlib import Path
import torch
from weightszip.kv_exact import generate
from weightszip.models import load_causal_lm, tokenize_text

gguf = os.environ["SMOLLM2_GGUF"]
out = Path(os.environ["OUT"])
lm = load_causal_lm(gguf, verbose=False)
model = lm.model.to("cuda")
res = {}
for text, n_prompt in (("tests/data/text/austen-emma-excerpt.txt", 200), ("tests/data/text", 1000)):
    ids, _ = tokenize_text(lm.tokenizer, Path(text), n_prompt)
    ids = ids.to("cuda")
    for fmt in ("exact4", "exact"):
        t = time.time()
        a_toks, a_logits, stats = generate(model, ids, 32, page_format=fmt)
        b_toks, b_logits, _ = generate(model, ids, 32, page_format=fmt, reference=True)
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        hf_toks = hf[0, ids.shape[1]:].tolist()
        r = dict(tokens_equal_reference=a_toks == b_toks,
                 logits_equal_reference=all(torch.equal(x, y) for x, y in zip(a_logits, b_logits)),
                 tokens_equal_transformers=a_toks == hf_toks, first_diff=next((i for i, (x, y) in enumerate(zip(a_toks, hf_toks)) if x != y), None),
                 ratio_vs_bf16=stats.get("ratio_vs_bf16"), seconds=time.time() - t)
        res[f"{Path(text).name}:{n_prompt}:{fmt}"] = r
        print(text, n_prompt, fmt, r, flush=True)
json.dump(res, open(out / "e2e_gen.json", "w"), indent=1)
