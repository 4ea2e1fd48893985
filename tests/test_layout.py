"""The layout simulate picks by itself (``clients_per_chunk="auto"``, ``bfedjax.core.layout``)."""
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bfedjax as bf
from bfedjax.core import layout
from bfedjax.core.round_config import RoundConfig, init_state

simulate_module = sys.modules["bfedjax.core.simulate"]


@pytest.fixture(scope="module")
def digits_fed():
    data = bf.data.load("digits")
    parts = bf.data.partition(data.y_train, "iid", 6, seed=0)
    return bf.data.stack_clients(data.x_train, data.y_train, parts, x_test=data.x_test, y_test=data.y_test,
                                 num_classes=10, name="digits")


@pytest.fixture(scope="module")
def images_fed():
    """4 clients x 8 random 28x28x1 images (the CNN is only traced)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 28, 28, 1)).astype(np.float32), rng.integers(0, 10, 32).astype(np.int32)
    return bf.data.stack_clients(x, y, np.split(np.arange(32), 4), x_test=x[:4], y_test=y[:4], num_classes=10)


def _state(algorithm, fed, client_groups=None):
    config = RoundConfig(fed.num_clients, fed.num_clients, client_groups=client_groups)
    params = algorithm.init_params(jax.random.PRNGKey(0), fed.input_shape)
    return config, init_state(algorithm, params, config)


def _auto_layout(algorithm, fed, config, state):
    return simulate_module.auto_layout(algorithm, config, state, simulate_module.round_arrays(fed))


def test_convolutional_models_are_recognised_by_their_kernels(digits_fed, images_fed):
    """Conv kernels [H, W, I, O] in the global model, or [N_group, H, W, I, O] in grouped local models."""
    cnn = bf.algorithms.build("fedavg", bf.models.get_model("lenet", 10), images_fed, batch_size=4)
    mlp = bf.algorithms.build("fedavg", bf.models.get_model("mlp", 10, hidden=(32,)), digits_fed, batch_size=16)
    _, cnn_state = _state(cnn, images_fed)
    _, mlp_state = _state(mlp, digits_fed)
    assert layout.has_conv_kernels(cnn.global_params(cnn_state.server), cnn_state.persistent)
    assert not layout.has_conv_kernels(mlp.global_params(mlp_state.server), mlp_state.persistent)
    # HBFL with an MLP meme and CNN local models: only the clients' persistent state holds conv kernels.
    local_models, groups = bf.models.client_architectures("mlp:2,lenet:2", 4, num_classes=10)
    hbfl = bf.algorithms.build("hbfl", bf.models.get_model("mlp", 10, hidden=(16,)), images_fed,
                               local_models=local_models, batch_size=4)
    config, state = _state(hbfl, images_fed, groups)
    assert not layout.has_conv_kernels(hbfl.global_params(state.server))
    assert layout.has_conv_kernels(hbfl.global_params(state.server), state.persistent)
    assert _auto_layout(hbfl, images_fed, config, state) == (1 if jax.default_backend() == "cpu" else None)


def test_dense_chunks_fit_the_cache_and_accelerators_chunk_only_for_memory():
    model_bytes, local_bytes = 10_000, 20_000
    client = local_bytes + layout.WORKING_COPIES * model_bytes + 100
    cache = int(client * 3.5)  # room for 3 clients' state
    pick = lambda convolutional=False, **kw: layout.auto_clients_per_chunk(
        convolutional=convolutional, model_bytes=model_bytes, local_state_bytes=local_bytes,
        persistent_bytes_per_client=100, **kw)
    assert pick(cohort=6, platform="cpu", cache_bytes=cache) == 3
    assert pick(cohort=2, platform="cpu", cache_bytes=cache) is None  # the whole cohort fits: one vmap
    assert pick(cohort=6, platform="cpu", cache_bytes=client) == 1  # never less than one client
    assert pick(convolutional=True, cohort=6, platform="cpu", cache_bytes=cache) == 1  # no grouped convolutions
    roomy = int(6 * client / layout.MEMORY_SHARE) + 1
    assert pick(cohort=6, platform="gpu", device_memory_bytes=roomy) is None  # one vmap: padding runs in parallel
    assert pick(convolutional=True, cohort=6, platform="gpu", device_memory_bytes=roomy) is None
    assert pick(cohort=6, platform="gpu", device_memory_bytes=None) is None
    assert pick(cohort=60, platform="gpu", device_memory_bytes=roomy) == 6  # 60 clients' state would not fit


def test_cpu_chunks_ignore_cache_beyond_the_cap_and_avoid_padded_chunks():
    mlp = 199_210 * 4  # the 784-200-200-10 MLP's float32 weights
    pick = lambda cohort, cache, local=mlp: layout.auto_clients_per_chunk(
        convolutional=False, model_bytes=mlp, local_state_bytes=local, persistent_bytes_per_client=0,
        cohort=cohort, platform="cpu", cache_bytes=cache)
    # a VM reporting its host's 480 MiB L3 gets the same chunks as a 32 MiB one: 10 FedAvg clients (weights),
    # 10 FOLA clients (weights and Fisher; one vmap of 10), 5 BFL clients (means, scales, Adam moments)
    assert pick(100, 480 * 2**20) == pick(100, 32 * 2**20) == 10
    assert pick(100, 480 * 2**20, local=2 * mlp) == 10 and pick(10, 480 * 2**20, local=2 * mlp) is None
    assert pick(100, 480 * 2**20, local=6 * mlp) == 5
    assert pick(100, 8 * 2**20) == 3  # a smaller cache bounds the chunk
    # room for 7 clients: 20 chunks of 5 (20 x 5.5 client slots with the per-chunk overhead) rather than
    # 15 chunks of 7 (105 slots, 15 x 7.5)
    assert layout.cheapest_chunk(100, 7) == 5
    assert layout.cheapest_chunk(97, 7) == 7  # 14 chunks, 98 slots: nothing smaller pads less
    assert layout.cheapest_chunk(97, 10) == 9  # 11 chunks of 9 (99 slots) beat 10 of 10 (100) by a hair
    assert layout.cheapest_chunk(100, 10) == 10 and layout.cheapest_chunk(6, 3) == 3
    assert layout.cheapest_chunk(5, 20) == 5 and layout.cheapest_chunk(5, 1) == 1  # within [1, cohort]


def test_simulate_reports_the_auto_layout_and_it_changes_only_rounding(digits_fed, monkeypatch):
    mlp = bf.algorithms.build("fedavg", bf.models.get_model("mlp", 10, hidden=(32,)), digits_fed, batch_size=16)
    config, state = _state(mlp, digits_fed)
    client = (1 + layout.WORKING_COPIES) * layout.tree_bytes(state.server)  # FedAvg's local state: the weights
    assert simulate_module.local_state_bytes(mlp, config, state, simulate_module.round_arrays(digits_fed)) == \
        pytest.approx(layout.tree_bytes(state.server), abs=64)  # and a few scalars
    monkeypatch.setattr(layout, "CHUNK_STATE_BYTES", int(2.5 * client))  # room for 2 of the 6 clients
    expected = 2 if jax.default_backend() == "cpu" else None  # accelerators: one vmap unless memory is short
    assert _auto_layout(mlp, digits_fed, config, state) == expected
    run = lambda chunk: bf.simulate(mlp, digits_fed, rounds=2, key=jax.random.PRNGKey(3), clients_per_chunk=chunk)
    auto, one_vmap = run("auto"), run(None)
    assert auto.clients_per_chunk == expected and one_vmap.clients_per_chunk is None
    chex.assert_trees_all_close(auto.state.server, one_vmap.state.server, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(auto.metrics["global_accuracy"], one_vmap.metrics["global_accuracy"], atol=2e-3)
    with pytest.raises(ValueError, match="give a number of clients >= 1, None"):
        run("fast")


def test_rounds_lower_random_bits_with_the_threefry_kernel_on_a_gpu(digits_fed, monkeypatch):
    """On a GPU (``jax.default_backend`` patched) the context turns on JAX's threefry-kernel setting and restores it;
    off a GPU, or with ``GPU_THREEFRY_KERNEL`` False, it leaves it alone; ``simulate`` runs every round in it."""
    setting = lambda: jax.config.jax_threefry_gpu_kernel_lowering
    assert setting() is False
    with layout.random_bits_lowering():
        assert setting() is False  # this CPU
    monkeypatch.setattr(layout.jax, "default_backend", lambda: "gpu")
    with layout.random_bits_lowering():
        assert setting() is True
    assert setting() is False
    # the kernel's custom call is what a CUDA lowering of a draw holds inside the context, and only there
    draw = jax.jit(lambda key: jax.random.normal(key, (4,))).trace(jax.random.PRNGKey(0))
    for_cuda = lambda: draw.lower(lowering_platforms=("cuda",)).as_text()
    with layout.random_bits_lowering():
        assert "threefry2x32_ffi" in for_cuda()
    assert "threefry2x32_ffi" not in for_cuda()
    with layout.random_bits_lowering(sharded=True):  # a mesh's rounds keep JAX's setting
        assert setting() is False
    monkeypatch.setattr(layout, "GPU_THREEFRY_KERNEL", False)
    with layout.random_bits_lowering():
        assert setting() is False
    monkeypatch.undo()
    entered = []
    real = layout.random_bits_lowering
    monkeypatch.setattr(layout, "random_bits_lowering", lambda **kw: (entered.append(kw), real(**kw))[1])
    mlp = bf.algorithms.build("fedavg", bf.models.get_model("mlp", 10, hidden=(8,)), digits_fed, batch_size=16)
    bf.simulate(mlp, digits_fed, rounds=2, key=jax.random.PRNGKey(0))
    assert entered == [{"sharded": False}] * 2


def test_cache_size_is_read_from_the_os():
    size = layout.last_level_cache_bytes()
    assert isinstance(size, int) and size >= 2**15
    assert layout.tree_bytes({"a": jnp.zeros((3, 4)), "b": jnp.zeros(5, jnp.int8)}) == 3 * 4 * 4 + 5


def test_client_devices_split_a_cpus_chunks_and_name_their_fixes(digits_fed):
    """``auto_client_devices``: every CPU device, at most one per chunk; accelerators and a single device: 1.
    (The split rounds equal the 1-device ones in tests/sharding_check.py, on 8 forced CPU devices.)"""
    auto = layout.auto_client_devices
    assert auto(platform="cpu", local_devices=2, clients_per_chunk=1, cohort=10) == 2
    assert auto(platform="cpu", local_devices=8, clients_per_chunk=5, cohort=10) == 2  # two chunks
    assert auto(platform="cpu", local_devices=8, clients_per_chunk=None, cohort=6) == 6  # one vmap: a client each
    assert auto(platform="cpu", local_devices=1, clients_per_chunk=1, cohort=10) == 1
    assert auto(platform="gpu", local_devices=4, clients_per_chunk=1, cohort=10) == 1
    # every device holds a copy of the data and state: no more devices than half the RAM holds copies
    assert auto(platform="cpu", local_devices=8, clients_per_chunk=1, cohort=10, replicated_bytes=3 * 2**30,
                memory_bytes=16 * 2**30) == 2
    assert auto(platform="cpu", local_devices=8, clients_per_chunk=1, cohort=10, replicated_bytes=9 * 2**30,
                memory_bytes=16 * 2**30) == 1
    assert layout.physical_memory_bytes() > 2**28
    sizes = dict(convolutional=False, model_bytes=10**6, local_state_bytes=10**6, persistent_bytes_per_client=0,
                 cohort=100, cache_bytes=2**30)
    assert layout.auto_clients_per_chunk(platform="cpu", **sizes) == 10  # one device: chunks that fit 32 MiB
    assert layout.auto_clients_per_chunk(platform="cpu", devices=2, **sizes) == 1  # a device per core: in turn
    assert layout.auto_clients_per_chunk(platform="gpu", devices=2, **sizes) is None
    config = RoundConfig(10, 7, clients_per_chunk=2, client_devices=2)
    assert config.padded_cohort == 8  # a whole number of chunks on each device
    with pytest.raises(ValueError, match="fix: set clients_per_chunk"):
        RoundConfig(10, 7, client_devices=2)
    mlp = bf.algorithms.build("fedavg", bf.models.get_model("mlp", 10, hidden=(8,)), digits_fed, batch_size=16)
    run = lambda **kw: bf.simulate(mlp, digits_fed, rounds=1, key=jax.random.PRNGKey(0), **kw)
    if len(jax.local_devices()) == 1:  # this test process: one device, so "auto" is 1 and 2 names the fix
        assert run().client_devices == 1
        with pytest.raises(ValueError, match="use_cpu_cores"):
            run(client_devices=2)
        assert layout.use_cpu_cores(1) == 1  # already so: nothing to change
        with pytest.raises(RuntimeError, match="after JAX's first computation; fix: call it first"):
            layout.use_cpu_cores(2)
    with pytest.raises(ValueError, match="needs backend='vmap' and no mesh"):
        run(client_devices=2, backend="sequential")
    assert layout.usable_cores() >= 1
