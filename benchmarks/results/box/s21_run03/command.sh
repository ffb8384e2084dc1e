# session 21 run 3: the planner's split choice (_fit_split) against main's, in one process (s21_plan.py)
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 560 python3 .boxq/x/s21_plan.py $OUT/plan_ab.json llama70b-tp8,llama8b 8,16,32,64 32768,131072 fp8,q4,q3.5,q3
