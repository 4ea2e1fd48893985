"""Where the variational ResNet-20 round's traced program is (BFL, K = 10, B = 32, ``ctime.resnet20_round``): equation
counts of the whole jaxpr, of the epoch scan and of its local-step loop, the top level's equations by the
library line that made them, and the local step's by the library (bfedjax, NumPyro, optax, Flax) line. From the
repository root: ``python results/bench/session30_resnet_compile/scripts/jaxpr_tree.py``."""
import collections
import sys

sys.path.insert(0, "results/bench/gpu_h200_session16/scripts")
import jax  # noqa: E402
from jax.extend import core as jcore  # noqa: E402

from bfedjax.core.layout import random_bits_lowering  # noqa: E402
from ctime import resnet20_round  # noqa: E402

LIBRARIES = ("bfedjax", "numpyro", "optax", "flax")


def subjaxprs(eqn):
    for value in eqn.params.values():
        for x in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def every_eqn(jaxpr, out=None):
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for sub in subjaxprs(eqn):
            every_eqn(sub, out)
    return out


def origin(eqn, libraries=LIBRARIES):
    tb = eqn.source_info.traceback
    for frame in tb.frames if tb else []:
        if any(name in frame.file_name for name in libraries):
            return f"{frame.file_name.split('site-packages/')[-1].split('bfedjax/')[-1]}:{frame.line_num}:{frame.function_name}"
    return "(no library frame)"


def main():
    _, step, state, arrays, hparams = resnet20_round()
    with random_bits_lowering():
        jaxpr = step.trace(state, arrays, jax.random.PRNGKey(0), hparams).jaxpr.jaxpr
    scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    loop = next(e for e in scan.params["jaxpr"].jaxpr.eqns if e.primitive.name == "while")
    body = loop.params["body_jaxpr"].jaxpr
    print(f"equations: all {len(every_eqn(jaxpr))}, top level {len(jaxpr.eqns)}, epoch scan "
          f"{len(every_eqn(scan.params['jaxpr'].jaxpr))}, local-step loop body {len(every_eqn(body))}")
    print("\ntop level (outside the epoch scan: client_init, client_final, the server half), by bfedjax line:")
    for where, count in collections.Counter(origin(e, ("bfedjax",)) for e in jaxpr.eqns).most_common(20):
        print(f"{count:6d} {where}")
    print("\nlocal-step loop body, by library line:")
    for where, count in collections.Counter(origin(e) for e in every_eqn(body)).most_common(25):
        print(f"{count:6d} {where}")


if __name__ == "__main__":
    main()
