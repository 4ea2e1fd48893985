#!/bin/bash
# Session 16 GPU call: FedAvg's clipped step with dense kernels updated from factors (working tree) against
# HEAD (.gpu/base), then the issue-18 bench table with whichever is faster.
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data
R=$PWD; W="grep -v Warn\|warn\|W1127\|I1127\|W1128\|I1128"
nvidia-smi -L; python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__, jax.devices())"; date +%T
SPECS=${SPECS:-"100:fedavg:mlp:4 1000:fedavg:mlp:4 100:fedavg:fedreg_cnn:4"}
probe() { NOPROF=1 timeout 90 python3 $R/.gpu/prof_round.py $SPECS 2>&1 | grep TIME | sed "s/^/$1 /"; }
(cd .gpu/base && export PYTHONPATH=$PWD && probe base) | tee $OUT/probes.txt
(export PYTHONPATH=$R && probe factored) | tee -a $OUT/probes.txt
date +%T
PYTHONPATH=$R timeout 60 python3 .gpu/prof_round.py ${SPECS%% *} 2>&1 | $W | head -40 > $OUT/prof_factored.txt; head -25 $OUT/prof_factored.txt
WIN=$(python3 - $OUT/probes.txt <<'PY'
import sys, re
t = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) TIME (\S+) .*median ([\d.]+) ms", line)
    if m: t[(m[1], m[2])] = float(m[3])
try:
    mlp = t[("factored", "100:fedavg:mlp:4")] < 0.95 * t[("base", "100:fedavg:mlp:4")]
    k1000 = t[("factored", "1000:fedavg:mlp:4")] <= 1.02 * t[("base", "1000:fedavg:mlp:4")]
    cnn = t[("factored", "100:fedavg:fedreg_cnn:4")] <= 1.03 * t[("base", "100:fedavg:fedreg_cnn:4")]
    print("factored" if mlp and k1000 and cnn else "base")
except KeyError:
    print("base")
PY
)
echo "bench with: $WIN" | tee -a $OUT/probes.txt; date +%T
[ -n "$DRY" ] && exit; if [ "$WIN" = base ]; then cd .gpu/base; fi
PYTHONPATH=$PWD timeout 370 python3 -m experiments.bench --noquick --only="mlp K=100 B=10,mlp K=1000 B=10,fedreg_cnn K=100,fola_cnn K=100,resnet20" \
  --algorithms=fedavg,fola,bfl --backends=vmap,torch.func+compile,centralised --output_dir=$OUT/bench 2>&1 | $W > $OUT/bench.log
grep "^| \(mlp\|fed\|fola\|res\)\|ceiling\|torch.func\|compile" $OUT/bench/bench.md | grep -v "stepwise"; date +%T
