#!/bin/bash
# Three processes per checkout, interleaved, each tracing the variational ResNet-20 round three times on the
# accelerators' path (trace_gpu_path.py) and on the CPU's step loop (session 14's trace_thrice.py).
# Checkouts (see ../README.md): BASE (d833bca), GUIDE_ONLY (a003e86 with d833bca's bfedjax/core/engine.py), NEW.
# Run from the repository root: BASE=... GUIDE_ONLY=... NEW=... bash results/bench/session15_cpu_trace/scripts/interleave.sh
here=$(cd "$(dirname "$0")" && pwd)
thrice=$here/../../gpu_h100_session14/scripts/trace_thrice.py
for i in 1 2 3; do
  for pair in "d833bca=$BASE" "a003e86-guide-only=$GUIDE_ONLY" "a003e86=$NEW"; do
    name=${pair%%=*}; dir=${pair#*=}
    echo "gpu-path $name run $i: $(cd "$dir" && PYTHONPATH="$dir" python "$here/trace_gpu_path.py" 2>/dev/null | grep -o 'trace [0-9.]*s' | tr '\n' ' ')"
    echo "cpu-loop $name run $i: $(cd "$dir" && PYTHONPATH="$dir" python "$thrice" 2>/dev/null | grep -o 'trace [0-9.]*s' | tr '\n' ' ')"
  done
done
