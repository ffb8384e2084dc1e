# session 24 run 7: the committed kernel (417a8fd) at 2 and 3 stages: A/B
source .boxq/r/setup.sh
mkdir -p $OUT
AB_VARIANTS=new,new:3 AB_ROUNDS=2 timeout 330 python3 .boxq/x/ab.py > $OUT/ab.log 2>&1; echo "ab rc $?"; grep -E "^(base|new|quick) " $OUT/ab.log
