#!/usr/bin/env bash
# FedRef-code with and without the authors' Delta-R bug (spec decision 2) on the MNIST-5k preset, 20 rounds, at the
# library's standardised pixels and at the spec's [0, 1] ones (section 5):
#     bash results/fedref_ref_delta_check/run.sh > results/fedref_ref_delta_check/run.txt
set -euo pipefail
for pixels in standardised unit; do
  for fix in fedref_fix_ref_delta nofedref_fix_ref_delta; do
    python -m experiments.run --flagfile=experiments/configs/fedref/mnist_5k.flags --rounds=20 --pixels=$pixels \
      --$fix --noevaluate_local --output_dir=out/fedref_ref_delta/${pixels}_$fix --noresume 2>&1 \
      | grep -E "^round +(1|5|10|15|20) |^done" | sed "s/  [0-9.]*s$//; s/^/--pixels=$pixels --$fix: /"
  done
done
