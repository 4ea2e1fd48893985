#!/bin/bash
# Session 16 GPU call 3: the factored dense update with its Gram products behind an optimisation barrier (working tree) against HEAD (.gpu/base).
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data
R=$PWD; nvidia-smi -L; date +%T
SPECS="100:fedavg:mlp:4 1000:fedavg:mlp:4"
probe() { NOPROF=1 timeout 45 python3 $R/.gpu/prof_round.py $SPECS 2>&1 | grep TIME | sed "s/^/$1 /"; }
(cd .gpu/base && export PYTHONPATH=$PWD && probe base) | tee $OUT/probes.txt
(export PYTHONPATH=$R && probe barrier) | tee -a $OUT/probes.txt; date +%T
WIN=$(python3 -c "
import re,sys; t={}
for l in open('$OUT/probes.txt'):
    m=re.match(r'(\w+) TIME (\S+) .*median ([\d.]+) ms', l)
    if m: t[(m[1],m[2])]=float(m[3])
k='100:fedavg:mlp:4'; print('barrier' if ('barrier',k) in t and ('base',k) in t and t[('barrier',k)] < 0.93*t[('base',k)] else 'base')")
echo "bench: $WIN" | tee -a $OUT/probes.txt
[ "$WIN" = barrier ] && PYTHONPATH=$R timeout 85 python3 -m experiments.bench --noquick --only="mlp K=100 B=10" --algorithms=fedavg \
  --backends=vmap,centralised --output_dir=$OUT/bench 2>&1 | grep -v "Warn\|warn\|W1127\|I1127" > $OUT/bench.log
grep "^| mlp\|ceiling" $OUT/bench/bench.md; date +%T
