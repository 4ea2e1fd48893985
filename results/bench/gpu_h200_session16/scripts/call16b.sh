#!/bin/bash
# Session 16 GPU call 2: the variational ResNet-20 round's compile with XLA options, one process each.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L; lscpu | grep "Model name\|^CPU(s)\|MHz"; date +%T
for o in "" "xla_gpu_autotune_level=0" "xla_gpu_enable_llvm_module_compilation_parallelism=true" "xla_gpu_force_compilation_parallelism=16"; do
  timeout 80 python3 .gpu/ctime.py $o 2>&1 | grep "CTIME\|Error\|rror:" | tail -2; date +%T
done | tee $OUT/ctime.txt
