#!/bin/bash
# The README's first command on a fresh cache: two runs, line timestamps.
set -e
export SPECULANT_CACHE=$(mktemp -d) TORCH_EXTENSIONS_DIR=$(mktemp -d)
for run in 1 2; do
  t0=$(date +%s.%N)
  speculant generate "Write a haiku about rivers" 2>&1 | while IFS= read -r line; do
    printf '%7.2f %s\n' "$(echo "$(date +%s.%N) - $t0" | bc)" "$line"; done
  echo "run $run total: $(echo "$(date +%s.%N) - $t0" | bc) s"
done
