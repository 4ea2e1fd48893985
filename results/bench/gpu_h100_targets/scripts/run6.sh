#!/bin/bash
# Session 8 GPU call 2: FedReg conv2's kernel gradient as a matrix product; cuBLAS vs Triton GEMMs; MLP step launches.
export PYTHONUNBUFFERED=1 BFEDJAX_DATA_DIR=$PWD/.gpu/data PYTHONPATH=$PWD
P="timeout 80 python3 .gpu/prof_round.py"
NT=xla_gpu_enable_triton_gemm=false
echo "=== cnn"
NOPROF=1 $P 100:fedavg:fedreg_cnn:4 100:fola:fola_cnn:4 2>&1 | grep TIME
DWMIB=64 $P 100:fedavg:fedreg_cnn:4 2>&1 | grep -v Warn | tee $OUT/prof_dw.txt | grep "TIME\|busy"
DWMIB=64 COPTS=$NT NOPROF=1 $P 100:fedavg:fedreg_cnn:4 100:fola:fola_cnn:4 100:fedavg:mlp:4 2>&1 | grep TIME
echo "=== mlp"
NOPROF=1 $P 100:fedavg:mlp:4 1000:fedavg:mlp:4 2>&1 | grep TIME
UNROLL=10 NOPROF=1 $P 100:fedavg:mlp:4 1000:fedavg:mlp:4 2>&1 | grep TIME
XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL NOPROF=1 $P 100:fedavg:mlp:4 100:fedavg:fedreg_cnn:4 2>&1 | grep "TIME\|rror" | head -3
echo "=== resnet lrt"
EST=local_reparameterization timeout 100 python3 .gpu/compile_opts.py lrt 2>&1 | grep "RESULT\|rror"
