#!/bin/bash
# three processes per checkout, interleaved; each prints three traces
S=/work/main/results/bench/session15_cpu_trace/scripts
for i in 1 2 3; do
  for d in /tmp/s15/base /tmp/s15/guide_only /work/main; do
    n=$(basename $d); [ $n = main ] && n=a003e86; [ $n = base ] && n=d833bca; [ $n = guide_only ] && n="a003e86-guide-only"
    echo "gpu-path $n run $i: $(cd $d && PYTHONPATH=$d python $S/trace_gpu_path.py 2>/dev/null | grep -o 'trace [0-9.]*s' | tr '\n' ' ')"
    echo "cpu-loop $n run $i: $(cd $d && PYTHONPATH=$d python /work/main/results/bench/gpu_h100_session14/scripts/trace_thrice.py 2>/dev/null | grep -o 'trace [0-9.]*s' | tr '\n' ' ')"
  done
done
