#!/bin/bash
# Session 8 GPU call 4: the target rows with unrolled MLP epochs; the unroll measured against the loop in one call.
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data PYTHONPATH=$PWD
D=results/bench/gpu_h100_targets; rm -rf $D
timeout 300 python3 -m experiments.bench --noquick --only="mlp K=100 B=10,mlp K=1000 B=10,fedreg_cnn K=100,fola_cnn K=100,resnet20" \
  --algorithms=fedavg,fola,bfl --backends=vmap,torch.func+compile,centralised --output_dir=$D 2>&1 | grep -v "Warn\|warn" | tee $OUT/bench.log | grep "^mlp\|^fed\|^fola\|^res\|rror"
cp $D/bench.json $D/bench.md $OUT/
P="timeout 70 python3 .gpu/prof_round.py"
for u in 1 auto; do ( [ $u = auto ] || export UNROLL=$u; NOPROF=1 $P 100:fedavg:mlp:4 1000:fedavg:mlp:4 100:fola:mlp:4 2>&1 | grep TIME | sed "s/^/unroll=$u /" ); done | tee $OUT/unroll.txt
for u in 1 10; do UNROLL=$u NOPROF=1 $P 100:fedavg:fedreg_cnn:4 100:fola:fola_cnn:4 2>&1 | grep TIME | sed "s/^/unroll=$u /"; done | tee -a $OUT/unroll.txt
