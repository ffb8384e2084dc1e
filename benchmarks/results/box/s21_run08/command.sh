source .boxq/r/setup.sh; timeout 200 python3 .boxq/x/s21_merge2.py
