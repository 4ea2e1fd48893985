"""Run by tests/test_sharding.py in a process with 8 forced CPU devices: 8-device results equal 1-device ones,
both with the client axis sharded over a mesh and with the cohort's chunks split over devices (client_devices)."""
import dataclasses
import os
import sys

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", "")
import chex  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import bfedjax as bf  # noqa: E402
from bfedjax.core.sharding import client_mesh  # noqa: E402
from readme_example import run_readme_code  # noqa: E402  (tests/ is this script's folder)

assert jax.device_count() == 8, jax.devices()
data = bf.data.load("digits")
parts = bf.data.partition(data.y_train[:500], "dirichlet_per_class", 5, seed=0, alpha=0.5)
fed = bf.data.stack_clients(data.x_train[:500], data.y_train[:500], parts, x_test=data.x_test, y_test=data.y_test,
                            num_classes=10)
nan_fed = dataclasses.replace(fed, x=np.where(np.arange(5)[:, None, None, None, None] == 3, np.nan, fed.x))
model = bf.models.get_model("mlp", 10, hidden=(16,))
mesh = client_mesh()
cases = {
    "fola_everyone": (bf.algorithms.fola(model, lr=0.1, lam=10.0, batch_size=16), {}),
    "fedcurv_loo_round_subsets": (bf.algorithms.fedcurv(model, lr=0.1, batch_size=16, variant="leave_one_out"),
                                  {"round_fractions": (0.5, 0.9)}),
    "scaffold_sampled": (bf.algorithms.scaffold(model, num_clients=5, lr=0.1, batch_size=16), {"clients_per_round": 3}),
    # streamed chunks with a NaN client (dropped) and two sign-flipping attackers
    "readme_fedavg_momentum_sampled_nan_attacked": (
        run_readme_code(definition_only=True)["fedavg_momentum"](model),
        {"clients_per_chunk": 2, "clients_per_round": 4, "fed": nan_fed, "attack": bf.core.Attack("sign_flip", 0.4)}),
    "hbfl_groups_sampled": (bf.algorithms.hbfl(model, input_shape=(8, 8, 1), batch_size=16, local_epochs=1,
                                               local_models=(bf.models.get_model("mlp", 10, hidden=(8,)),
                                                             bf.models.get_model("logistic", 10))),
        {"clients_per_round": 3, "client_groups": [0, 0, 1, 1, 1]}),
    # a non-streaming aggregation: every device gathers every client's message
    "median_sampled": (bf.algorithms.robust.with_robust_aggregation(bf.algorithms.fedavg(model, lr=0.1, batch_size=16),
                                                                    "median"), {"clients_per_round": 4}),
}
# The cohort's chunks over 4 devices (padded to a multiple of 4 chunks) for the cases with client state, sampling
# or dropped clients, over every device (auto) for the others: one split each, as each split is another compile.
AUTO_SPLIT = {"fola_everyone", "fedcurv_loo_round_subsets", "median_sampled"}
for name, (algo, kwargs) in cases.items():
    data_of_case = kwargs.pop("fed", fed)
    run = lambda **layout: bf.simulate(algo, data_of_case, rounds=2, key=jax.random.PRNGKey(0), **{**kwargs, **layout})
    one = run(client_devices=1)
    assert one.client_devices == 1
    for devices in ("auto",) if name in AUTO_SPLIT else (4,):
        split = run(client_devices=devices, clients_per_chunk=kwargs.get("clients_per_chunk", 1))
        chunks = -(-kwargs.get("clients_per_round", 5) // split.clients_per_chunk)
        assert split.client_devices == (4 if devices == 4 else min(8, chunks)), (split.client_devices, chunks)
        assert one.metrics["nonfinite_clients"] == split.metrics["nonfinite_clients"]
        np.testing.assert_allclose(one.metrics["global_accuracy"], split.metrics["global_accuracy"], atol=1e-6)
        np.testing.assert_allclose(one.metrics["local_accuracy"], split.metrics["local_accuracy"], atol=1e-6)
        chex.assert_trees_all_close(one.state, split.state, rtol=1e-5, atol=1e-6)
        assert len(jax.tree.leaves(split.state.server)[0].sharding.device_set) == split.client_devices
        print(name, "client_devices", split.client_devices, "ok", flush=True)
    eight = run(mesh=mesh, client_devices=1)
    assert one.metrics["nonfinite_clients"] == eight.metrics["nonfinite_clients"]
    assert (sum(one.metrics["nonfinite_clients"]) > 0) == (data_of_case is nan_fed), one.metrics["nonfinite_clients"]
    np.testing.assert_allclose(one.metrics["global_accuracy"], eight.metrics["global_accuracy"], atol=1e-6)
    np.testing.assert_allclose(one.metrics["local_accuracy"], eight.metrics["local_accuracy"], atol=1e-6)
    chex.assert_trees_all_close(one.state.server, eight.state.server, rtol=1e-5, atol=1e-6)
    if jax.tree.leaves(one.state.persistent):  # the mesh's empty clients join group 0 after its real ones
        chex.assert_trees_all_close(one.state.persistent, jax.tree.map(lambda a, b: b[:a.shape[0]],
                                                                       one.state.persistent, eight.state.persistent),
                                    rtol=1e-5, atol=1e-6)
    leaf = jax.tree.leaves(eight.state.server)[0]
    assert len(leaf.sharding.device_set) == 8, leaf.sharding
    print(name, "ok", flush=True)
# a device split the RAM cannot hold copies for falls back to one device, with the one-device chunks
bf.core.layout.REPLICA_MEMORY_SHARE, share = 1e-12, bf.core.layout.REPLICA_MEMORY_SHARE
algo = cases["fola_everyone"][0]
capped = bf.simulate(algo, fed, rounds=1, key=jax.random.PRNGKey(0))
one = bf.simulate(algo, fed, rounds=1, key=jax.random.PRNGKey(0), client_devices=1)
bf.core.layout.REPLICA_MEMORY_SHARE = share
assert capped.client_devices == 1 and capped.clients_per_chunk == one.clients_per_chunk, (
    capped.client_devices, capped.clients_per_chunk, one.clients_per_chunk)
print("SHARDING OK")
sys.exit(0)
