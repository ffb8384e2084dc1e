"""A/B of kernel variants (WZ_X4_VARIANT bits: 1 = the sum's rescale without the branch, 2 = V's
operand built before the logits): bench_kv_exact's grid at 4 points per variant, interleaved twice."""
import json, os, sys
sys.path.insert(0, "benchmarks")
import bench_kv_exact as B
out = os.environ["OUT"]
res = {}
for rnd in range(2):
    for v in (0, 1, 2, 3):
        os.environ["WZ_X4_VARIANT"] = str(v)
        pre = f"{out}/v{v}_r{rnd}"
        B.main(["--kv", ".boxdata/kv_pages_subset.npz", "--format", "exact4", "--k-set", "qwen_8k:K:8",
                "--v-set", "qwen_8k:V:8", "--batches", "8,64", "--contexts", "32768,131072", "--rep", "30",
                "--no-sdpa", "--out", pre])
        r = json.load(open(pre + ".json"))
        res[f"v{v}_r{rnd}"] = [(g["batch"], g["context"], round(g["exact_ms"], 4), g["bit_identical"]) for g in r["grid"]]
        print(v, rnd, res[f"v{v}_r{rnd}"], flush=True)
        for suf in (".json", ".md", ".png"):
            if os.path.exists(pre + suf) and not (v == 0 and rnd == 0 and suf == ".json"):
                os.remove(pre + suf)
json.dump(res, open(f"{out}/variants.json", "w"), indent=1)
