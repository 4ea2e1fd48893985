#!/bin/bash
# Session 14 GPU call 2: the clip norm from factors against the gradient's norm; the target rows; ResNet-20 with threefry kernels.
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data PYTHONPATH=$PWD
W="grep -v Warn\|warn\|W1127\|I1127"
nvidia-smi -L; date +%T
P="timeout 45 python3 .gpu/prof_round.py"
for f in 0 1; do FCN=$f NOPROF=1 $P 100:fedavg:mlp:4 1000:fedavg:mlp:4 2>&1 | grep TIME | sed "s/^/factored=$f /"; done | tee $OUT/factored.txt
for f in 0 1; do FCN=$f NOPROF=1 $P 100:fedavg:fedreg_cnn:4 2>&1 | grep TIME | sed "s/^/factored=$f /"; done | tee -a $OUT/factored.txt
date +%T
D=/tmp/gpu_h100_session14; rm -rf $D  # as run: D=results/bench/gpu_h100_session14 on the device
timeout 360 python3 -m experiments.bench --noquick --only="mlp K=100 B=10,mlp K=1000 B=10,fedreg_cnn K=100,fola_cnn K=100,resnet20" \
  --algorithms=fedavg,fola,bfl --backends=vmap,torch.func+compile,centralised --output_dir=$D 2>&1 | $W > $OUT/bench.log
cp $D/bench.json $D/bench.md $OUT/ 2>/dev/null; grep "^| \(mlp\|fed\|fola\|res\)\|ceiling\|torch.func" $OUT/bench.md | grep -v "^| mlp.*| stepwise"; date +%T
JAX_THREEFRY_GPU_KERNEL_LOWERING=1 timeout 70 python3 -m experiments.bench --noquick --only=resnet20 --algorithms=bfl --backends=vmap --output_dir=/tmp/rt 2>&1 | grep "^resnet\|rror" | tee $OUT/resnet_threefry.txt
cp /tmp/rt/bench.md $OUT/resnet_threefry.md 2>/dev/null; date +%T
