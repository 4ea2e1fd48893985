"""The benchmark's anchors: the torch.func round against the PyTorch loop, the centralised ceiling, the roofline."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bfedjax as bf
from experiments import bench_anchors, bench_torch

CLIENTS, SAMPLES = 4, 20


@pytest.fixture(scope="module")
def fed(digits):
    """4 clients x 20 digits (8x8x1), equal sizes."""
    parts = np.arange(CLIENTS * SAMPLES).reshape(CLIENTS, SAMPLES)
    return bf.data.stack_clients(digits.x_train, digits.y_train, list(parts), x_test=digits.x_test[:10],
                                 y_test=digits.y_test[:10], num_classes=10, name="digits")


def _both_rounds(fed, algorithm, batch_size, rounds=2, local_epochs=2, compiled=False, clip_norm=10.0):
    """The loop's and the stacked round's global parameters and precisions after ``rounds`` rounds from the same
    initial weights and batch orders."""
    net = bench_torch.build_model(fed, "mlp", (16,), seed=0)
    names = [k for k, _ in net.named_parameters()]
    start = [p.detach().clone() for p in net.parameters()]
    loop = (list(start), [torch.zeros_like(p) for p in start])
    func = (dict(zip(names, start)), {k: torch.zeros_like(p) for k, p in zip(names, start)})
    clients = [bench_torch._client_tensors(torch, fed, n, "mlp", "cpu") for n in range(fed.num_clients)]
    xs, ys = bench_torch.stacked_clients(fed, "mlp")
    weights = torch.from_numpy(fed.weights)
    step = bench_torch.make_local_step(net, algorithm=algorithm, compiled=compiled, clip_norm=clip_norm)
    rng = np.random.default_rng(0)
    for r in range(1, rounds + 1):
        orders = bench_torch.draw_orders(rng, fed.counts, local_epochs)
        loop = bench_torch.loop_round(net, *loop, clients, fed.weights, orders, algorithm=algorithm,
                                      batch_size=batch_size, round_index=r, clip_norm=clip_norm)
        func = bench_torch.func_round(step, *func, xs, ys, weights, torch.from_numpy(np.asarray(orders)),
                                      algorithm=algorithm, batch_size=batch_size, round_index=r)
    as_list = lambda tree: [tree[k] for k in names]  # noqa: E731
    return start, loop, (as_list(func[0]), as_list(func[1]))


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("algorithm", ["fedavg", "fola"])
def test_stacked_round_equals_the_loop(fed, algorithm):
    # B = 8 over 20 samples: a last batch of 4 (FOLA's Fisher weighs it 4/20); 2 epochs, 2 rounds (FOLA's prior on);
    # clip_norm 1 clips some clients' steps (without the clipping the parameters differ by 4e-3).
    start, (loop_params, loop_prec), (func_params, func_prec) = _both_rounds(fed, algorithm, batch_size=8,
                                                                             clip_norm=1.0)
    assert _max_diff(loop_params, start) > 1e-3  # the rounds trained
    assert _max_diff(func_params, loop_params) < 1e-5
    if algorithm == "fola":
        assert min(float(p.min()) for p in loop_prec) >= 0 and max(float(p.max()) for p in loop_prec) > 1e-4
        assert _max_diff(func_prec, loop_prec) < 1e-5 * max(float(p.abs().max()) for p in loop_prec)


def test_compiled_step_equals_eager(fed):
    # FOLA's step covers FedAvg's (gradient, clip, update) plus the Fisher and prior; B = 10: one batch shape,
    # one compilation (about 15 s cold on 2 loaded cores).
    _, _, (eager, eager_prec) = _both_rounds(fed, "fola", batch_size=10, rounds=2, local_epochs=1, clip_norm=1.0)
    _, _, (compiled, compiled_prec) = _both_rounds(fed, "fola", batch_size=10, rounds=2, local_epochs=1,
                                                   clip_norm=1.0, compiled=True)
    assert _max_diff(compiled, eager) < 1e-5
    assert _max_diff(compiled_prec, eager_prec) < 1e-6


def test_time_func_rounds_times_each_round_and_needs_equal_clients(fed, small_fed):
    times = bench_torch.time_func_rounds(fed, algorithm="fedavg", batch_size=10, hidden=(16,), rounds=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    with pytest.raises(ValueError, match="fix: use a uniform split"):
        bench_torch.time_func_rounds(small_fed, algorithm="fedavg", batch_size=10, hidden=(16,))


def test_centralised_batches_take_every_clients_sth_batch(fed):
    x, y = bench_anchors.centralised_batches(fed, batch_size=5)
    assert x.shape == (SAMPLES // 5, CLIENTS * 5, 8, 8, 1) and y.shape == (SAMPLES // 5, CLIENTS * 5)
    np.testing.assert_array_equal(x[2, 5:10], fed.x[1, 10:15])  # step 2: client 1's samples 10..14
    np.testing.assert_array_equal(y[3, 15:20], fed.y[3, 15:20])
    with pytest.raises(ValueError, match="fix: pick a batch_size dividing 20"):
        bench_anchors.centralised_batches(fed, batch_size=8)


def test_centralised_epoch_is_plain_sgd_on_k_times_b_samples(fed, tiny_model):
    x, y = bench_anchors.centralised_batches(fed, batch_size=10)  # 2 steps of 40 samples
    params = tiny_model.init(jax.random.PRNGKey(0), x[0, :1])["params"]
    out, losses = bench_anchors.make_centralised_epoch(tiny_model, lr=0.5)(params, x, y)
    assert losses.shape == (2,)

    def loss(p, xb, yb):  # by hand: mean softmax cross-entropy, theta -= lr * gradient
        logits = tiny_model.apply({"params": p}, xb)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(yb)), yb])

    expected, gradient = params, jax.jit(jax.grad(loss))  # jitted: one compilation, not one per operation
    for s in range(2):
        expected = jax.tree.map(lambda p, g: p - 0.5 * g, expected, gradient(expected, x[s], y[s]))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert float(jax.jit(loss)(out, x.reshape(-1, 8, 8, 1), y.reshape(-1))) < float(losses[0])


def test_centralised_round_seconds_times_compile_then_runs(fed, tiny_model):
    first, best = bench_anchors.centralised_round_seconds(tiny_model, fed, batch_size=10, rounds=2)
    assert 0 < best < first  # the first call compiles


def test_round_traffic_and_roofline_by_hand():
    assert bench_anchors.round_traffic_bytes(1000, 10, 5, "fedavg") == 4 * 1000 * 4 * 10 * 5
    assert bench_anchors.round_traffic_bytes(1000, 10, 5, "fola") == 8 * 1000 * 4 * 10 * 5
    with pytest.raises(ValueError, match="fix: pass one of them"):
        bench_anchors.round_traffic_bytes(1000, 10, 5, "bfl")
    assert bench_anchors.roofline_seconds(2e9, 1e6, peak_flops=1e9, bandwidth=1e9) == 2.0  # compute bound
    assert bench_anchors.roofline_seconds(1e6, 3e9, peak_flops=1e9, bandwidth=1e9) == 3.0  # memory bound
    with pytest.raises(ValueError, match="positive"):
        bench_anchors.roofline_seconds(1, 1, peak_flops=0, bandwidth=1)


def test_memory_bandwidth_is_a_plausible_rate():
    bandwidth = bench_anchors.memory_bandwidth_bytes_per_s(8 * 2**20, repeats=3)
    assert 1e8 < bandwidth < 1e13  # 0.1 GB/s .. 10 TB/s
    with pytest.raises(ValueError, match="fix: at least 4 bytes"):
        bench_anchors.memory_bandwidth_bytes_per_s(2)
