"""cProfile of the first trace of the variational ResNet-20 round on the accelerators' path (as trace_gpu_path.py),
cumulative seconds of the functions named. Run from the repository root:
PYTHONPATH=. python results/bench/session15_cpu_trace/scripts/profile_first_trace.py"""
import cProfile, io, os, pstats, runpy, sys
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_gpu_path.py")
source = open(script).read().replace("for i in range(3):", "for i in range(1):")
profile = cProfile.Profile()
profile.enable()
exec(compile(source, script, "exec"), {"__name__": "__main__"})
profile.disable()
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(
    r"(engine|client_half).py.*\(local_training\)|(engine|client_half).py.*\(scanned_steps\)|svi.py.*\(init\)|\(_setup_prototype\)|"
    r"\(find_valid_initial_params\)|layout.py.*\(auto_unroll_local_steps\)|\(make_jaxpr_f\)")
print(out.getvalue().split("ncalls")[-1])
