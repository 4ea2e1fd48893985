"""Flower deployment: any bfedjax algorithm as a Flower strategy, its clients as a ``ClientApp``.

    from bfedjax.flower import AlgorithmStrategy, ClientSetup, client_app

The server side is ``AlgorithmStrategy`` (a ``flwr.serverapp.strategy.Strategy``:
``strategy.start(grid, strategy.initial_arrays(), num_rounds)`` inside a
``ServerApp``); each SuperNode runs ``client_app(setup)`` with its client id,
data and group from ``setup(context)``. Pytrees travel as named arrays
(``records``); the message layout is in ``protocol``. Rounds reuse the
engine: cohorts and keys from ``sample_cohort`` and ``round_key``, training
from ``local_training``, aggregation from ``finish_round``, so a deployment
computes what ``bf.simulate`` computes with the same key. Needs the
``flower`` extra (``pip install 'bfedjax[flower]'``); ``experiments/flower_app``
is a ready app driven by ``experiments.run``'s flags.
"""
from bfedjax.optional import require

require("flwr")

from bfedjax.flower.client import ClientSetup, client_app  # noqa: E402
from bfedjax.flower.records import (MalformedRecordError, from_record, leaf_names, record_problem,  # noqa: E402
                                    to_record)
from bfedjax.flower.strategy import AlgorithmStrategy  # noqa: E402

__all__ = ["AlgorithmStrategy", "ClientSetup", "MalformedRecordError", "client_app", "from_record", "leaf_names",
           "record_problem", "to_record"]
