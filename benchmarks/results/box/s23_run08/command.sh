# session 23 run 8: register caps (occupancy) of the Gluon exact4 kernel (probe8.py)
source .boxq/r/setup.sh
cp -r .boxq/h/python/weightszip/. python/weightszip/ && rm -f python/weightszip/cli_args.py
mkdir -p $OUT
timeout 500 python3 .boxq/x/probe8.py > $OUT/probe8.log 2>&1
echo "rc $?"; sed -n '/Gluon kernel/,$p' $OUT/regs.md
python3 - <<'PY'
import json,os
r=json.load(open(os.environ["OUT"]+"/regs.json"))
for g in r["grid"]:
    print(g["batch"], g["context"], {k[6:]: (v["kernel"][6:], round(v["ms"],3)) for k,v in g.items() if k.startswith("gluon_") and isinstance(v,dict)})
PY
