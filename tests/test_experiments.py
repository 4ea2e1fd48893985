"""The experiment binary: flags, validators, outputs, resume, and the flagfiles."""
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--dataset=digits", "--num_clients=4", "--hidden=16", "--batch_size=16", "--lr=0.1",
         "--partition=dirichlet_per_class", "--alpha=0.5", "--max_train=400"]


def _run(*flags, check=True):
    return subprocess.run([sys.executable, "-m", "experiments.run", *flags], cwd=ROOT, capture_output=True,
                          text=True, check=check, timeout=600)


def _script(module, *flags, env=None):
    """Runs ``python -m module flags`` from the repository root (``env``: variables added to this process's)
    and checks it exits cleanly."""
    out = subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_run_writes_metrics_and_resumes(tmp_path):
    out = _run(*SMALL, "--algorithm=fola", "--rounds=2", f"--output_dir={tmp_path}")
    assert "round    1  GA" in out.stdout and "round    2  GA" in out.stdout
    first = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in first] == [1, 2]
    # Another command's folder is not resumed: one line names the flag that differs, and nothing is touched.
    other = _run(*SMALL, "--algorithm=fola", "--rounds=3", "--lam=5", f"--output_dir={tmp_path}", check=False)
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert re.fullmatch(r"error: the checkpoint in \S+ \(round 2\) was saved by another run, which differs in "
                        r"lam 5\.0 \(saved: unset\); fix: a new --output_dir .*\n", other.stderr), other.stderr
    # Asking for 3 rounds in the same folder resumes after round 2, in another layout too.
    out = _run(*SMALL, "--algorithm=fola", "--rounds=3", "--clients_per_chunk=1", f"--output_dir={tmp_path}")
    assert "round    1  GA" not in out.stdout and "round    3  GA" in out.stdout
    again = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_accuracy"] for r in again[:2]] == [r["global_accuracy"] for r in first]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best_global_accuracy"] == max(r["global_accuracy"] for r in again)


def test_helpshort_lists_the_algorithm_flags_too():
    """The README points at --helpshort for the flags: the algorithms' (experiments.algorithm_flags) are listed
    beside the binary's own, not only under --helpfull."""
    out = subprocess.run([sys.executable, "-m", "experiments.run", "--helpshort"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    listed = set(re.findall(r"^  --(?:\[no\])?(\w+):", out.stdout + out.stderr, re.M))
    assert {"algorithm", "lr", "lam", "rule", "weighting", "fedref_server_lr", "dataset", "rounds", "attack"} <= listed


def test_attack_robust_rule_and_nonfinite_flags_reach_the_rounds(tmp_path):
    """--attack / --attack_fraction / --robust_rule / --on_nonfinite from the command line: the header names the
    rule and the attack, the NaN senders are left out and counted on the round line, or stop the run in one line."""
    flags = [*SMALL, "--algorithm=fedavg", "--rounds=1", "--attack=nan", "--attack_fraction=0.5",
             "--robust_rule=median", "--noevaluate_local"]
    out = _run(*flags, f"--output_dir={tmp_path / 'drop'}")
    assert out.stdout.startswith("fedavg+median on digits") and "attack nan by 50% of the clients" in out.stdout
    assert re.search(r"^round    1  GA .*\(2 non-finite clients left out\)$", out.stdout, re.M)
    record = json.loads((tmp_path / "drop" / "metrics.jsonl").read_text())
    assert record["nonfinite_clients"] == 2 and np.isfinite(record["global_loss"])
    stop = _run(*flags, "--on_nonfinite=stop", f"--output_dir={tmp_path / 'stop'}", check=False)
    assert stop.returncode == 2 and "Traceback" not in stop.stderr
    assert re.fullmatch(r"error: round 1: client \d sent NaN or Inf \(2 client\(s\) this round\); fix: .*\n",
                        stop.stderr)


def test_server_pretraining_flag_and_options_of_other_algorithms(tmp_path):
    out = _run(*SMALL, "--algorithm=fedavg", "--rounds=1", "--pretrain_fraction=0.2", "--pretrain_epochs=2",
               "--pretrain_disjoint", "--lam=5", "--eta_s=0.1", f"--output_dir={tmp_path}")
    assert "pre-trained the server model on 80 training samples for 2 epochs (removed from the clients)" in out.stdout
    # a flagfile may hold options of other algorithms: one line says which are ignored
    assert "note: --lam, --eta_s do not apply to --algorithm=fedavg (ignored)" in out.stderr


def test_early_stopped_pretraining_augmentation_and_weight_decay_flags(tmp_path):
    out = _run(*SMALL, "--algorithm=fedavg", "--optimizer=adam", "--lr=0.01", "--weight_decay=1e-4",
               "--augment=shift_flip", "--rounds=1", "--pretrain_fraction=0.2", "--pretrain_epochs=3",
               "--pretrain_validation_fraction=0.25", "--pretrain_patience=1", f"--output_dir={tmp_path}")
    assert "for 3 epochs at most, stopping early" in out.stdout and "round    1  GA" in out.stdout


def test_bfl_pretrains_against_its_fixed_prior_under_dwc_and_prior_update():
    """Fischer et al. pre-train the Bayesian network by ordinary training (spec D17, Table 4): DWC and
    --prior_update, run as they are, made each pre-training epoch's prior the previous epoch's posterior (the DWC
    and WS rows of Table 4 then started from different pre-training)."""
    import chex
    import jax
    import bfedjax as bf
    from experiments import run

    def pretrained(*flags, own=False):
        experiment = run.prepare(["run", *SMALL, "--algorithm=bfl", "--pretrain_fraction=0.2", "--seed=3", *flags])
        x, y = experiment.server_data
        return bf.core.pretrain(experiment.algorithm if own else experiment.pretrainer, x, y, epochs=2,
                                key=jax.random.PRNGKey(0), num_classes=10, validation_fraction=0.25)

    ws = pretrained("--rule=ws")
    for flags in (["--rule=dwc"], ["--rule=ws", "--prior_update", "--prior_temperature=0.5"]):
        chex.assert_trees_all_close(pretrained(*flags), ws, rtol=1e-5, atol=1e-7)
    moving = pretrained("--rule=dwc", own=True)  # the run's own DWC clients, as before
    assert max(float(abs(a - b).max()) for a, b in zip(jax.tree.leaves(moving), jax.tree.leaves(ws))) > 1e-3


def test_fola_table2_preset_runs_with_its_table1_augmentation_on_tfds_mock_cifar10(tmp_path):
    out = subprocess.run([sys.executable, "tests/tfds_mock_run.py", "--flagfile=experiments/configs/fola_cifar10_table2.flags",
                          "--rounds=1", "--num_clients=4", "--local_epochs=1", "--max_train=200", "--max_test=50",
                          "--partition=iid", f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fola on cifar10 (tfds:cifar10)" in out.stdout and "round    1  GA" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["flags"]["augment"] == "autoaugment_cutout" and summary["flags"]["model"] == "fola_cnn"


def test_fedreg_emnist_preset_loads_the_emnist_digits_split_on_tfds_mock_data(tmp_path):
    """FedReg's Table 1 preset loads TFDS's emnist/digits, not the balanced split, and its one-class clients, CNN
    and FedReg run on it (small here: 2 clients of 5 images)."""
    preset = "--flagfile=experiments/configs/fedreg_emnist.flags"
    out = subprocess.run([sys.executable, "tests/tfds_mock_run.py", preset, "--rounds=1", "--num_clients=2",
                          "--clients_per_round=2", "--samples_per_client=5", "--batch_size=5", "--local_epochs=1",
                          "--max_test=20", f"--output_dir={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fedreg on emnist/digits (tfds:emnist/digits)" in out.stdout and "round    1  GA" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dataset"] == "emnist/digits" and summary["source"] == "tfds:emnist/digits"  # as loaded


def test_mc_dropout_schedule_and_final_uncertainty(tmp_path):
    out = _run(*SMALL, "--algorithm=fedavg", "--dropout_rate=0.2", "--optimizer=adam", "--lr=0.01",
               "--lr_schedule=exponential", "--lr_decay_start=1", "--rounds=2", "--test_samples=4",
               "--noevaluate_local", f"--output_dir={tmp_path}")
    assert "final predictive: accuracy" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    unc = summary["uncertainty"]
    # the printed names say what the numbers are (summary.json keeps the keys)
    assert f"entropy/log(C) {unc['entropy']:.4f}, aleatoric (trace) {unc['aleatoric']:.4f}" in out.stdout
    assert {"accuracy", "nll", "ece", "brier", "entropy", "epistemic"} <= set(unc)
    assert 0 <= unc["ece"] <= 1 and unc["nll"] > 0
    assert unc["epistemic"] > 0  # dropout stays on at test time: the passes disagree
    assert summary["flags"]["lr_schedule"] == "exponential"


# Bad flags, missing data and impossible partitions: tests/test_errors.py (in-process, one line each).


def test_hbfl_preset_runs_heterogeneous_clients_with_their_own_test_splits(tmp_path):
    """The CI smoke preset: two local architectures, per-client test splits, stragglers; summary has CA."""
    _run(f"--flagfile={ROOT}/experiments/configs/hbfl/digits_smoke.flags", "--rounds=2", "--local_epochs=2",
         "--straggler_fraction=0.5", "--straggler_weighting=by_epochs", f"--output_dir={tmp_path}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["algorithm"] == "hbfl" and summary["flags"]["client_architectures"] == "mlp:2,logistic:3"
    assert 0.3 < summary["best_client_test_accuracy"] <= 1.0
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["client_test_accuracy"] >= r["client_test_meme_accuracy"] - 1e-6 for r in rounds)


def test_fedref_segmentation_preset_through_the_binary(tmp_path):
    """The offline segmentation preset: U-Net on procedural vessels, nested subsets, FedRef from round 1, with a
    FedAdam server optimiser on top (any algorithm takes one)."""
    out = _run(f"--flagfile={ROOT}/experiments/configs/fedref/vessels_unet.flags", "--rounds=2", "--max_train=40",
               "--max_test=10", "--fedref_warmup=0", "--server_optimizer=adam", "--server_lr=0.01",
               f"--output_dir={tmp_path}")
    assert "round    2  Dice" in out.stdout and "HD95" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["algorithm"] == "fedref+adam" and summary["flags"]["task"] == "segmentation"
    final = summary["final"]
    assert {"dice", "iou", "hd95", "authors_dice", "authors_iou", "authors_hd95", "loss"} <= set(final)
    assert 0 <= final["iou"] <= final["dice"] <= 1 and final["hd95"] >= 0
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rounds[1]["fedref_correction"] > 0  # the server step moved the aggregate (no warm-up)
    assert all(r["server_update_norm"] > 0 for r in rounds)  # and FedAdam stepped on the corrected aggregate


def test_flagfiles_parse():
    from experiments.run import FLAGS, parse_class_groups
    configs = ROOT / "experiments" / "configs"
    for path in sorted(configs.glob("*.flags")) + sorted(configs.glob("hbfl/*.flags")):
        try:
            FLAGS(["run", f"--flagfile={path}"])
            assert FLAGS.rounds >= 1, path
            if FLAGS.partition == "class_groups":
                assert len(parse_class_groups(FLAGS.class_groups)) == FLAGS.num_clients
        finally:
            FLAGS.unparse_flags()


def test_compute_dtype_flag_reaches_the_models():
    import types
    import jax.numpy as jnp
    from experiments import run
    try:
        run.FLAGS(["run", "--compute_dtype=bfloat16", "--model=cnn2"])
        assert run.make_model(10).dtype == jnp.bfloat16
        run.FLAGS(["run", "--compute_dtype=bfloat16", "--algorithm=hbfl", "--num_clients=3",
                   "--client_architectures=mlp:1,lenet:2"])
        setting, groups = run.architecture_setting(types.SimpleNamespace(num_classes=10), run.make_model(10))
        assert [m.dtype for m in setting["local_models"]] == [jnp.bfloat16] * 2 and list(groups) == [0, 1, 1]
    finally:
        run.FLAGS.unparse_flags()


def test_method_presets_build_their_algorithm_with_every_option_used(small_fed):
    """Each per-method flagfile names an algorithm and only options it takes; build() makes it."""
    import bfedjax as bf
    from experiments import algorithm_flags
    model = bf.models.get_model("mlp", 10, hidden=(8,))
    presets = sorted((ROOT / "experiments" / "configs").glob("*/*.flags"))
    assert len(presets) >= 9
    for path in presets:
        values = algorithm_flags.parse_flagfile(str(path))
        options, ignored = algorithm_flags.options(values)
        assert not ignored, (path, ignored)
        algo = bf.algorithms.build(values.algorithm, model, small_fed, **options)
        assert algo.hparams["lr"] == values.lr, path


def test_every_option_flag_is_an_option_of_its_algorithms():
    import bfedjax as bf
    from experiments import algorithm_flags
    assert set(bf.algorithms.ALGORITHMS) == {"fedavg", "fedsgd", "fedprox", "fedcurv", "fola", "bfl", "scaffold",
                                             "fednova", "fedreg", "fedref", "hbfl", "fml", "abavg"}
    for flag, (option, algorithms) in algorithm_flags.OPTION_FLAGS.items():
        for name in algorithms:
            assert option in bf.algorithms.options_of(name), (flag, name)


def test_fedregs_spec_options_have_flags(tmp_path):
    from experiments import algorithm_flags
    path = tmp_path / "fedreg.flags"
    path.write_text("--algorithm=fedreg\n--nofedreg_projections\n--fedreg_equality\n--fedreg_hard_pseudo\n")
    options, ignored = algorithm_flags.options(algorithm_flags.parse_flagfile(str(path)))
    assert not ignored
    assert {k: options[k] for k in ("projections", "equality", "hard_pseudo")} == {
        "projections": False, "equality": True, "hard_pseudo": True}


def test_bench_quick_smoke_and_resume(tmp_path):
    from experiments import bench_report as bench
    # 10 samples a client (one local step): the rounds timed in turn (10 + 1 of each layout, twice) run a tenth as long
    flags = ["--only=mlp K=10 B=10", "--rounds=1", "--algorithms=fedavg", "--cpu_chunks=", "--samples_per_client=10",
             f"--output_dir={tmp_path}"]
    # the compile columns time XLA: a persistent compilation cache the environment names is not used
    cache = tmp_path / "jax_cache"
    _script("experiments.bench", "--backends=vmap", *flags,
            env={"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    assert not list(cache.glob("*-cache"))
    first = json.loads((tmp_path / "bench.json").read_text())
    # The one-vmap row, and the default layout's row (the layout simulate picks; one vmap where the cohort fits).
    library = [r["backend"] for r in first["rows"]]
    defaults = [r["backend"] for r in first["rows"] if r["default"]]
    assert library[0] == "vmap" and len(defaults) == 1 and defaults[0] in library
    # the default and the fastest other variant once more, their rounds in turn (the default / fastest target's)
    paired = [b for b in library if b.startswith(bench.PAIRED)]
    assert paired == ([] if defaults[0] == "vmap" else [f"{bench.PAIRED} {defaults[0]}", f"{bench.PAIRED} vmap"])
    # --cpu_devices=auto: one JAX device per core; with several the default trains each device's clients in turn
    from bfedjax.core import layout
    devices = first["machine"]["cpu_devices"]
    assert devices == layout.usable_cores()
    assert defaults[0] == (f"vmap/c1x{devices}" if devices > 1 else defaults[0])
    # A resumed run keeps the rows already measured and times only the missing backend.
    out = _script("experiments.bench", "--backends=vmap,stepwise", "--resume", *flags)
    assert f"resuming: {len(library)} rows kept" in out.stdout
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [r["backend"] for r in report["rows"]] == library + ["stepwise"]
    assert report["rows"][0] == first["rows"][0]
    assert all(r["round_s"] > 0 and r["samples_per_s"] > 0 for r in report["rows"])
    assert all(r["compile_s"] > 0 for r in report["rows"] if not r["backend"].startswith(bench.PAIRED))
    # "vmap (default)" where the machine's cache makes one vmap the default layout
    assert re.search(r"\| mlp K=10 B=10 \| fedavg \| vmap( \(default\))? \|", (tmp_path / "bench.md").read_text())
    assert any(t["target"].startswith("default layout / fastest library variant") for t in report["targets"])
    # a run cut off before its paired rows gets them on resuming (their rounds compiled afresh)
    cut = {**report, "rows": [r for r in report["rows"] if not r["backend"].startswith(bench.PAIRED)]}
    (tmp_path / "bench.json").write_text(json.dumps(cut))
    _script("experiments.bench", "--backends=vmap", "--resume", *flags)
    resumed = [r["backend"] for r in json.loads((tmp_path / "bench.json").read_text())["rows"]]
    assert resumed == [r["backend"] for r in cut["rows"]] + paired
    # resuming with another library setting would mix two kinds of rows: one line naming the stored flag
    settings = [("--nofixed_local_steps", "--fixed_local_steps")] + (
        [("--cpu_devices=1", f"--cpu_devices={devices}")] if devices > 1 else [])
    mixed = [subprocess.Popen([sys.executable, "-m", "experiments.bench", "--resume", setting, *flags], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for setting, _ in settings]
    for (_, stored), process in zip(settings, mixed):  # started together: each spends its seconds importing
        message = "".join(process.communicate(timeout=600))
        assert process.returncode != 0 and f"measured with {stored}" in message and "Traceback" not in message


def test_bench_resume_compares_the_random_bits_lowering_of_gpu_reports():
    """A GPU report records the threefry setting its rounds were lowered with; one from before that was recorded
    was lowered with JAX's default (off). ``--resume`` (``bench.previous_rows``) refuses the setting it names."""
    from experiments import bench_report as bench
    kernel = {"gpu_threefry_kernel": True}  # this run's, on a GPU
    assert bench.changed_setting({"device": "x"}, kernel) == ("gpu_threefry_kernel", False)
    assert bench.changed_setting({"gpu_threefry_kernel": False}, kernel) == ("gpu_threefry_kernel", False)
    assert bench.changed_setting({"gpu_threefry_kernel": True}, kernel) is None
    assert bench.changed_setting({}, {"gpu_threefry_kernel": False, "fixed_local_steps": True}) is None  # unrecorded
    assert bench.changed_setting({"compute_dtype": "bfloat16"}, {"compute_dtype": "float32"}) == ("compute_dtype",
                                                                                                  "bfloat16")


def test_bench_targets_follow_the_platform():
    from experiments import bench_report as bench

    def row(config, algorithm, backend, round_s, default=False):
        return {"config": config, "algorithm": algorithm, "backend": backend, "round_s": round_s, "default": default,
                "aggregation_share": None, "peak_fraction": 0.1, "padded_work_ratio": 1.0, "samples_per_s": 1.0,
                "gflops": 1.0}

    rows = [row("mlp K=1000 B=10", "fedavg", "vmap", 0.1, default=True), row("mlp K=1000 B=10", "fedavg", "stepwise", 1.5),
            row("mlp K=1000 B=10", "fedavg", "torch.func+compile", 0.2),
            row("mlp K=100 B=10", "fedavg", "vmap", 0.9), row("mlp K=100 B=10", "fedavg", "vmap/c1", 0.5),
            row("mlp K=100 B=10", "fedavg", "vmap/c2", 0.6, default=True),
            row("mlp K=100 B=10", "fedavg", "stepwise", 1.5), row("mlp K=100 B=10", "fedavg", "centralised", 0.3),
            {**row(bench.RESNET_COMPILE_CONFIG, "bfl", "vmap", 2.0, default=True), "compile_s": 35.0}]
    bench_targets = lambda rows, platform="cpu": {t["target"]: t for t in bench.check_targets(rows, platform)}
    on_cpu, on_gpu = bench_targets(rows), bench_targets(rows, "gpu")
    k100 = "default speed-up over stepwise, mlp K=100 B=10 (FedAvg)"
    # The default row (vmap/c2), not the fastest variant (vmap/c1), is what a user gets.
    assert on_cpu[k100]["met"] is True and on_cpu[k100]["value"] == pytest.approx(2.5)
    assert on_gpu[k100]["met"] is None and "CPU goal" in on_gpu[k100]["goal"]
    k1000 = "default speed-up over stepwise, mlp K=1000 B=10 (fedavg)"
    assert k1000 not in on_cpu and on_gpu[k1000]["met"] is False  # 15x < 20x
    torch_func = "default speed-up over compiled torch.func, mlp K=1000 B=10 (fedavg)"
    assert on_gpu[torch_func]["met"] is True and on_gpu[torch_func]["value"] == pytest.approx(2.0)
    assert on_cpu[torch_func]["met"] is None and "GPU goal" in on_cpu[torch_func]["goal"]
    ceiling = on_gpu["fraction of the centralised ceiling, mlp K=100 B=10 (FedAvg)"]
    assert ceiling["value"] == pytest.approx(0.5) and ceiling["met"] is True
    compile_target = f"compile seconds, variational ResNet-20 round ({bench.RESNET_COMPILE_CONFIG}, bfl)"
    assert on_gpu[compile_target]["met"] is False and on_gpu[compile_target]["value"] == 35.0  # 35 s > 20 s
    assert on_cpu[compile_target]["met"] is None
    layout = [t for name, t in on_cpu.items() if name.startswith("default layout / fastest library variant")]
    assert len(layout) == 1 and layout[0]["value"] == pytest.approx(1.2) and layout[0]["met"] is False
    assert "rows timed in sequence" in [n for n in on_cpu if n.startswith("default layout")][0]
    # with the default and its fastest other variant timed again in turn, the target reads that pair
    paired = rows + [row("mlp K=100 B=10", "fedavg", f"{bench.PAIRED} vmap/c2", 0.52),
                     row("mlp K=100 B=10", "fedavg", f"{bench.PAIRED} vmap/c1", 0.5)]
    layout = {n: t for n, t in bench_targets(paired).items() if n.startswith("default layout / fastest")}
    assert list(layout) == ["default layout / fastest library variant, worst row (mlp K=100 B=10, fedavg, vmap/c2; "
                            "rounds in turn)"]
    assert list(layout.values())[0]["value"] == pytest.approx(1.04) and list(layout.values())[0]["met"] is True
    # the paired rows are no library variant of their own: the fastest-variant lookups ignore them
    assert bench._find(paired, "mlp K=100 B=10", "fedavg", "vmap")["backend"] == "vmap/c1"
    text = bench.markdown({"machine": {"platform": "gpu", "device": "x", "cpu_count": 1, "jax": "0"},
                           "matmul_peak_gflops": 1.0, "memory_gb_per_s": 2.0, "data": "d", "rows": rows,
                           "targets": list(on_gpu.values())})
    assert "| n/a |" in text and "| mlp K=100 B=10 | fedavg | vmap/c2 (default) |" in text
    assert "threefry" not in text  # a report from before the setting was recorded
    for kernel, words in ((True, "random bits from JAX's threefry GPU kernel"), (False, "without JAX's threefry")):
        machine = {"platform": "gpu", "device": "x", "cpu_count": 1, "jax": "0", "gpu_threefry_kernel": kernel}
        assert words in bench.markdown({"machine": machine, "matmul_peak_gflops": 1.0, "data": "d", "rows": rows,
                                        "targets": []})


def test_bench_report_takes_a_compiled_only_row_for_its_memory_alone():
    """Quick mode compiles the K = 3400 round without running it (``bench.Config.compile_only``): the memory
    target reads that row, the speed targets and the layout comparison pass over it, and the table prints
    dashes for its per-second columns."""
    from experiments import bench_report as bench
    big = "mlp K=3400 B=10 chunks of 10"
    compiled = {"config": big, "algorithm": "fola", "backend": "vmap", "round_s": None, "default": True,
                "compile_s": 6.5, "memory_mb": 1100.0, "aggregation_share": None, "peak_fraction": None,
                "padded_work_ratio": 1.0, "samples_per_s": None, "gflops": None, "roofline_fraction": None}
    timed = {**compiled, "config": "mlp K=100 B=10", "backend": "vmap/c1x2", "round_s": 0.2, "memory_mb": 30.0,
             "samples_per_s": 5e4, "gflops": 60.0, "peak_fraction": 0.3, "roofline_fraction": 4.0,
             "aggregation_share": 0.03}
    targets = {t["target"]: t for t in bench.check_targets([timed, compiled], "cpu")}
    memory = targets["compiled round memory, K=3400 in chunks of 10 (worst algorithm)"]
    assert memory["value"] == pytest.approx(1100 / 1024) and memory["met"] is True
    assert [t["target"] for t in targets.values() if t["target"].startswith("default layout")] == [
        "default layout / fastest library variant, worst row (mlp K=100 B=10, fola, vmap/c1x2; rows timed in sequence)"]
    assert bench._find([compiled], big, "fola", "vmap") is None
    text = bench.markdown({"machine": {"platform": "cpu", "device": "cpu", "cpu_count": 2, "jax": "0"},
                           "matmul_peak_gflops": 1.0, "data": "d", "rows": [timed, compiled], "targets": []})
    assert f"| {big} | fola | vmap (default) | - | 6.5 | - | - | - | - | 1100 | - | 1.00 |" in text
    assert "| mlp K=100 B=10 | fola | vmap/c1x2 (default) | 0.200 | 6.5 | 50000 | 60.0 | 30.0 | 400.0 | 30 | 3.0% |" in text


def test_bench_reductions_smoke(tmp_path):
    """The library's sums against jnp.sum's, its median against jnp.median's and the robust rules against a sort:
    ten rows with positive times, written where --output says."""
    out_file = tmp_path / "reductions.md"
    _script("experiments.bench_reductions", "--steps=2", "--repeats=1", "--robust_clients=8", "--fola_clients=8",
            f"--output={out_file}")
    rows = [line for line in out_file.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert names[0] == "clip norm (SGD step, FOLA's pull)" and names[1].startswith("clip norm (Adam step")
    assert names[2] == "DP-SGD step" and len(names) == 10
    assert names[3].startswith("finite check: FOLA round, 8 clients")
    assert names[4].startswith("median of 199,210 floats")
    assert names[5].startswith("column count below a threshold, 8 clients")
    assert names[6].startswith("robust median of 8 clients") and names[7].startswith("robust trimmed mean")
    assert names[8].startswith("robust product") and names[9].startswith("median: FOLA round") and names[9].endswith("precision diagnostics on (FOLA's default)")
    assert all(float(row.split(" | ")[1]) > 0 and float(row.split(" | ")[2]) > 0 for row in rows)
    assert out_file.read_text().startswith("`python -m experiments.bench_reductions")


def test_bench_fola_ratio_reads_the_alternated_rows():
    """FOLA / FedAvg's target takes the default layouts' rounds timed in turn when the report has them (else
    the fastest variant of each); its goal is at B = 50, B = 10 is reported."""
    from experiments import bench_report as bench

    def row(config, algorithm, backend, round_s):
        return {"config": config, "algorithm": algorithm, "backend": backend, "round_s": round_s, "default": False,
                "aggregation_share": None, "peak_fraction": 0.1, "padded_work_ratio": 1.0}

    rows = [row(c, a, b, t) for c in ("mlp K=100 B=10", "mlp K=100 B=50")
            for a, b, t in (("fedavg", "vmap/c1x2", 0.10), ("fola", "vmap/c1x2", 0.14))]
    fastest = {t["target"]: t for t in bench.check_targets(rows, "cpu")}
    b50 = fastest["FOLA round / FedAvg round, mlp K=100 B=50 (fastest library variant of each)"]
    assert b50["value"] == pytest.approx(1.4) and b50["met"] is False
    rows += [row("mlp K=100 B=50", "fedavg", f"{bench.ALTERNATED} vmap/c1x2", 0.11),
             row("mlp K=100 B=50", "fola", f"{bench.ALTERNATED} vmap/c1x2", 0.132)]
    targets = {t["target"]: t for t in bench.check_targets(rows, "cpu")}
    b50 = targets["FOLA round / FedAvg round, mlp K=100 B=50 (default layouts, rounds alternated)"]
    assert b50["value"] == pytest.approx(1.2) and b50["met"] is True
    b10 = targets["FOLA round / FedAvg round, mlp K=100 B=10 (fastest library variant of each)"]
    assert b10["value"] == pytest.approx(1.4) and b10["met"] is None and b10["goal"] == "reported"
    # the alternated rows are no library variant of their own: the fastest-variant targets ignore them
    assert bench._find(rows, "mlp K=100 B=50", "fedavg", "vmap")["backend"] == "vmap/c1x2"


def test_bfl_rules_script_smoke(tmp_path):
    out_file = tmp_path / "rules.md"
    _script("experiments.bfl_rules", "--seeds=0", "--settings=1:2", "--partitions=shards", "--rules=wc",
            "--weightings=by_size,distance", "--hidden=8", "--max_train=400", "--test_samples=2", "--evaluate_every=1",
            f"--results_file={out_file}")
    text = out_file.read_text()
    for method in ("fedavg", "mc_dropout", "wc", "wc/distance"):
        assert f"| {method} | " in text
    assert "Paper's grouping here" in text and "| method | entropy 50% |" in text
    rows = json.loads(out_file.with_suffix(".json").read_text())
    assert set(rows) == {f"1 2 shards {m}" for m in ("fedavg", "mc_dropout", "wc", "wc/distance")}
    wc = rows["1 2 shards wc"]
    # WC's variance omega_max / sum_k(omega_k / sigma_k^2) depends on the weights: the distance run weighed its
    # clients otherwise
    assert wc["scale"][0] != rows["1 2 shards wc/distance"]["scale"][0]
    assert wc["evaluated_rounds"][0] == [1.0, 2.0] and len(wc["accuracy_curve"][0]) == 2
    assert wc["retained_entropy"][0][-1] == pytest.approx(wc["accuracy"][0])  # all points kept: the accuracy
    # the per-seed scalars beside the mean: one seed, so each is its metric's mean
    assert wc["per_seed"]["seed"] == [0] and "accuracy_curve" not in wc["per_seed"]
    scalars = ("accuracy", "nll", "scale")
    assert [wc["per_seed"][m][0] for m in scalars] == [wc[m][0] for m in scalars]
    assert out_file.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_spread_is_the_sample_std_or_a_students_t_interval():
    from experiments import spread
    assert spread.half_width(0.5, 3) == 0.5 and spread.half_width(0.5, 1) == 0.0
    # t_{0.975, 2} = 4.3027 and t_{0.975, 9} = 2.2622 (the t table): half-widths t * s / sqrt(n).
    assert spread.half_width(1.0, 3, "ci95") == pytest.approx(4.3027 / 3 ** 0.5, rel=1e-4)
    assert spread.half_width(2.0, 10, "ci95") == pytest.approx(2.2622 * 2.0 / 10 ** 0.5, rel=1e-4)
    with pytest.raises(ValueError, match="spread"):
        spread.half_width(1.0, 3, "sem")
    assert spread.mean_pm([0.5]) == "0.5000"  # one run: no spread
    assert spread.mean_pm([0.1, 0.2, 0.3], 3) == "0.200 ± 0.100"
    assert spread.mean_pm([0.1, 0.2, 0.3], 3, "ci95") == "0.200 ± 0.248"  # 4.3027 * 0.1 / sqrt(3)


def test_bfl_rules_report_writes_the_chosen_spread(tmp_path):
    out_file = tmp_path / "rules.md"
    stats = {"accuracy": [0.9, 0.01], "nll": [0.3, 0.1], "ece": [0.05, 0.02], "scale": [0.01, 0.001],
             "runs": [3, 0.0]}
    from bfedjax.vi.meanfield import MeanFieldConfig
    sigma_0 = MeanFieldConfig.init_scale
    wc = {**stats, "evaluated_rounds": [[2.0], [0.0]], "scale_curve": [[sigma_0 / 16], [0.0]],  # 1/4 a round
          "per_seed": {"seed": [0, 1, 2], "accuracy": [0.89, 0.9, 0.91]}}
    out_file.with_suffix(".json").write_text(json.dumps({"1 2 iid wc": wc, "1 2 iid fedavg": stats}))
    common = ("--report_only", "--settings=1:2", "--partitions=iid", "--rules=wc", "--seeds=0",  # n from the file
              f"--results_file={out_file}")
    _script("experiments.bfl_rules", *common)
    text = out_file.read_text()
    assert "| wc | 0.9000 ± 0.0100 |" in text
    scale_table = text.split("Mean posterior scale per evaluated round")[1].split("\n\n")[1].splitlines()
    assert scale_table[2:] == [f"| wc | {sigma_0 / 16:.1e} | 4.00 |"]  # the rules only, not the baseline
    _script("experiments.bfl_rules", *common, "--spread=ci95")
    text = out_file.read_text()
    assert "| wc | 0.9000 ± 0.0248 |" in text and "95% CI half-width" in text  # 4.3027 * 0.01 / sqrt(3)
    # the rewritten JSON keeps the per-seed values as they were
    assert json.loads(out_file.with_suffix(".json").read_text())["1 2 iid wc"]["per_seed"] == wc["per_seed"]


def test_bfl_rules_tabulates_the_client_weightings(tmp_path):
    """--weightings: every weighted rule under each weighting side by side (conflation, which takes none, once under
    the first), the paper's grouping read off the first weighting, and the widest gap between a rule's weightings."""
    out_file = tmp_path / "rules.md"
    row = lambda acc: {"accuracy": [acc, 0.01], "nll": [0.3, 0.1], "ece": [0.05, 0.02], "scale": [0.01, 0.001],
                       "runs": [3, 0.0]}
    saved = {"1 2 iid fedavg": row(0.9), "1 2 iid wc": row(0.80), "1 2 iid wc/distance": row(0.95),
             "1 2 iid nwa": row(0.70), "1 2 iid nwa/distance": row(0.705), "1 2 iid conflation/distance": row(0.85)}
    out_file.with_suffix(".json").write_text(json.dumps(saved))
    _script("experiments.bfl_rules", "--report_only", "--settings=1:2", "--partitions=iid", "--seeds=0",
            "--rules=wc,nwa,conflation", "--weightings=distance,by_size", f"--results_file={out_file}")
    text = out_file.read_text()
    table = text.split("Client weightings (")[1].split("\n\n")[1].splitlines()
    assert table[0] == "| rule | distance acc | distance NLL | by_size acc | by_size NLL |"
    assert table[2:] == ["| wc | 0.9500 ± 0.0100 | 0.300 ± 0.100 | 0.8000 ± 0.0100 | 0.300 ± 0.100 |",
                         "| nwa | 0.7050 ± 0.0100 | 0.300 ± 0.100 | 0.7000 ± 0.0100 | 0.300 ± 0.100 |"]
    # read off the first weighting: worst of (wc/distance, conflation/distance) minus nwa/distance
    assert "are ahead of NWA/LP under distance weights (worst of the first group minus best of the second +0.1450" in text
    assert "Here 1 of 2 rule-and-setting pairs move by more than 0.01" in text
    assert "the widest gap is 0.1500 (wc, E = 1, iid" in text
    assert "Paired by seed" not in text  # rows without per_seed: no paired line
    # with per-seed values, the wide pair (wc) is read seed by seed: distance minus by_size per seed
    saved["1 2 iid wc"]["per_seed"] = {"seed": [0, 1], "accuracy": [0.85, 0.75]}
    saved["1 2 iid wc/distance"]["per_seed"] = {"seed": [0, 1], "accuracy": [0.84, 1.0]}
    out_file.with_suffix(".json").write_text(json.dumps(saved))
    _script("experiments.bfl_rules", "--report_only", "--settings=1:2", "--partitions=iid", "--seeds=0,1",
            "--rules=wc,nwa,conflation", "--weightings=distance,by_size", f"--results_file={out_file}")
    assert ("Paired by seed over those 1 pairs, distance minus the mean of the other weightings: seed 0 -0.0100 to "
            "-0.0100, seed 1 +0.2500 to +0.2500.") in out_file.read_text()


def test_bfl_rules_logs_the_dirichlet_client_sizes(tmp_path):
    """dir<alpha> partitions (spec D13): the report logs every seed's client sizes from the sampler the flag names
    (NIID-Bench's: unequal; equal_size: |D| // K each) and WC by train size against conflation."""
    import bfedjax as bf
    out_file = tmp_path / "rules.md"
    row = lambda acc, scale: {"accuracy": [acc, 0.01], "nll": [0.3, 0.1], "ece": [0.05, 0.02], "scale": [scale, 0.0],
                              "runs": [2, 0.0]}
    out_file.with_suffix(".json").write_text(json.dumps({"1 2 dir0.5 wc": row(0.9, 2e-3),
                                                         "1 2 dir0.5 conflation": row(0.875, 1e-3)}))
    common = ("--report_only", "--settings=1:2", "--partitions=dir0.5", "--seeds=0,1", "--rules=wc,conflation",
              f"--results_file={out_file}")
    _script("experiments.bfl_rules", *common)
    text = out_file.read_text()
    y = bf.data.load("digits").y_train
    sizes = [sorted(len(p) for p in bf.data.partition(y, "dirichlet_niid_bench", 10, seed=s, alpha=0.5))
             for s in (0, 1)]
    assert sizes[0] != [len(y) // 10] * 10  # unequal, so the line below says something
    assert (f"Client sizes (niid_bench sampler), smallest first (seed 0: {', '.join(map(str, sizes[0]))}; "
            f"seed 1: {', '.join(map(str, sizes[1]))}); the largest client holds "
            f"{max(s[-1] / s[0] for s in sizes):.2f}x the smallest, so train-size weights differ") in text
    assert "WC by train size minus conflation: +0.0250 accuracy, +0.0000 NLL, final mean posterior scale 2.00e-03 " \
           "vs 1.00e-03" in text
    _script("experiments.bfl_rules", *common, "--dirichlet_sampler=equal_size")
    equal = ", ".join([str(len(y) // 10)] * 10)
    assert f"(seed 0: {equal}; seed 1: {equal}); the largest client holds 1.00x the smallest." in out_file.read_text()
    # conflation runs once, under the first weighting: against WC by train size only when that is by_size
    out_file.with_suffix(".json").write_text(json.dumps({"1 2 dir0.5 wc": row(0.9, 2e-3),
                                                         "1 2 dir0.5 conflation/uniform": row(0.875, 1e-3)}))
    _script("experiments.bfl_rules", *common, "--weightings=uniform,by_size")
    assert ("WC by train size against conflation: n/a (conflation ran under uniform weights; list by_size first in "
            "--weightings to compare the two).") in out_file.read_text()


def _fedref_table_from_cache(tmp_path, part: str, records, suffix: str = "") -> str:
    """Writes ``records`` as ``fedref_table``'s cached ``--quick`` runs of section ``part`` (its file names) and
    returns the report the script makes from them."""
    cache = tmp_path / "quick"
    cache.mkdir()
    for record in records:
        name = re.sub(r"[()']", "", record["method"]).replace(" ", "_")
        (cache / f"{part}_{name}_{record['partition']}_s{record['seed']}{suffix}.json").write_text(json.dumps(record))
    out_file = tmp_path / "fedref.md"
    _script("experiments.fedref_table", "--quick", f"--parts={part}", f"--output_dir={tmp_path}",
            f"--results_file={out_file}")
    return out_file.read_text()


def test_fedref_table_reports_cached_runs(tmp_path):
    """The FedRef table from cached runs (no training): the foreground section's rows, the untrained threshold row,
    how far each model moved, and the verdict read off the authors' row with its chance rate."""
    rounds, records = 8, []  # --quick
    methods = {"FedAvg": 0.30, "FedRef-code": 0.31, "FedRef-map_prox (rho 0.2)": 0.29, "FedAvg (CE + soft Dice)": 0.8}
    for method, dice in methods.items():
        curve = [dice] * rounds
        record = {"kind": "foreground", "method": method, "partition": "nested", "seed": 0, "pixels": None,
                  "record_version": 2, "train_size": 200, "seconds": 60.0, "param_change": 1e-4 if dice < 0.5 else 0.2,
                  **{f"global_{k}": curve for k in ("dice", "iou", "hd95", "authors_dice", "authors_iou",
                                                    "authors_hd95", "loss")},
                  **({"fedref_correction": [0.0] * rounds} if method.startswith("FedRef") else {})}
        records.append(record)
    text = _fedref_table_from_cache(tmp_path, "foreground", records)
    assert "Training time of the runs in this file: 4.0 minutes" in text  # every run came from the cache
    assert "| FedRef-code | 0.3100 | 0.3100 |" in text and text.count("| 0.0001 |") == 3 and "| 0.2 |" in text
    threshold = [line for line in text.splitlines() if line.startswith("| threshold |")]
    assert len(threshold) == 1 and 0.5 < float(threshold[0].split("|")[2]) < 0.95  # noisy digits cut at 0.5
    # FedRef-code is ahead in Dice and authors' Dice (1 seed each), map_prox behind: 2 of 4 lead, 2 by chance
    assert ("**Yes**: the authors' FedRef-code at their settings is ahead of FedAvg in every seed in 2 and behind in "
            "every seed in 0 of its 2 comparisons below. Over all 4 FedRef comparisons, 2 lead in every seed, where "
            "about 2.0 would by chance alone") in text
    assert "FedAvg with the authors' Focal loss at SGD 0.01 ends 1.0e-04 of its initial norm" in text


def test_fedref_table_reports_the_per_tensor_shift_of_cached_runs(tmp_path):
    """Spec 7a at the paper's lr from cached runs (no training): the accuracy columns, FedRef-code's per-tensor
    shift averaged over the rounds after its warm-up (p + 1 = 6 of the 8 quick rounds), '-' for the rows without it,
    and the verdict over the section's FedRef rows."""
    rounds, warm, records = 8, [0.0] * 6, []
    methods = {"FedAvg": 0.70, "FedRef-code": 0.72, "FedRef-code (authors' dR)": 0.10,
               "FedRef-map_prox (rho 0.2)": 0.69}
    for method, accuracy in methods.items():
        record = {"kind": "mnist5k_paper_lr", "method": method, "partition": "nested", "seed": 0, "pixels": "unit",
                  "record_version": 2, "train_size": 4000, "seconds": 30.0,
                  "global_accuracy": [accuracy] * rounds, "global_loss": [1.0] * rounds}
        if method.startswith("FedRef"):
            record["fedref_correction"] = warm + [1.0, 2.0]
        if method.startswith("FedRef-code"):
            record["fedref_layer_shift_ratio"] = warm + ([1.5, 2.5] if method == "FedRef-code" else [3.0, 5.0])
            # s falls then rises; round 7's largest shift is eta |s| = 4e-3 x 0.5, round 8's is not
            record["fedref_shift"], record["fedref_layer_shift"] = warm + [-0.5, 0.2], warm + [2e-3, 1e-2]
        records.append(record)
    text = _fedref_table_from_cache(tmp_path, "mnist5k_paper_lr", records, "_unit")
    assert "Training time of the runs in this file: 2.0 minutes" in text  # every run came from the cache
    assert text.startswith("# FedRef and FedAvg (quick)")  # no FedProx or FedAdam rows in this section
    assert "SGD 0.004" in text and "mean of max over tensors of shift / RMS of the tensor's A−A_prev |" in text
    assert "| FedRef-code | 0.7200 | 0.7200 | 1.0000 | 1.5000 | 2.000 |" in text
    assert "| FedRef-code (authors' dR) | 0.1000 | 0.1000 | 1.0000 | 1.5000 | 4.000 |" in text
    assert "| FedRef-map_prox (rho 0.2) | 0.6900 | 0.6900 | 1.0000 | 1.5000 | - |" in text
    assert "| FedAvg | 0.7000 | 0.7000 | 1.0000 | - | - |" in text
    assert ("FedRef-code, 2 corrected rounds over 1 seeds: s, the change of the clients' mean reported loss, was "
            "negative in 50% of them; the most-shifted tensor's shift was eta |s| within 1% (the lambda terms "
            "negligible there) in 50%.") in text
    assert ("**Yes**: the authors' FedRef-code at their settings is ahead of FedAvg in every seed in 1 and behind in "
            "every seed in 0 of its 1 comparisons below.") in text


def test_fedref_table_reports_the_lenet_grid_without_fedref_code(tmp_path):
    """Section (h), the rest of spec 7a's grid on LeNet-5, from cached runs: baselines without a correction, FedRef
    variants with theirs, and a verdict that lists the comparisons but has no headline, since the authors' own row,
    FedRef-code, is section (e)'s."""
    accuracies = {"FedAvg": 0.90, "FedProx (mu 0.5)": 0.89, "FedProx (mu 0.01)": 0.90, "FedAdam": 0.93,
                  "FedRef-code (authors' dR)": 0.10, "FedRef-l2 (rho 0.2)": 0.91, "FedRef-map_prox (rho 0.05)": 0.88,
                  "FedRef-map_prox (rho 0.5)": 0.87}
    records = [{"kind": "mnist5k_lenet_grid", "method": method, "partition": "nested", "seed": 0, "pixels": "unit",
                "record_version": 2, "train_size": 4000, "seconds": 60.0, "global_accuracy": [accuracy] * 8,
                "global_loss": [0.5] * 8, **({"fedref_correction": [0.0] * 6 + [0.2, 0.3]}
                                             if method.startswith("FedRef") else {})}
               for method, accuracy in accuracies.items()]
    text = _fedref_table_from_cache(tmp_path, "mnist5k_lenet_grid", records, "_unit")
    rows = re.findall(r"^\| ([^|]+) \| 0\.\d{4} \|", text, flags=re.M)
    assert rows == list(accuracies)  # FedAvg and the rows of (a) that (e) lacks, in (a)'s order
    assert text.startswith("# FedRef, FedAvg, FedProx and FedAdam (quick)")
    assert "| FedAdam | 0.9300 | 0.9300 | 0.5000 | - |" in text
    assert "| FedRef-l2 (rho 0.2) | 0.9100 | 0.9100 | 0.5000 | 0.2500 |" in text  # mean after the warm-up of p + 1
    assert "- mnist5k_lenet_grid nested, FedRef-l2 (rho 0.2), accuracy: +0.0100, ahead in all 1 seeds." in text
    assert "**" not in text.split("## Does FedRef beat FedAvg here?")[1].split("The paper reports")[0]
    assert "ends at accuracy 0.100 in all 1 classification runs" in text  # the Delta-R bug's line


def test_fedreg_one_class_script_smoke(tmp_path):
    out_file = tmp_path / "one_class.md"
    _script("experiments.fedreg_one_class", "--model=mlp", "--rounds=2", "--seeds=0", "--local_epochs=1",
            "--methods=fedsgd,fedavg,scaffold,fedreg", f"--results_file={out_file}")
    text = out_file.read_text()
    for method in ("fedsgd", "fedavg", "scaffold", "fedreg"):
        assert f"| {method} | " in text
    assert "FedReg reaches R_0.5 in" in text and "projections active" in text
    runs = json.loads(out_file.with_suffix(".json").read_text())["runs"]
    assert len(runs) == 4 and all(len(r["accuracy"]) == 2 for r in runs)


def test_fedreg_forgetting_script_smoke(tmp_path):
    out_file = tmp_path / "forgetting.md"
    _script("experiments.fedreg_forgetting", "--model=mlp", "--rounds=2", "--num_clients=20", "--local_epochs=1",
            f"--results_file={out_file}")
    text = out_file.read_text()
    assert "| fedavg | " in text and "| fedreg | " in text and "| 2 | " in text
    runs = json.loads(out_file.with_suffix(".json").read_text())["runs"]
    assert len(runs) == 1 and len(runs[0]["accuracy"]) == 2
    gap = runs[0]["gap"]
    assert len(gap["fedavg"]) == len(gap["fedreg"]) == 1
    # one-class clients: training on this round's classes raises the loss on the previous round's
    assert gap["fedavg"][0] > 0 and gap["fedavg"] != gap["fedreg"]


def test_fedreg_privacy_script_smoke(tmp_path):
    out_file = tmp_path / "privacy.md"
    _script("experiments.fedreg_privacy", "--model=mlp", "--images=1", "--iterations=30", "--accuracy_rounds=1",
            "--local_epochs=1", f"--results_file={out_file}")
    text = out_file.read_text()
    assert "| FedAvg |" in text and "| FedReg + MG" in text and "DP-SGD" in text
    assert out_file.with_suffix(".png").stat().st_size > 1000
    results = json.loads(out_file.with_suffix(".json").read_text())["results"]
    assert results["fedavg_dp"]["epsilon"] > 0


def _hbfl_record(setting, method, alpha, seed, best_ga, best_ca=0.5):
    return {"setting": setting, "method": method, "alpha": alpha, "seed": seed, "seconds": 1.0,
            "global_accuracy": [0.1, best_ga, best_ga - 0.01], "client_accuracy": [0.2, best_ca]}


@pytest.mark.parametrize("gaps, verdict", [({100.0: 0.01, 0.05: 0.05}, "holds here: HBFL's best GA is above FML's "
                                            "at every alpha (seed means; the per-seed counts are above), and its lead "
                                            "is largest at alpha 0.05"),
                                           ({100.0: 0.03, 0.05: 0.01}, "holds in part here: HBFL's best GA is above "
                                            "FML's at every alpha (seed means; the per-seed counts are above), and "
                                            "its lead is largest at alpha 100"),
                                           ({100.0: -0.01, 0.05: 0.02}, "holds in part here: HBFL's best GA is above "
                                            "FML's only at alpha 0.05"),
                                           ({100.0: 0.01, 0.05: -0.02}, "does not hold here: HBFL's best GA is above "
                                            "FML's only at alpha 100"),
                                           ({100.0: -0.01, 0.05: -0.05}, "does not hold here: FML's best GA is at or "
                                            "above HBFL's at every alpha")])
def test_hbfl_report_states_whether_the_papers_direction_holds(gaps, verdict):
    from experiments import hbfl_report
    by = {}
    for alpha, gap in gaps.items():
        for seed, noise in enumerate((0.0, 0.004)):
            for method, ga in (("hbfl", 0.7 + gap + noise), ("fml", 0.7)):
                by.setdefault(("hetero", method, alpha), []).append(_hbfl_record("hetero", method, alpha, seed, ga))
    lines = "\n".join(hbfl_report.direction(by, list(gaps)))
    assert verdict in lines
    # per-seed differences, paired by seed: the mean and sample std of (gap, gap + 0.004)
    assert f"alpha 0.05, HBFL - FML (per-seed differences, mean ± std): best GA {gaps[0.05] + 0.002:+.4f} ± 0.0028" in lines
    del by[("hetero", "fml", 100.0)]  # an incomplete grid gives no verdict
    assert "No verdict on the paper's direction: no hetero HBFL/FML pair at alpha 100." in hbfl_report.direction(
        by, list(gaps))


def test_hbfl_report_pairs_runs_by_seed():
    from experiments import hbfl_report
    by = {("hetero", "hbfl", 0.1): [_hbfl_record("hetero", "hbfl", 0.1, s, ga) for s, ga in ((0, 0.8), (2, 0.9))],
          ("equal_q", "hbfl", 0.1): [_hbfl_record("equal_q", "hbfl", 0.1, s, ga) for s, ga in ((2, 0.85), (0, 0.7))]}
    np.testing.assert_allclose(hbfl_report.paired_gaps(by, ("hetero", "hbfl"), ("equal_q", "hbfl"), 0.1), [0.1, 0.05])
    assert "hetero HBFL (q_k = n_k / n) - equal_q (q_k = 1), best GA +0.0750 ± 0.0354 (ahead in 2 of 2 seeds)" in \
        hbfl_report.ablations(by, [0.1])[0]


def test_hbfl_report_weighs_the_clients_by_q_when_the_precisions_are_equal():
    """The table's memes upload about their initial precision (results/hbfl_meme_precision): the product's weights
    are q_k, n_k / n or 1 / N."""
    from experiments import hbfl_report
    assert hbfl_report.largest_client_weight([1, 1, 2], "by_size") == pytest.approx(0.5)
    assert hbfl_report.largest_client_weight([1, 1, 2], "equal") == pytest.approx(1 / 3)
    by = {(setting, "hbfl", 0.05): [_hbfl_record(setting, "hbfl", 0.05, 0, ga)]
          for setting, ga in (("hetero", 0.65), ("equal_q", 0.75))}
    rows = hbfl_report.client_size_table({(0.05, 0): [100, 300, 100], (0.05, 1): [5, 5]}, by, [0.05])
    assert rows[2] == "| 0.05 | 0 | 300, 100, 100 | 0.60 | 0.33 | -0.1000 |"
    assert rows[3] == "| 0.05 | 1 | 5, 5 | 0.50 | 0.50 | - |"


def test_hbfl_report_counts_rounds_to_ninety_percent_of_fedavgs_best():
    from experiments import hbfl_report
    record = lambda setting, method, seed, ga: {"setting": setting, "method": method, "alpha": 0.1, "seed": seed,  # noqa: E731
                                                "global_accuracy": ga, "client_accuracy": ga}
    by = {("common", "fedavg", 0.1): [record("common", "fedavg", 0, [0.5, 0.8, 1.0]),
                                      record("common", "fedavg", 1, [0.5, 0.6])],
          ("hetero", "hbfl", 0.1): [record("hetero", "hbfl", 0, [0.85, 0.9, 0.95]),  # 0.9 of 1.0: round 2
                                    record("hetero", "hbfl", 1, [0.1, 0.2])]}  # 0.54 never reached
    rows = hbfl_report.rounds_to_fedavg_fraction(by, [("hetero", "hbfl"), ("equal_q", "hbfl")], [0.1])
    assert rows[2:] == ["| hetero | 0.1 | hbfl | 2 | 1 of 2 |"]


def test_compare_table_marks_a_round_one_that_was_not_evaluated():
    from experiments import compare
    summary = {"round1_global_accuracy": None, "best_global_accuracy": 0.9, "final_global_accuracy": 0.85,
               "best_local_accuracy": 0.8, "rounds_to_target": {"0.5": 2}}
    assert "| fola | - | 0.9000 | 0.8500 | 0.8000 | 2 |" in compare.table({"fola": [{"summary": summary}]})


def test_compare_tables_local_accuracy_per_round():
    from experiments import compare
    results = {label: [{"rounds": [{"global_accuracy": 0.1 * r, "local_accuracy": la * r} for r in (1, 2)]}]
               for label, la in (("a", 0.25), ("b", 0.5))}
    table = compare.per_round_table(results, "local_accuracy", "LA").splitlines()
    assert table[0] == "| round | a LA | b LA |" and table[3] == "| 2 | 0.5000 | 1.0000 |"
    assert compare.per_round_table(results).splitlines()[3] == "| 2 | 0.2000 | 0.2000 |"


def test_compare_tables_a_metric_only_for_the_runs_that_report_it():
    from experiments import compare
    results = {"fedavg": [{"rounds": [{"global_accuracy": 0.5}]}],
               "fola": [{"rounds": [{"global_accuracy": 0.6, "precision_cosine": 0.25}]}]}
    assert compare.per_round_table(results, "precision_cosine", "cos").splitlines() == [
        "| round | fola cos |", "|---|---|", "| 1 | 0.2500 |"]


def test_compare_over_seeds_tabulates_mean_spread_and_the_median_rounds_to_target():
    from experiments import compare
    def run(best, final, reach, round1=0.1):
        return {"summary": {"round1_global_accuracy": round1, "best_global_accuracy": best,
                            "final_global_accuracy": final, "best_local_accuracy": best - 0.1,
                            "rounds_to_target": {"0.5": reach, "0.9": None}},
                "rounds": [{"round": 1, "global_accuracy": best - 0.2}, {"round": 2, "global_accuracy": best}]}
    results = {"fola": [run(0.6, 0.5, 3), run(0.8, 0.7, 6), run(0.7, 0.6, None)]}
    assert compare.table(results).splitlines()[2] == (
        "| fola | 0.1000 ± 0.0000 | 0.7000 ± 0.1000 | 0.6000 ± 0.1000 | 0.6000 ± 0.1000 | 4.5 (2/3) | - |")
    ci = compare.table(results, "ci95").splitlines()[2]
    assert "0.7000 ± 0.2484" in ci  # t_{0.975, 2} * 0.1 / sqrt(3)
    assert compare.per_round_table(results).splitlines()[2:] == ["| 1 | 0.5000 |", "| 2 | 0.7000 |"]
    for run in results["fola"]:
        run["summary"]["round1_global_accuracy"] = None  # --evaluate_every skipped round 1
    assert compare.table(results).splitlines()[2].startswith("| fola | - | 0.7000 ± 0.1000 |")
    del results["fola"][0]["summary"]["best_local_accuracy"]  # a label whose runs report no local accuracy
    for run in results["fola"][1:]:
        run["summary"]["best_local_accuracy"] = float("nan")
    assert compare.table(results).splitlines()[2].split(" | ")[4] == "-"
    with pytest.raises(ValueError, match="no run reports 'local_accuracy'"):
        compare.per_round_table(results, "local_accuracy", "LA")
    assert compare.seed_list("0, 1,2") == [0, 1, 2] and compare.seed_list("") is None
    # no abbreviations: --seed goes on to the runs rather than being read as --seeds
    args, extra = compare.argument_parser().parse_known_args(["--flagfile=f", "--runs", "a:", "--seed=5"])
    assert args.seeds == "" and extra == ["--seed=5"]
    from absl import app
    for bad, message in (("0,x", "comma-separated whole numbers"), ("1,1", "repeats a seed")):
        with pytest.raises(app.UsageError, match=message):
            compare.seed_list(bad)


def test_compare_runs_every_label_once_per_seed(tmp_path):
    flagfile = tmp_path / "small.flags"
    flagfile.write_text("\n".join(SMALL + ["--rounds=2"]) + "\n")
    out = _script("experiments.compare", f"--flagfile={flagfile}", "--runs", "fedavg:--algorithm=fedavg",
                  "--seeds=3,4", f"--output_dir={tmp_path / 'out'}", f"--results_file={tmp_path / 'cmp.md'}")
    summaries = [json.loads((tmp_path / "out" / "fedavg" / f"seed{s}" / "summary.json").read_text()) for s in (3, 4)]
    assert [s["flags"]["seed"] for s in summaries] == [3, 4]  # one run per seed
    from experiments import spread
    best = spread.mean_pm([s["best_global_accuracy"] for s in summaries])
    text = (tmp_path / "cmp.md").read_text()
    assert "Seeds 3, 4: each cell is the mean ± the sample std" in text and f"| {best} |" in text
    assert "GA per round (mean over the seeds):" in text
    assert f"{tmp_path / 'out' / 'fedavg' / 'seed3'} {tmp_path / 'out' / 'fedavg' / 'seed4'}" in out.stdout


def test_fola_ae_lf_script_smoke(tmp_path):
    """FOLA Sec. IV-E's analysis on the 8x8 digits: the curves' check at the runs' own pi_1, every AE and LF point,
    and a resume that retrains nothing."""
    out_file = tmp_path / "ae_lf.md"
    flags = ("--dataset=digits", "--curve_methods=fedavg,full_online", "--curve_rounds=1,2", "--pis=0,0.51,1",
             "--alphas=1", "--reference_rounds=2", "--ae_round=1", "--lf_epochs=1,3", f"--results_file={out_file}")
    _script("experiments.fola_ae_lf", *flags)
    text = out_file.read_text()
    assert "largest difference 0.0e+00" in text
    saved = json.loads(out_file.with_suffix(".json").read_text())
    assert set(saved["curves"]) == {"fedavg", "full_online"}
    assert all(len(run["curves"][r]) == 3 for run in saved["curves"].values() for r in ("1", "2"))
    study = saved["studies"][0]
    assert set(study["ae"]) == {"fedavg", "diagonal_online", "full_online"}
    assert set(study["lf"]) == {"fedavg/E1", "fedavg/E3", "fola_full/E1", "fola_full/E3"}
    assert all(p["aggregation_error"] > 0 for p in study["ae"].values())
    # from theta*, the prior keeps FOLA's local models nearer theta* than FedAvg's at the same E
    assert study["lf"]["fola_full/E3"]["local_forgetting"] < study["lf"]["fedavg/E3"]["local_forgetting"]
    assert "| pooled | 4 |" in text  # theta* and the three methods
    again = _script("experiments.fola_ae_lf", *flags)
    assert "curves fedavg:" not in again.stdout and "alpha 1:" not in again.stdout
