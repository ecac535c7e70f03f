# the GPU job (call 3): distill the task prompts, then train the shipped head on their answers
set -o pipefail
D=${DEVICE:-cuda}
H=speculant/data/drafters/eagle-smollm2-135m
mkdir -p $OUT/head $OUT/text /tmp/work
date; nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
timeout ${T1:-270} python3 scripts/gpu_eagle.py distill --device $D --prompts ${P:-.c3/tasks.pt} \
  --groups T,Q,M,W,K,R,S,A,C --batch ${B:-1024} --answer-tokens ${AT:-256} --minutes ${M1:-3.3} \
  --out /tmp/work/tasks_distilled.pt --copy-to $OUT/text || echo "distill rc $?"
ls -la $OUT/text; date
timeout ${T2:-265} python3 scripts/gpu_eagle.py train --device $D --data $OUT/text/*.pt --config $H --init $H \
  --out $OUT/head --batch 16 --lr 1e-4 --warmup 30 --minutes ${M2:-3.4} --eval-every 500 $TRAIN_EXTRA \
  || echo "train rc $?"
ls -la $OUT/head; date
