#!/bin/bash
# Session 8 GPU call 1: kernel breakdown of the target rounds; ResNet-20 compile under XLA compile options.
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)"
P="timeout 100 python3 .gpu/prof_round.py"
echo "=== prof"; $P 100:fedavg:mlp:4 100:fedavg:fedreg_cnn:4 2>&1 | grep -v Warn | tee $OUT/prof.txt | grep -v "^  .*x *[0-9.]*  " | head -20
COPTS=xla_gpu_enable_triton_gemm=false $P 100:fedavg:mlp:4 100:fedavg:fedreg_cnn:4 2>&1 | grep TIME
C="timeout 110 python3 .gpu/compile_opts.py"
{ $C default
$C autotune0 xla_gpu_autotune_level=0
$C notriton xla_gpu_enable_triton_gemm=false
$C par16 xla_gpu_force_compilation_parallelism=16
JAX_THREEFRY_GPU_KERNEL_LOWERING=1 $C threefry_kernel
JAX_THREEFRY_GPU_KERNEL_LOWERING=1 $C all xla_gpu_autotune_level=0 xla_gpu_enable_triton_gemm=false xla_gpu_force_compilation_parallelism=16
} 2>&1 | grep "RESULT\|failed\|rror" | tee $OUT/compile.txt
