"""A/B of the exact4 Gluon kernel (a variant "name:stages:maxnreg:waves" sets those launch settings): the committed one (_x4_base) against the tree's, interleaved rounds
over bench_kv_exact's grid points (no SDPA), each checked bit-identical to the bf16 mode."""
import json, os, sys
sys.path.insert(0, "benchmarks")
import bench_kv_exact as B
import weightszip.kernels.kv_exact4_gluon as cur
import importlib
out = os.environ["OUT"]
new_k = cur.exact4_split_kernel
res = {}
pts = os.environ.get("AB_BATCHES", "8,64"), os.environ.get("AB_CONTEXTS", "32768,131072")
for rnd in range(int(os.environ.get("AB_ROUNDS", 2))):
    for name in os.environ.get("AB_VARIANTS", "base,new").split(","):
        kname, _, rest = name.partition(":")
        st, _, rest = rest.partition(":")
        nreg, _, waves = rest.partition(":")
        k = new_k if kname == "new" else importlib.import_module(f"weightszip.kernels._x4_{kname}").exact4_split_kernel
        cur.exact4_split_kernel = k
        import dataclasses
        from weightszip.kernels import DEFAULT_CONFIGS
        from weightszip.kernels.paged_decode import PAGE_TYPES
        if "orig" not in res:
            res["orig"] = DEFAULT_CONFIGS[PAGE_TYPES["exact4"]]
        DEFAULT_CONFIGS[PAGE_TYPES["exact4"]] = dataclasses.replace(res["orig"], gluon_stages=int(st or res["orig"].gluon_stages),
                                                                      gluon_maxnreg=int(nreg or res["orig"].gluon_maxnreg),
                                                                      waves=int(waves or res["orig"].waves))
        pre = f"{out}/{name}_r{rnd}"
        B.main(["--kv", ".boxdata/kv_pages_subset.npz", "--format", "exact4", "--k-set", "qwen_8k:K:8",
                "--v-set", "qwen_8k:V:8", "--batches", pts[0], "--contexts", pts[1], "--rep", "30",
                "--no-sdpa", "--out", pre])
        r = json.load(open(pre + ".json"))
        res[f"{name}_r{rnd}"] = [(g["batch"], g["context"], round(g["exact_ms"], 4), round(g["bf16_ms"], 4),
                                  g["bit_identical"]) for g in r["grid"]]
        print(name, rnd, res[f"{name}_r{rnd}"], flush=True)
        for suf in (".json", ".md", ".png"):
            if os.path.exists(pre + suf):
                os.remove(pre + suf)
res.pop("orig", None)
json.dump(res, open(f"{out}/ab.json", "w"), indent=1)
