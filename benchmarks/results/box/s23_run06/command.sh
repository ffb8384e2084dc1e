# session 23 run 6: kernel variants A/B (probe6.py)
source .boxq/r/setup.sh
# the committed package (a helper is editing the tree's CLI files)
cp -r .boxq/h/python/weightszip/. python/weightszip/ && rm -f python/weightszip/cli_args.py
mkdir -p $OUT
timeout 500 python3 .boxq/x/probe6.py > $OUT/probe6.log 2>&1
echo "rc $?"; grep -E "^[0-3] [01] " $OUT/probe6.log; tail -3 $OUT/probe6.log | cut -c1-300
