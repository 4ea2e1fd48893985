"""Errors a person can act on: every bad command line of the binaries ends in one line that names the fix.

Most cases call ``experiments.run.prepare(argv)`` (everything a run does before its first round) in-process
and format the error with ``experiments.errors.message``, the function the binaries' wrapper prints; a few
batched subprocesses check the real binaries print exactly that one line, with no traceback and exit 2.
"""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from absl import app, flags
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bfedjax as bf
from bfedjax.data.sources import ENV_DATA_DIR, write_idx
from experiments import errors, run

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--dataset=digits", "--num_clients=4", "--hidden=16", "--batch_size=16", "--lr=0.1",
         "--partition=dirichlet_per_class", "--alpha=0.5", "--max_train=400"]


@pytest.fixture(autouse=True)
def _fresh_flags(monkeypatch):
    """No data folder from the environment; the global FLAGS left unparsed for the next test."""
    monkeypatch.delenv(ENV_DATA_DIR, raising=False)
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    yield
    run.FLAGS.unparse_flags()


def _error(*argv) -> str:
    """The one line ``experiments.run`` prints (without ``error: ``) for SMALL + ``argv``; fails if setup works."""
    with pytest.raises(Exception) as info:
        run.prepare(["run", *SMALL, *argv])
    assert isinstance(info.value, errors.user_errors()), repr(info.value)  # a bug would keep its traceback
    line = errors.message(info.value)
    assert "\n" not in line
    return line


def _binaries(commands):
    """Starts ``python -m <module> <flags>`` for every command at once; returns ``(returncode, stdout, stderr)``
    of each, in order."""
    procs = [subprocess.Popen([sys.executable, "-m", *command], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for command in commands]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        results.append((proc.returncode, out, err))
    return results


def _one_error_line(result, needle: str) -> str:
    """Checks a binary failed with exit 2 and exactly one stderr line, ``error: ...`` holding ``needle``."""
    returncode, _, stderr = result
    assert returncode == errors.EXIT_CODE, stderr
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("error: ") and needle in stderr, stderr
    return stderr.strip()


# ------------------------------------------------------------------------------------------ the flags of run


@pytest.mark.parametrize("bad,needle", [
    # flag values and conflicting flags (moved from test_experiments: they ran one process each)
    ("--alpha=0", "--alpha must be > 0"),
    ("--clients_per_round=9", "--clients_per_round must be <="),
    ("--algorithm=fedsdg", "--algorithm"),
    ("--participation=2", "--participation must be in"),
    ("--clients_per_chunk=0", "--clients_per_chunk must be auto, none or a number >= 1"),
    ("--client_weights=0.5", "--client_weights needs exactly"),
    ("--model=lenet --dropout_rate=0.2", "has no dropout layers"),
    ("--dp_clip=1 --algorithm=fola", "--dp_clip (DP-SGD) works with"),
    ("--algorithm=fedprox --lam=0.1", "fix: use --mu"),
    ("--algorithm=fola --fisher=exact", "--fisher"),
    ("--algorithm=hbfl --client_architectures=mlp:3", "assigns 3 clients"),
    ("--algorithm=fedavg --client_architectures=mlp:4", "drop the flag"),
    ("--client_test_splits --partition=iid", "--partition=dirichlet_per_class"),
    ("--algorithm=hbfl --distill_alpha=2", "--distill_alpha must be in"),
    ("--task=segmentation", "fix: --dataset=vessels"),
    ("--dataset=vessels", "fix: --task=segmentation --model=unet"),
    ("--volume_size=8,8,8", "fix: drop --volume_size"),
    ("--dataset=fets_volumes --volume_size=8,8", "--volume_size=48,64,64"),
    ("--fets_labels=classes", "fix: drop --fets_labels"),
    ("--dataset=vessels --task=segmentation --model=unet --algorithm=fedref --partition=nested --augment=crop_flip",
     "fix: --augment=none"),
    ("--segmentation_loss=dice", "--segmentation_loss"),
    ("--dataset=vessels --task=segmentation --model=unet --algorithm=fola",
     "fix: --algorithm=fedavg or fedprox or fedref"),
    ("--dataset=vessels --task=segmentation --model=unet --algorithm=fedavg", "fix: --partition=nested"),
    ("--algorithm=fedref --fedref_p=0", "--fedref_p must be >= 1"),
    ("--rounds=3 --evaluate_every=2", "--evaluate_every must be >= 1 and divide --rounds"),
    ("--round_fractions=0.5,2", "--round_fractions must be numbers in (0, 1]"),
    ("--server_optimizer=adamw", "--server_optimizer"),
    ("--algorithm=abavg --abavg_accuracy_source=client_test", "fix: add --client_test_splits"),
    ("--clients_per_round=2 --participation=0.5", "give --clients_per_round or --participation, not both"),
    ("--client_weights=a,b,c,d", "--client_weights must be numbers >= 0"),
    ("--hidden=16,x", "--hidden must be widths >= 1"),
    ("--nosuch_flag=1", "fix: see --helpshort"),
    ("positional", "unexpected arguments ['positional']; fix: flags take the form --name=value"),
    # impossible partitions
    ("--num_clients=500", "num_clients=500 exceeds the 400 training samples; fix: use at most 400 clients"),
    ("--partition=shards --classes_per_client=11", "classes_per_client=11 exceeds the 10 classes present; "
                                                   "fix: lower classes_per_client"),
    ("--partition=power_law --classes_per_client=0", "classes_per_client must be an integer >= 1, got 0; fix:"),
    ("--client_test_splits --max_train=10 --num_clients=10 --alpha=0.001",
     "no draw in 1000 gave all 10 clients >= 1 training samples (alpha=0.001); fix: raise alpha"),
    ("--partition=single_class --samples_per_client=100", "but 1 clients x 100 are needed; fix: lower "
                                                          "samples_per_client to at most"),
    ("--partition=nested --max_train=3", "--partition=nested gives each client all 3 training samples"),
    ("--partition=class_groups --class_groups=a-b", "fix: e.g. --class_groups='0-4;5-9'"),
    ("--partition=class_groups --num_clients=3", "--class_groups has 2 groups but --num_clients=3; "
                                                 "fix: --num_clients=2"),
    ("--max_train=0", "max_train/max_test must be >= 1, got 0; fix:"),
    # models that cannot take the data
    ("--model=lenet", "--model=lenet does not fit digits's inputs of shape (8, 8, 1)"),
    ("--model=unet", "fix: a classifier such as --model=mlp (--model=unet is for --task=segmentation)"),
    ("--algorithm=hbfl --client_architectures=cnn1:4", "--client_architectures=cnn1:4 does not fit digits's inputs"),
])
def test_bad_command_lines_fail_with_one_line_naming_the_fix(bad, needle):
    line = _error(*bad.split())
    assert needle in line, line
    assert "fix:" in line or "e.g." in line, line


def test_missing_data_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DATA_DIR, str(tmp_path))  # an empty folder: IDX files nowhere, no TFDS data
    assert "fix: pass --data_dir=DIR holding the IDX files" in _error("--dataset=mnist",
                                                                      f"--tfds_data_dir={tmp_path}")
    assert "fix: prepare TFDS data in --tfds_data_dir" in _error("--dataset=cifar10", f"--tfds_data_dir={tmp_path}")
    # an EMNIST split by name (FedReg's Table 1 preset needs emnist/digits) reaches the loader
    assert "fix: prepare TFDS data in --tfds_data_dir" in _error("--dataset=emnist/digits",
                                                                 f"--tfds_data_dir={tmp_path}")


def test_an_explicit_data_dir_is_the_only_place_looked_in(tmp_path, monkeypatch):
    """A --data_dir that does not exist, or lacks the files, is an error naming it, never a read of the
    environment's folder (which here holds the files) nor a fallback to digits."""
    _write_idx_set(tmp_path / "env" / "mnist")
    monkeypatch.setenv(ENV_DATA_DIR, str(tmp_path / "env"))
    assert run.prepare(["run", *SMALL, "--dataset=mnist"]).dataset.source == f"idx:{tmp_path / 'env' / 'mnist'}"
    missing = tmp_path / "nowhere"
    line = _error("--dataset=mnist", f"--data_dir={missing}", "--fallback_to_digits")
    assert line.startswith(f"mnist: --data_dir {missing} does not exist; fix: pass --data_dir=DIR")
    line = _error("--dataset=fashion_mnist", f"--data_dir={tmp_path}")
    assert line.startswith(f"fashion_mnist: no IDX files in --data_dir (looked in {tmp_path}/fashion_mnist,")
    with pytest.raises(bf.data.DataDirNotFoundError, match="does not exist"):
        bf.data.load("digits", data_dir=str(missing))
    assert not bf.data.available("mnist", data_dir=str(tmp_path))  # the env folder has it, but not looked in


# ------------------------------------------------------------------------------------------ loaded data


def _write_idx_set(folder, images=None, train_labels=None):
    """The four IDX files of a 20 + 10 image MNIST-like set in ``folder`` (images may be float32)."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (20, 28, 28), dtype=np.uint8) if images is None else images,
        "train-labels-idx1-ubyte": np.arange(20, dtype=np.uint8) % 10 if train_labels is None else train_labels,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.arange(10, dtype=np.uint8),
    }
    for stem, array in arrays.items():
        write_idx(os.path.join(folder, stem), array)


def _poisoned_images():
    """20 float32 images with 12 non-finite pixels: 5 NaN in row 4, 6 NaN and one Inf in row 9."""
    x = np.random.default_rng(1).uniform(0, 255, (20, 28, 28)).astype(np.float32)
    x[4, 0, :5] = np.nan
    x[9, 3, :6] = np.nan
    x[9, 27, 27] = np.inf
    return x


def test_labels_out_of_range_are_counted(tmp_path):
    labels = np.arange(20, dtype=np.uint8) % 10
    labels[[5, 7, 11]] = [12, 10, 255]
    _write_idx_set(tmp_path, train_labels=labels)
    with pytest.raises(ValueError) as info:
        bf.data.load("mnist", data_dir=str(tmp_path))
    assert str(info.value).startswith("mnist: 3 training labels outside [0, 10) (e.g. 12 at row 5); fix: re-fetch")
    assert _error("--dataset=mnist", f"--data_dir={tmp_path}") == str(info.value)
    with pytest.raises(ValueError, match=r"demo: 1 test labels outside \[0, 3\) \(e.g. 3 at row 1\); fix: map"):
        bf.data.stack_clients(np.zeros((4, 2)), np.array([0, 1, 2, 2]), [np.arange(4)], x_test=np.zeros((2, 2)),
                              y_test=np.array([0, 3]), num_classes=3, name="demo")


def test_non_finite_inputs_fail_unless_allowed(tmp_path, capsys):
    _write_idx_set(tmp_path, images=_poisoned_images())
    counts = "mnist: 12 non-finite pixels in 2 training images (rows 4, 9)"
    with pytest.raises(ValueError) as info:
        bf.data.load("mnist", data_dir=str(tmp_path))
    assert str(info.value).startswith(f"{counts}; fix: re-fetch or clean the files, or pass allow_nonfinite=True")
    assert _error("--dataset=mnist", f"--data_dir={tmp_path}").endswith("(experiments.run: --allow_nonfinite_inputs) "
                                                                        "to keep them")
    with pytest.warns(bf.data.NonFiniteInputsWarning, match=r"12 non-finite pixels in 2 training images"):
        kept = bf.data.load("mnist", data_dir=str(tmp_path), allow_nonfinite=True)
    assert np.isnan(kept.x_train[4]).sum() == 5 and np.isinf(kept.x_train[9]).sum() == 1
    # the binary keeps going with one warning line, and the federation holds the poisoned client's NaNs
    capsys.readouterr()
    experiment = run.prepare(["run", *SMALL, "--dataset=mnist", f"--data_dir={tmp_path}", "--partition=iid",
                              "--allow_nonfinite_inputs"])
    assert capsys.readouterr().err == f"warning: {counts}; kept (allow_nonfinite=True)\n"
    assert np.isnan(experiment.fed.x).sum() == 11 and np.isinf(experiment.fed.x).sum() == 1


# ------------------------------------------------------------------------------------------ the wrapper


def test_wrapper_formats_user_errors_and_keeps_bugs_loud(tmp_path, capsys, monkeypatch):
    """An unwritable --output_dir is one line naming the path; a non-user error keeps its traceback;
    BFEDJAX_TRACEBACK=1 re-raises user errors too; a ValueError that names no fix says how to find it."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    run.parse(["run", *SMALL, f"--output_dir={blocker}/out"])
    with pytest.raises(SystemExit) as info:
        errors.guard(run.main)(["run"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"error: {blocker}/out: Not a directory; fix: check the path (an input must "
                                       "exist and be readable, an output folder writable)\n")

    def bug(_):
        raise KeyError("internal")

    with pytest.raises(KeyError):
        errors.guard(bug)(["x"])
    monkeypatch.setenv(errors.TRACEBACK_ENV, "1")
    with pytest.raises(app.UsageError):
        errors.guard(lambda _: run.setup(["run", "extra"]))(["x"])
    assert errors.message(ValueError("shapes (2,) and\n(3,) differ")) == (
        "shapes (2,) and (3,) differ (ValueError; BFEDJAX_TRACEBACK=1 shows where it was raised)")


# ------------------------------------------------------------------------------------------ the flag surface


ALGORITHMS = list(bf.algorithms.ALGORITHMS)
MODELS = list(bf.models.MODELS)
PARTITIONS = list(bf.data.PARTITIONERS) + ["institutions"]
EDGES = [0, -1, 1, 2, 10 ** 12]


def _flag(name, values):
    """Either no --name or --name=<one of values>."""
    return st.one_of(st.just([]), values.map(lambda value: [f"--{name}={value}"]))


def _command_lines(numbers):
    """``run --dataset=digits`` and a random subset of the flags; ``numbers[name]`` draws --name's value."""
    return st.tuples(
        _flag("algorithm", st.sampled_from(ALGORITHMS)),
        _flag("partition", st.sampled_from(PARTITIONS)),
        _flag("model", st.sampled_from(MODELS)),
        *[_flag(name, values) for name, values in numbers.items()],
    ).map(lambda groups: ["run", "--dataset=digits", *[flag for group in groups for flag in group]])


# Half the command lines hold values each flag accepts (so the data, partition, model and algorithm checks
# run), half the edge values 0, -1, huge, inf and nan (mostly stopped at flag parsing).
COMMAND_LINES = st.one_of(
    _command_lines({
        "num_clients": st.one_of(st.integers(1, 40), st.sampled_from([2000, 10 ** 12])),
        "alpha": st.sampled_from([1e-3, 0.5, 100, 1e300, "inf"]),
        "clients_per_round": st.integers(1, 5),
        "batch_size": st.sampled_from([1, 16, 10 ** 12]),
        "max_train": st.sampled_from([1, 2, 50, 10 ** 12]),
        "classes_per_client": st.sampled_from([1, 3, 11, 10 ** 12]),
        "samples_per_client": st.sampled_from([1, 5, 200, 10 ** 12]),
        "hidden": st.sampled_from(["16", ""]),
    }),
    _command_lines({
        "num_clients": st.sampled_from(EDGES),
        "alpha": st.sampled_from([0, -1, "nan"]),
        "clients_per_round": st.sampled_from(EDGES),
        "participation": st.sampled_from([0, 0.5, 1, 2]),
        "batch_size": st.sampled_from(EDGES),
        "local_epochs": st.sampled_from(EDGES),
        "lr": st.sampled_from([0, -1, 0.1, 1e300]),
        "max_train": st.sampled_from(EDGES),
        "classes_per_client": st.sampled_from(EDGES),
        "samples_per_client": st.sampled_from(EDGES),
        "hidden": st.sampled_from(["16", "", "0", "x"]),
    }),
)


def test_random_command_lines_either_set_up_or_fail_with_one_line(tmp_path):
    """Hypothesis over run's flags (derandomized: the same 30 command lines every time): setup either works
    or raises a user error whose one line names the fix; two of the failing lines, one caught at flag
    parsing and one later, go through the real binary, which prints exactly that line."""
    failures = {}

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(COMMAND_LINES)
    def setup_or_one_line(argv):
        try:
            experiment = run.prepare(argv)
        except Exception as err:  # noqa: BLE001 - the assertion narrows it
            assert isinstance(err, errors.user_errors()), (argv, repr(err))
            line = errors.message(err)
            assert "\n" not in line and ("fix:" in line or "e.g." in line), (argv, line)
            failures.setdefault(isinstance(err, flags.Error), (argv, line))
        else:
            assert experiment.fed.num_clients == run.FLAGS.num_clients
        finally:
            run.FLAGS.unparse_flags()

    setup_or_one_line()
    assert set(failures) == {True, False}, failures  # both kinds were generated
    picked = [failures[True], failures[False]]
    for (argv, line), result in zip(picked, _binaries([["experiments.run", *argv[1:], f"--output_dir={tmp_path}"]
                                                       for argv, _ in picked])):
        assert _one_error_line(result, line) == f"error: {line}"


# ------------------------------------------------------------------------------------------ the real binaries


def test_binaries_print_one_line_and_exit_2(tmp_path):
    """One batch of processes: run.py's missing data, and each table script's bad input."""
    cases = [
        (["experiments.run", "--dataset=fashion_mnist", f"--data_dir={tmp_path}/nowhere"],
         f"--data_dir {tmp_path}/nowhere does not exist; fix:"),
        (["experiments.hbfl_table", "--rounds=0"], "--rounds must be >= 1, e.g. --rounds=30"),
        (["experiments.run", f"--flagfile={tmp_path}/none.flags"],
         "error: Unable to open flagfile: [Errno 2] No such file or directory"),
        (["experiments.fedref_table", "--seeds=x"], "--seeds must be integer seeds >= 0, e.g. --seeds=0,1"),
        (["experiments.fedref_table", "--parts=mnist5k,drive"],
         "--parts must be some of mnist5k,fashion,vessels,foreground,mnist5k_lenet,mnist5k_paper_lr,"
         "mnist5k_lenet_paper_lr,mnist5k_lenet_grid, "
         "e.g. --parts=mnist5k,vessels"),
        (["experiments.fedref_table", "--parts="], "--parts must name at least one section, e.g. --parts=mnist5k"),
        (["experiments.precision_table", "--seeds=x"], "--seeds must be non-negative integer seeds, e.g. --seeds=0"),
        (["experiments.run", "--compute_dtype=int8"], "--compute_dtype=int8: value should be one of <float32|bfloat16"),
        (["experiments.bfl_rules", "--partitions=dirichlet"],
         "--partitions must be iid, shards and/or dir<alpha> with alpha > 0, e.g. --partitions=iid,shards,dir0.5"),
        (["experiments.bfl_rules", "--weightings=equal"], "--weightings must be client weightings from uniform"),
        (["experiments.bench", "--only=no such configuration"], "matches no configuration; fix: use part of"),
        (["experiments.bench", "--bfl_gradient_estimator=local"],
         "--bfl_gradient_estimator=local; fix: use one of flipout, local_reparameterization"),
        (["experiments.compare", f"--flagfile={tmp_path}/none.flags", "--runs", "a:"],
         "does not exist; fix: pass one of experiments/configs/*.flags"),
        (["experiments.compare", f"--flagfile={ROOT}/experiments/configs/hbfl/digits_smoke.flags", "--runs",
          "big:--num_clients=2000", f"--output_dir={tmp_path}/cmp"],
         "error: run big: num_clients=2000 exceeds the 1438 training samples; fix: use at most 1438 clients"),
    ]
    for (command, needle), result in zip(cases, _binaries([command for command, _ in cases])):
        _one_error_line(result, needle)
