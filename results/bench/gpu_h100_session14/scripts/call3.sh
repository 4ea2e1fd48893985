#!/bin/bash
# Session 14 GPU call 3: the FedAvg MLP target rows without the (reverted) factored clip norm.
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data PYTHONPATH=$PWD
nvidia-smi -L; date +%T
D=/tmp/gpu_h100_session14_mlp; rm -rf $D  # as run: D=results/bench/gpu_h100_session14_mlp on the device
timeout 170 python3 -m experiments.bench --noquick --only="mlp K=100 B=10,mlp K=1000 B=10" --algorithms=fedavg \
  --backends=vmap,torch.func+compile,centralised --output_dir=$D 2>&1 | grep -v "Warn\|warn\|W1127\|I1127" > $OUT/bench.log
cp $D/bench.json $D/bench.md $OUT/ 2>/dev/null; grep "^| mlp\|ceiling\|torch.func" $OUT/bench.md; date +%T
