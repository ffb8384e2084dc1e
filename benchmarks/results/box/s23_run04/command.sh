# session 23 run 4: vector shared loads of the words, the lazy softmax max; configs with a register cap
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 120 python3 -m pytest -q -rf --tb=short -x tests/test_kv_exact.py -p no:cacheprovider \
  -k "gluon or (exact4 and attention)" > $OUT/tests4.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests4.txt
timeout 420 python3 benchmarks/bench_kv_exact.py --kv .boxdata/kv_pages_subset.npz --format exact4 \
  --k-set qwen_8k:K:8 --v-set qwen_8k:V:8 --batches 8,32,64 --contexts 32768,131072 --rep 30 \
  --gluon 4:2,4:2:168,8:2,8:2:168 --out $OUT/x4g > $OUT/x4g.log 2>&1
echo "bench rc $?"; tail -2 $OUT/x4g.log | cut -c1-300; sed -n '/| batch/,$p' $OUT/x4g.md
python3 - <<'PY'
import json,os
r=json.load(open(os.environ["OUT"]+"/x4g.json"))
for g in r["grid"]:
    print(g["batch"], g["context"], {k: (v["kernel"], round(v["ms"],3)) for k,v in g.items() if k.startswith("gluon_") and isinstance(v,dict)})
PY
