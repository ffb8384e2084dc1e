# session 22 run 7: shorter splits / more programs at small steps with the new merge (q4 with side tokens, fp8):
# min_split_tokens 2048 / 1024 / 512 at the default waves and twice them; two rounds. Negative: the defaults were
# fastest or within 1% everywhere (split.json)
source .boxq/r/setup.sh; mkdir -p $OUT; timeout 330 python3 .boxq/x/s22_split.py 2>&1 | grep -v -i warn | tee $OUT/split.txt | tail -3
