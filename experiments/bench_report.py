"""Targets and the markdown table of experiments/bench.py, kept apart from its absl flags.

A row is a dict with at least ``config``, ``algorithm``, ``backend``, ``round_s``,
``peak_fraction``, ``aggregation_share`` and ``padded_work_ratio`` (see bench.py).
"""
from __future__ import annotations


def _find(rows, config, algorithm, backend):
    """The row of ``backend``; for "vmap", the fastest library variant (plain or chunked)."""
    found = [r for r in rows if r["config"] == config and r["algorithm"] == algorithm
             and (r["backend"] == backend or (backend == "vmap" and r["backend"].startswith("vmap")))]
    return min(found, key=lambda r: r["round_s"]) if found else None


def check_targets(rows, platform: str = "cpu") -> list[dict]:
    """Issue 3's targets on this run's rows (missing measurements are skipped).

    On a CPU these are the 2-core targets. On an accelerator the target is the
    vmapped round at least 20x the stepwise loop at K = 1000; the CPU targets'
    ratios are still listed, with ``met`` None (their goals were set for a CPU).
    """
    out = []
    on_cpu = platform == "cpu"

    def add(name, value, goal, met, cpu_goal=True):
        if cpu_goal and not on_cpu:
            goal, met = f"{goal} (CPU goal)", None
        out.append({"target": name, "value": value, "goal": goal, "met": None if met is None else bool(met)})

    if not on_cpu:
        for config in ("mlp K=1000 B=10", "mlp K=1000 B=50"):
            for algorithm in ("fedavg", "fola"):
                v, s = _find(rows, config, algorithm, "vmap"), _find(rows, config, algorithm, "stepwise")
                if v and s:
                    speedup = s["round_s"] / v["round_s"]
                    add(f"vmap speed-up over stepwise, {config} ({algorithm})", speedup, ">= 20x", speedup >= 20,
                        cpu_goal=False)
    for other, goal in (("stepwise", 2.0), ("torch", 2.0)):
        v, o = _find(rows, "mlp K=100 B=10", "fedavg", "vmap"), _find(rows, "mlp K=100 B=10", "fedavg", other)
        if v and o:
            add(f"vmap speed-up over {other}, K=100 B=10 (FedAvg)", o["round_s"] / v["round_s"], f">= {goal}x",
                o["round_s"] / v["round_s"] >= goal)
    v = _find(rows, "mlp K=100 B=50", "fedavg", "vmap")
    if v:
        add("fraction of matmul peak, MLP K=100 B=50", v["peak_fraction"], ">= 0.5", v["peak_fraction"] >= 0.5)
    for config in ("mlp K=100 B=10", "mlp K=100 B=50"):
        a, f = _find(rows, config, "fedavg", "vmap"), _find(rows, config, "fola", "vmap")
        if a and f:
            ratio = f["round_s"] / a["round_s"]
            add(f"FOLA round / FedAvg round, {config} (fastest library variant of each)", ratio, "<= 1.3x", ratio <= 1.3)
    shares = [r["aggregation_share"] for r in rows
              if r["aggregation_share"] is not None and r["config"] == "mlp K=100 B=10" and r["backend"] == "vmap"]
    if shares:
        add("aggregation share of a round, K=100 B=10 (worst algorithm)", max(shares), "<= 0.05", max(shares) <= 0.05)
    big = [r for r in rows if r["config"] == "mlp K=3400 B=10 chunks of 10" and r.get("memory_mb")]
    if big:
        worst = max(r["memory_mb"] for r in big)
        add("compiled round memory, K=3400 in chunks of 10 (worst algorithm)", worst / 1024, "<= 4 GB", worst <= 4096,
            cpu_goal=False)
    for config in ("fmnist dir0.01 N=20 B=32 chunks of 2", "power-law N=100 B=10 chunks of 4"):
        v, s = _find(rows, config, "fola", "vmap"), _find(rows, config, "fola", "stepwise")
        if v:
            add(f"padded-work ratio, {config}", v["padded_work_ratio"], "<= 1.25", v["padded_work_ratio"] <= 1.25,
                cpu_goal=False)
        if v and s:
            add(f"vmap speed-up over stepwise, {config} (FOLA)", s["round_s"] / v["round_s"], ">= 1.5x",
                s["round_s"] / v["round_s"] >= 1.5)
    return out


def markdown(report) -> str:
    m = report["machine"]
    lines = [f"Machine: {m['platform']} ({m['device']}), {m['cpu_count']} cores, jax {m['jax']}; "
             f"measured matmul peak {report['matmul_peak_gflops']:.1f} GFLOP/s; data {report['data']}.", "",
             "| configuration | algorithm | backend | round (s) | samples/s | GFLOP/s | % of peak | memory (MB) | aggregation share | padded work |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        mem = f"{r['memory_mb']:.0f}" if r.get("memory_mb") else "-"
        agg = f"{100 * r['aggregation_share']:.1f}%" if r["aggregation_share"] is not None else "-"
        lines.append(f"| {r['config']} | {r['algorithm']} | {r['backend']} | {r['round_s']:.3f} | {r['samples_per_s']:.0f} | "
                     f"{r['gflops']:.1f} | {100 * r['peak_fraction']:.1f} | {mem} | {agg} | {r['padded_work_ratio']:.2f} |")
    lines += ["", "| target | value | goal | met |", "|---|---|---|---|"]
    for t in report["targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['target']} | {t['value']:.3g} | {t['goal']} | {met} |")
    return "\n".join(lines) + "\n"
