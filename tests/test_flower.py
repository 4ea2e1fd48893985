"""bfedjax.flower: named arrays, refused replies, and FOLA over a real SuperLink with three SuperNodes.

The deployment test starts ``flower-superlink`` and three ``flower-supernode`` processes on 127.0.0.1
(``bfedjax.flower.local.LocalDeployment``: free ports, a private FLWR_HOME), submits
``experiments/flower_app`` with ``flwr run`` and checks the
server state after each round against ``bf.simulate`` with the same flags and key. The in-process tests
run the strategy and the ClientApp through ``LocalGrid`` (a Grid that calls the ClientApp directly).
"""
import pathlib
import shlex
import sys
import time
import uuid
from typing import NamedTuple

import jax
import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.app.metadata import Metadata  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

import bfedjax as bf  # noqa: E402
from bfedjax.core.types import ClientData  # noqa: E402
from bfedjax.flower import (AlgorithmStrategy, ClientSetup, MalformedRecordError, client_app, from_record,  # noqa: E402
                            leaf_names, record_problem, to_record)
from bfedjax.flower import protocol  # noqa: E402
from bfedjax.flower.local import LocalDeployment  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
APP = ROOT / "experiments" / "flower_app"
FLAGS = ("--algorithm=fola --dataset=digits --max_train=300 --num_clients=3 --hidden=16 --rounds=2 --lr=0.05 "
         "--lam=100 --seed=0")
DEPLOYMENT_TIMEOUT = 420  # seconds for the whole Flower run (about 60 on an idle 2-core machine)


# --- named arrays ----------------------------------------------------------------------------------


class Gaussian(NamedTuple):
    mean: np.ndarray
    precision: np.ndarray


def test_named_arrays_round_trip_a_nested_pytree_by_path():
    tree = {"b": [np.arange(6, dtype=np.float32).reshape(2, 3), (np.int32(7), np.array([True, False]))],
            "a": Gaussian(np.ones((4,), np.float64), np.full((1, 2), 3.0, np.float32))}
    record = to_record(tree)
    assert list(record) == leaf_names(tree)
    assert "['b'][1][0]" in record and "['a'].precision" in record
    # names, not order: the same arrays inserted in reverse order decode to the same tree
    shuffled = ArrayRecord({name: record[name] for name in reversed(list(record))})
    for back in (from_record(record, tree), from_record(shuffled, tree)):
        assert jax.tree.structure(back) == jax.tree.structure(tree)
        for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
            assert got.dtype == np.asarray(want).dtype and np.array_equal(got, want)
    # decoding reads the expected structure's names: a record of another tree is refused
    other = {"b": tree["b"], "a": {"mean": tree["a"].mean, "precision": tree["a"].precision}}
    assert "missing arrays" in record_problem(to_record(other), tree)
    with pytest.raises(MalformedRecordError, match="unexpected arrays"):
        from_record(ArrayRecord({**dict(record), "['c']": Array(np.zeros(1))}), tree)


# --- in-process federation -------------------------------------------------------------------------


class LocalGrid(Grid):
    """A Flower ``Grid`` whose nodes are ``client_app`` calls in this process (node ``1000 + n`` holds client n)."""

    def __init__(self, app, num_nodes: int):
        self.app = app
        self.contexts = {1000 + n: Context(run_id=1, node_id=1000 + n, node_config={"partition-id": n},
                                           state=RecordDict(), run_config={}) for n in range(num_nodes)}
        self.replies = {}
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0  # what a ServerApp process has

    def set_run(self, run):
        del run

    @property
    def run(self):
        raise NotImplementedError("LocalGrid has no Flower run")

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        """Runs the ClientApp on each message at once; its replies wait for ``pull_messages``."""
        ids = []
        for message in messages:
            meta = message.metadata
            sent = Message(content=message.content, metadata=Metadata(
                run_id=1, message_id=uuid.uuid4().hex, src_node_id=0, dst_node_id=meta.dst_node_id,
                reply_to_message_id="", group_id=meta.group_id, created_at=time.time(), ttl=meta.ttl,
                message_type=meta.message_type))
            try:
                reply = self.app(sent, self.contexts[meta.dst_node_id])
            except Exception as err:  # noqa: BLE001 - as a SuperNode, an exception becomes an error reply
                reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(err)), reply_to=sent)
            self.replies[sent.metadata.message_id] = reply
            ids.append(sent.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


@pytest.fixture(scope="module")
def three_clients(digits):
    parts = bf.data.partition(digits.y_train[:240], "dirichlet_per_class", 3, seed=0, alpha=0.5)
    return bf.data.stack_clients(digits.x_train[:240], digits.y_train[:240], parts, x_test=digits.x_test[:200],
                                 y_test=digits.y_test[:200], num_classes=10, name="digits")


def _setup_of(algorithm, fed):
    def setup(context):
        n = int(context.node_config["partition-id"])
        return ClientSetup(algorithm, n, ClientData(fed.x[n], fed.y[n], int(fed.counts[n])))
    return setup


def test_scaffold_in_process_matches_simulate_with_partial_participation(three_clients):
    """Persistent client state (control variates) lives in the nodes' Context.state; 2 of 3 clients per round."""
    fed = three_clients
    algorithm = bf.algorithms.scaffold(bf.models.get_model("mlp", 10, hidden=(8,)), num_clients=3, lr=0.05)
    key = jax.random.PRNGKey(3)
    records, servers = [], []
    strategy = AlgorithmStrategy(algorithm, num_clients=3, key=key, x_test=fed.x_test, y_test=fed.y_test,
                                 clients_per_round=2, on_round=lambda r, s: (records.append(r), servers.append(s)))
    strategy.start(LocalGrid(client_app(_setup_of(algorithm, fed)), 3), strategy.initial_arrays(), num_rounds=2)
    reference = bf.simulate(algorithm, fed, rounds=2, key=key, clients_per_round=2)
    assert [r["round"] for r in records] == [1, 2] and all(r["rejected_clients"] == 0 for r in records)
    np.testing.assert_allclose([r["global_accuracy"] for r in records], reference.metrics["global_accuracy"],
                               rtol=1e-5)
    for got, want in zip(jax.tree.leaves(servers[-1]), jax.tree.leaves(reference.state.server)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    moved = [np.max(np.abs(a - b))
             for a, b in zip(jax.tree.leaves(servers[0]["control"]), jax.tree.leaves(servers[1]["control"]))]
    assert max(moved) > 0  # the server control variate moved: the clients' persistent c_i took part


def _corrupted(reply: Message, kind: str) -> Message:
    """``reply`` with one defect of ``kind`` in its message or metrics."""
    arrays = dict(reply.content[protocol.MESSAGE])
    metrics = dict(reply.content[protocol.METRICS])
    name = sorted(arrays)[0]
    value = arrays[name].numpy()
    if kind == "wrong shape":
        arrays[name] = Array(np.zeros(value.shape + (2,), value.dtype))
    elif kind == "nan":
        bad = value.copy()
        bad.flat[0] = np.nan
        arrays[name] = Array(bad)
    elif kind == "missing name":
        del arrays[name]
    elif kind == "extra name":
        arrays["['params']['extra']"] = Array(np.zeros(3, np.float32))
    elif kind == "wrong dtype":
        arrays[name] = Array(value.astype(np.float64))
    elif kind == "metadata lies":  # the metadata says the expected shape; the bytes hold another
        other = Array(np.zeros(value.size + 1, value.dtype))
        arrays[name] = Array(dtype=str(value.dtype), shape=tuple(value.shape), stype=other.stype, data=other.data)
    elif kind == "num-examples":
        metrics[protocol.NUM_EXAMPLES] = int(metrics[protocol.NUM_EXAMPLES]) * 10
    content = RecordDict({protocol.MESSAGE: ArrayRecord(arrays), protocol.METRICS: MetricRecord(metrics)})
    return Message(content=content, metadata=reply.metadata)


KINDS = ("wrong shape", "nan", "missing name", "extra name", "wrong dtype", "metadata lies", "num-examples")


def test_a_malformed_reply_is_refused_logged_and_never_aggregated(three_clients, caplog):
    fed = three_clients
    algorithm = bf.algorithms.fola(bf.models.get_model("mlp", 10, hidden=(8,)), lr=0.05, lam=100.0)
    strategy = AlgorithmStrategy(algorithm, num_clients=3, key=jax.random.PRNGKey(0), x_test=fed.x_test,
                                 y_test=fed.y_test)
    grid = LocalGrid(client_app(_setup_of(algorithm, fed)), 3)
    start = strategy.initial_arrays()

    def aggregate(replies):
        strategy.configure_train(1, start, ConfigRecord(), grid)  # the round's state again (nodes registered once)
        arrays, metrics = strategy.aggregate_train(1, replies)
        return [a.numpy() for a in arrays.values()], metrics

    good = list(grid.send_and_receive(strategy.configure_train(1, start, ConfigRecord(), grid)))
    victim = next(r for r in good if r.content[protocol.METRICS][protocol.CLIENT_ID] == 1)
    everyone, _ = aggregate(good)
    without, metrics = aggregate([r for r in good if r is not victim])  # client 1 never answered
    assert metrics["rejected_clients"] == 1 and metrics["nonfinite_clients"] == 1
    assert any(not np.allclose(a, b) for a, b in zip(everyone, without))
    for kind in KINDS:
        caplog.clear()
        with caplog.at_level("WARNING", logger="flwr"):
            arrays, metrics = aggregate([_corrupted(r, kind) if r is victim else r for r in good])
        assert metrics["rejected_clients"] == 1, kind
        for got, want in zip(arrays, without):  # exactly as if client 1 had not answered
            np.testing.assert_array_equal(got, want, err_msg=kind)
        line = [m for m in caplog.messages if "rejected node" in m]
        assert line and f"node {victim.metadata.src_node_id} (client 1)" in line[0], (kind, caplog.messages)
    error = Message(error=Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "boom"), metadata=victim.metadata)
    _, metrics = aggregate([r for r in good if r is not victim] + [error])
    assert metrics["rejected_clients"] == 1


# --- a real SuperLink and three SuperNodes ---------------------------------------------------------


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """A SuperLink, three SuperNodes (partition-id 0, 1, 2) and the app submitted with ``flwr run``."""
    run_config = f'flags="{FLAGS}" wait-for-nodes=120.0'
    with LocalDeployment(APP, run_config, 3, tmp_path_factory.mktemp("flower"), timeout=DEPLOYMENT_TIMEOUT) as running:
        yield running


def test_fola_over_a_superlink_matches_simulate_round_by_round(deployment):
    from experiments import run as experiment
    run = experiment.prepare(["run", *shlex.split(FLAGS)])
    key = jax.random.PRNGKey(0)
    references = [bf.simulate(run.algorithm, run.fed, rounds=r, key=key) for r in (1, 2)]  # while Flower runs
    records = deployment.wait()
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["rejected_clients"] == 0 and r["nonfinite_clients"] == 0 for r in records)
    for record, reference in zip(records, references):
        r = record["round"]
        saved = np.load(deployment.output / f"server_round_{r}.npz")
        server = reference.state.server
        assert sorted(saved.files) == sorted(leaf_names(server))
        for name, want in zip(leaf_names(server), jax.tree.leaves(server)):
            np.testing.assert_allclose(saved[name], want, rtol=1e-5, atol=1e-7, err_msg=f"round {r} {name}")
        assert record["global_accuracy"] == pytest.approx(reference.metrics["global_accuracy"][-1], rel=1e-5)
    precision = [saved[name] for name in saved.files if name.startswith("['precision']")]
    assert precision and all(np.all(p >= 0) for p in precision) and max(p.max() for p in precision) > 0


def test_the_app_refuses_flags_a_deployment_cannot_honour():
    sys.path.insert(0, str(APP))
    try:
        import bfedjax_flower_app as app
    finally:
        sys.path.remove(str(APP))
    with pytest.raises(ValueError, match="--attack cannot run over Flower; fix: drop"):
        app.prepared("--dataset=digits --max_train=100 --num_clients=2 --hidden=8 --attack=sign_flip")
