"""Where XLA:CPU's compile of the round goes, from its log on stdin: HLO passes, and the kernels' LLVM and MLIR
code generation by fusion kind (thread time: kernels compile in parallel). From the repository root::

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=ir_compiler=1,cpu_compiler=1,hlo_pass_pipeline=1,fusion_compiler=1 \\
        python results/bench/session30_resnet_compile/scripts/compile_probe.py head 2>&1 \\
        | python results/bench/session31_scanned_blocks/scripts/xla_pass_times.py [TOP]

Only the lines of the round's own compile count (from the first mention of ``jit_round_step`` to its
``Compiling [jit_round_step]`` timer, or the end on a GPU). Every other timer XLA logged is summed too, by source
line and label (numbers blanked): on a GPU (``gpu_compiler=1,nvptx_compiler=1,...`` in ``TF_CPP_VMODULE``) these
are the ones to read."""
import collections
import re
import sys

UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}
TIME = r"time: ([\d.]+) (us|ms|s|min)\b"
PASS = re.compile(r"HLO pass: (\S+) " + TIME)
KERNEL = re.compile(r"Compiled (LLVM|MLIR) module: (?:__compute_module_)?(\S+?)(?:\.\d+)?_kernel_module " + TIME)
TOTAL = re.compile(r"(Compiling|Running HLO passes on) \[jit_round_step\].* " + TIME)
ANY_TIMER = re.compile(r"(\w+\.cc):\d+\] (.*?) " + TIME)


def main(top=10):
    passes, kernels, runs, totals = collections.Counter(), collections.Counter(), collections.Counter(), {}
    timers, timer_runs = collections.Counter(), collections.Counter()
    inside = False
    for line in sys.stdin:
        inside = inside or "jit_round_step" in line
        if not inside:
            continue
        if m := ANY_TIMER.search(line):
            label = (m[1], re.sub(r"[\d.]+", "#", m[2])[:90])
            timers[label] += float(m[3]) * UNITS[m[4]]
            timer_runs[label] += 1
        if m := TOTAL.search(line):
            totals[m[1]] = float(m[2]) * UNITS[m[3]]
            if m[1] == "Compiling":
                break
        elif m := PASS.search(line):
            passes[m[1]] += float(m[2]) * UNITS[m[3]]
        elif m := KERNEL.search(line):
            kernels[(m[1], m[2])] += float(m[3]) * UNITS[m[4]]
            runs[(m[1], m[2])] += 1
    print(f"round compile {totals.get('Compiling', 0):.1f} s, of which HLO passes "
          f"{totals.get('Running HLO passes on', 0):.1f} s")
    for name, seconds in passes.most_common(top):
        print(f"  pass {name}: {seconds:.2f} s")
    for backend in ("LLVM", "MLIR"):
        total = sum(v for (b, _), v in kernels.items() if b == backend)
        count = sum(n for (b, _), n in runs.items() if b == backend)
        print(f"{backend} kernels: {count}, {total:.1f} s of thread time")
        for (b, kind), seconds in kernels.most_common():
            if b == backend and seconds >= 0.05 * total:
                print(f"  {kind} x{runs[(b, kind)]}: {seconds:.1f} s")
    print("every timer, by source and label (nested timers overlap):")
    for (source, label), seconds in timers.most_common(top):
        print(f"  {seconds:8.2f} s x{timer_runs[(source, label)]:<5d} {source}: {label}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
