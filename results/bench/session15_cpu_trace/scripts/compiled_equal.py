"""A BFL round (10 clients, the CPU's default path; MODEL mlp or resnet20) compiled; its optimised HLO written to
the file named, without instruction metadata and without the source tables (file names, functions, line
numbers, stack frames) that the metadata points into; prints how many table lines it dropped. Compare the
files of two checkouts with cmp. PYTHONPATH=<checkout> python compiled_equal.py MODEL OUT"""
import re, sys, jax, bfedjax as bf
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps
from bfedjax.core.simulate import round_arrays, traced_hparams
model_name, out = sys.argv[1], sys.argv[2]
fed = federation(10, SHAPES[model_name], **({"n": 96} if model_name == "resnet20" else {}))
model = bf.models.get_model(model_name, 10, **({"hidden": (200, 200)} if model_name == "mlp" else {}))
algo = bf.algorithms.build("bfl", model, fed, batch_size=10 if model_name == "mlp" else 32).replace(evaluate=None)
arrays = round_arrays(fed); cfg = with_fixed_local_steps(RoundConfig(10, 10, evaluate_local=False), arrays)
state = init_state(algo, algo.init_params(jax.random.PRNGKey(0), fed.input_shape), cfg)
text = make_round_step(algo, cfg, "vmap").lower(state, arrays, jax.random.PRNGKey(0), traced_hparams(algo, 1)).compile().as_text()
lines = re.sub(r", metadata=\{[^}]*\}", "", text).splitlines()
tables = {"FileNames", "FunctionNames", "FileLocations", "StackFrames"}
kept = [l for l in lines if not (l in tables or re.match(r"^\d+ ", l))]
open(out, "w").write("\n".join(kept))
print(f"{model_name}: {len(kept)} lines kept, {len(lines) - len(kept)} table lines dropped")
