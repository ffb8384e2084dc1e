source scripts/box_setup.sh > /dev/null
timeout 140 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_compact.py -k "rotary and gpu" > $OUT/r/gputests.txt 2>&1
tail -5 $OUT/r/gputests.txt
