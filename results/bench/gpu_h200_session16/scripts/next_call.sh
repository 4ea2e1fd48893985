#!/bin/bash
# Prepared for the next session with a GPU (not yet run): one call, about 9 minutes, 10-11 with part 6 (run it with
# timeout_s=600; the parts run in order of priority, and what they wrote under $OUT comes back even if the call
# runs out of time: part 6, a diagnosis, may be cut).
# 1. The ResNet-20 compile at HEAD and at d833bca (before session 15's guide and replay) on one machine:
#    separates the host from the code (session 16: 25.7 and 31.5 s on two H200 machines).
# 2. FedAvg's factored dense update (the saved patch) and the same on large kernels only (on top of it)
#    against HEAD; if the large-kernels variant is >5% faster at MLP K=100 and no slower at K=1000 and on
#    the FedReg CNN, the FedAvg target rows with it.
# 3. (added in session 19) the cost of FOLA's Table I augmentation in a round on the GPU
#    (experiments.bench_augment; 2 CPU cores: 1.28x FedAvg's round, 1.34x FOLA's).
# 4. (added in session 28) the ResNet-20 compile with the variational clients' optimiser under optax.flatten
#    (one flat vector, v4). On the 2-core CPU (resnet_compile_split.py, resnet_compile_split_cpu.txt: two pairs
#    in turn) the optimised HLO fell from 104,257 to 89,754 lines and the fusions from 3,695 to 3,533, and XLA
#    took 43.7 / 41.9 s against 46.0 / 43.4 s: within this VM's noise, so not kept (the server half alone
#    compiles in 2.2 s: the local step is where the time is). On a GPU each fusion is a kernel to compile.
#    Keep it if v4 compiles at least 10% faster than both head runs and its round is no more than 3% slower.
# 5. (added in session 31) scanned residual blocks: v5 is HEAD with ../../session31_scanned_blocks/scanned_blocks.patch
#    (ResNet20(scan_blocks=True): each stage's shape-keeping blocks as one nn.scan stack, 5 distinct blocks compiled
#    instead of 9). The ResNet-20 compile and 10 rounds with it ("scanned") and without it ("unscanned", HEAD's
#    network), one process each, right after part 1. On the 2-core CPU the optimised HLO fell from 104,287 to 70,725
#    lines and the fusions from 3,695 to 2,828, XLA's time did not fall and the round was 19% slower
#    (session31_scanned_blocks/README.md). Land the patch, with scan_blocks=True as ResNet-20's default, if
#    "scanned" compiles at least 10% faster than "unscanned" and both head runs of part 1 and its round is no more
#    than 5% slower.
# 6. (added in session 31, last: it only diagnoses) XLA's own timers for the ResNet-20 compile at HEAD, one more
#    compile logged: on the CPU they showed that the random draws' threefry kernels took half of LLVM's time
#    (session31_scanned_blocks/README.md); on the GPU the library uses JAX's threefry kernel, so what takes the
#    20+ s there is unknown. xla_pass_times.py sums every timer by source line; the compressed log comes back too.
# Session 30 checked the preparation at 7d73c0f (after the engine split): the three patches apply (meanfield.py's
#   hunks at offsets of 13 and 23 lines), and on the CPU the trees run and agree with HEAD. v3's factored update,
#   forced onto the CPU, matches the plain step: `PYTHONPATH=.gpu/v3 python $S/check_patches_cpu.py factored` gave 2.98e-08
#   on changes up to 4.24e-02 (two FedAvg rounds, MLP, K = 4). v4's two BFL rounds match HEAD's to 4.2e-07 on values
#   up to 0.47: `PYTHONPATH=.gpu/v4 python $S/check_patches_cpu.py flatten /tmp/v4.npy`, the same with `PYTHONPATH=.` to
#   /tmp/head.npy, then the largest absolute difference of the two arrays.
# Session 42 checked it again at d1bd360 (no code in bfedjax/ has changed since b942f5b): all patches apply (the factored
#   update's local_sgd.py hunks needed fuzz 2, so the patch was refreshed against d1bd360: the same added and removed
#   lines, new context; `git apply --check` takes it), v3's forced factored update matches the plain step to 2.98e-08 on changes up to 4.24e-02,
#   v4's BFL rounds match HEAD's to 2.0e-07 on values up to 0.47, and d833bca's tree archives.
# Preparation, here, from the repository root (.gpu/ is in .git/info/exclude), then run with carry [".gpu"]:
#   S=results/bench/gpu_h200_session16/scripts; rm -rf .gpu && mkdir -p .gpu/data .gpu/head .gpu/old .gpu/v2 .gpu/v3 .gpu/v4 .gpu/v5
#   cp /usr/share/datasets/fashion-mnist/*.gz .gpu/data/; cp $S/ctime.py $S/next_call.sh .gpu/
#   cp results/bench/session30_resnet_compile/scripts/compile_probe.py results/bench/session31_scanned_blocks/scripts/xla_pass_times.py .gpu/
#   cp results/bench/gpu_h100_targets/scripts/prof_round.py .gpu/
#   git archive HEAD bfedjax experiments | tar -x -C .gpu/head; git archive d833bca bfedjax experiments | tar -x -C .gpu/old
#   for v in v2 v3 v4; do git archive HEAD bfedjax experiments | tar -x -C .gpu/$v; done
#   git archive HEAD BUILD bfedjax experiments tests | tar -x -C .gpu/v5  # the patch touches BUILD and tests too
#   (cd .gpu/v5 && patch -p1 < ../../results/bench/session31_scanned_blocks/scanned_blocks.patch)
#   (cd .gpu/v4 && patch -p1 < ../../$S/optax_flatten.patch)
#   (cd .gpu/v2 && patch -p1 < ../../$S/factored_dense_update.patch)
#   (cd .gpu/v3 && patch -p1 < ../../$S/factored_dense_update.patch && patch -p1 < ../../$S/large_kernels_only.patch)
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data
G=$PWD/.gpu; nvidia-smi -L; lscpu | grep "Model name"; date +%T
for c in head old head v4; do (cd $G/$c && PYTHONPATH=$PWD timeout 90 python3 $G/ctime.py 2>&1 | grep CTIME | sed "s/^/$c /"); done | tee $OUT/ctime.txt
for v in scanned unscanned; do (cd $G/v5 && PYTHONPATH=$PWD:$G timeout 90 python3 $G/compile_probe.py $v 10 2>&1 | grep "^$v:" | sed "s/^/v5 /"); done | tee $OUT/scan.txt
SPECS="100:fedavg:mlp:4 1000:fedavg:mlp:4 100:fedavg:fedreg_cnn:4"
for c in head v2 v3; do (cd $G/$c && PYTHONPATH=$PWD NOPROF=1 timeout 90 python3 $G/prof_round.py $SPECS 2>&1 | grep TIME | sed "s/^/$c /"); done | tee $OUT/probes.txt
date +%T
WIN=$(python3 -c "
import re; t={}
for l in open('$OUT/probes.txt'):
    m=re.match(r'(\w+) TIME (\S+) .*median ([\d.]+) ms', l)
    if m: t[(m[1],m[2])]=float(m[3])
a,b,c='100:fedavg:mlp:4','1000:fedavg:mlp:4','100:fedavg:fedreg_cnn:4'
try: print('v3' if t['v3',a]<0.95*t['head',a] and t['v3',b]<=1.02*t['head',b] and t['v3',c]<=1.03*t['head',c] else 'head')
except KeyError: print('head')")
echo "bench: $WIN" | tee -a $OUT/probes.txt
[ "$WIN" = v3 ] && (cd $G/v3 && PYTHONPATH=$PWD timeout 240 python3 -m experiments.bench --noquick \
  --only="mlp K=100 B=10,mlp K=1000 B=10,fedreg_cnn K=100" --algorithms=fedavg \
  --backends=vmap,torch.func+compile,centralised --output_dir=$OUT/bench 2>&1 | grep -v "Warn\|warn" > $OUT/bench.log)
grep "^| \(mlp\|fed\)\|ceiling\|torch.func" $OUT/bench/bench.md 2>/dev/null; date +%T
(cd $G/head && PYTHONPATH=$PWD timeout 100 python3 -m experiments.bench_augment --rounds=5 2>&1 | grep "^|\|device" \
  | tee $OUT/augment.txt); date +%T
VMOD=gpu_compiler=1,nvptx_compiler=1,hlo_pass_pipeline=1,compile_module_to_llvm_ir=1,gemm_fusion_autotuner=1,conv_algorithm_picker=1,autotuner_util=1,ptx_compiler_impl=1
(cd $G/head && PYTHONPATH=$PWD TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$VMOD timeout 120 python3 $G/ctime.py 2>&1 \
  | tee >(gzip > $OUT/xla_timers.log.gz) | python3 $G/xla_pass_times.py 40 > $OUT/xla_timers.txt); date +%T
