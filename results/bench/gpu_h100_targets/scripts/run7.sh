#!/bin/bash
# Session 8 GPU call 3: the issue-18 target rows and the ResNet-20 compile row in one run; the kernel-gradient ablation.
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data
D=results/bench/gpu_h100_targets; rm -rf $D
timeout 370 python3 -m experiments.bench --noquick --only="mlp K=100 B=10,mlp K=1000 B=10,fedreg_cnn K=100,fola_cnn K=100,resnet20" \
  --algorithms=fedavg,fola,bfl --backends=vmap,torch.func+compile,centralised --output_dir=$D 2>&1 | grep -v "Warn\|warn"
cp $D/bench.json $D/bench.md $OUT/
timeout 140 python3 -m experiments.bench --only="fedreg_cnn K=100,resnet20" --algorithms=fedavg,bfl --backends=vmap \
  --matmul_kernel_grad_max_mib=0 --output_dir=$D/kernel_grad_conv 2>&1 | grep "^fedreg\|^resnet\|rror"
cp $D/kernel_grad_conv/bench.json $OUT/ablation.json; cp $D/kernel_grad_conv/bench.md $OUT/ablation.md
