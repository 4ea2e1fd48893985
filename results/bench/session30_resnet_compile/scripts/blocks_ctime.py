"""Compile time (CPU) of the variational ResNet round (BFL, K = 10, B = 32, built as ``ctime.resnet20_round``) against
the residual blocks per stage (``ResNet20(blocks_per_stage=k)``: 3k blocks; ResNet-20 is k = 3), and of the same
round with an MLP (hidden 200-200, on the same 32x32x3 images) for ``k = 0``: how much of the compile the blocks take, for a scanned ResNet-20
that would compile 5 distinct blocks instead of 9. From the repository root:
``python results/bench/session30_resnet_compile/scripts/blocks_ctime.py K``."""
import sys, time
sys.path.insert(0, "results/bench/gpu_h200_session16/scripts")
import jax
import bfedjax as bf
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps, with_own_buffers
from bfedjax.core.layout import random_bits_lowering
from bfedjax.core.simulate import round_arrays, traced_hparams
k = int(sys.argv[1])
fed = federation(10, SHAPES["resnet20"])
model = bf.models.ResNet20(10, blocks_per_stage=k) if k > 0 else bf.models.get_model("mlp", 10, hidden=(200, 200))
algo = bf.algorithms.build("bfl", model, fed, batch_size=32).replace(evaluate=None)
arrays = round_arrays(fed)
cfg = with_fixed_local_steps(RoundConfig(10, 10, evaluate_local=False), arrays)
params = algo.init_params(jax.random.PRNGKey(0), fed.input_shape)
state = with_own_buffers(init_state(algo, params, cfg), params)
step = make_round_step(algo, cfg, "vmap", donate_state=True)
hp = traced_hparams(algo, 1)
with random_bits_lowering():
    t0 = time.perf_counter(); traced = step.trace(state, arrays, jax.random.PRNGKey(0), hp)
    t1 = time.perf_counter(); lowered = traced.lower(); t2 = time.perf_counter()
    compiled = lowered.compile(); t3 = time.perf_counter()
text = compiled.as_text().splitlines()
print(f"blocks_per_stage={k} ({3 * k} blocks): trace {t1-t0:.2f}s lower {t2-t1:.2f}s xla {t3-t2:.2f}s "
      f"hlo_lines {len(text)} fusions {sum(' fusion(' in l for l in text)}", flush=True)
