#!/bin/bash
# Session 14 GPU call 1: current code's MLP round profile, clip cost, ceiling, and where the ResNet-20 compile goes.
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data PYTHONPATH=$PWD
W="grep -v Warn\|warn\|W1127\|I1127"
nvidia-smi -L; python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__, jax.devices())"
date +%T
( timeout 170 python3 .gpu/compile_trace.py 10:bfl:resnet20:32 > $OUT/rn_default.txt 2>&1 &
  JAX_THREEFRY_GPU_KERNEL_LOWERING=1 timeout 170 python3 .gpu/compile_trace.py 10:bfl:resnet20:32 > $OUT/rn_threefry.txt 2>&1 &
  wait )
date +%T; grep COMPILE -A3 $OUT/rn_*.txt
timeout 60 python3 .gpu/prof_round.py 100:fedavg:mlp:4 2>&1 | $W > $OUT/prof_mlp.txt
NOCLIP=1 NOPROF=1 timeout 40 python3 .gpu/prof_round.py 100:fedavg:mlp:4 2>&1 | grep TIME | sed 's/^/noclip /' >> $OUT/prof_mlp.txt
date +%T; head -45 $OUT/prof_mlp.txt; grep noclip $OUT/prof_mlp.txt
timeout 110 python3 -m experiments.bench --only="mlp K=100 B=10" --algorithms=fedavg --backends=vmap,centralised --output_dir=/tmp/b1 2>&1 | $W > $OUT/bench_mlp.log
cp /tmp/b1/bench.md $OUT/ 2>/dev/null; grep "^| mlp\|ceiling" $OUT/bench.md; date +%T
