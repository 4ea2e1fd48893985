"""The BFL MLP round (10 clients, CPU default path) compiled; its optimised HLO without metadata and file names
written to the file named: compare the files of two checkouts with diff. PYTHONPATH=<checkout> python compiled_equal.py OUT"""
import re, sys, jax, bfedjax as bf
from experiments.bench_round import federation, SHAPES
from bfedjax.core import RoundConfig, init_state, make_round_step, with_fixed_local_steps
from bfedjax.core.simulate import round_arrays, traced_hparams
fed = federation(10, SHAPES["mlp"])
algo = bf.algorithms.build("bfl", bf.models.get_model("mlp", 10, hidden=(200, 200)), fed, batch_size=10).replace(evaluate=None)
arrays = round_arrays(fed); cfg = with_fixed_local_steps(RoundConfig(10, 10, evaluate_local=False), arrays)
state = init_state(algo, algo.init_params(jax.random.PRNGKey(0), fed.input_shape), cfg)
text = make_round_step(algo, cfg, "vmap").lower(state, arrays, jax.random.PRNGKey(0), traced_hparams(algo, 1)).compile().as_text()
text = re.sub(r", metadata=\{[^}]*\}", "", text)
open(sys.argv[1], "w").write("\n".join(l for l in text.splitlines() if not re.match(r"^\d+ \{file_(location|name)", l) and "bfedjax/" not in l))
