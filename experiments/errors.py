r"""One-line errors for the binaries in ``experiments/``.

A person who mistypes a flag, points at a missing folder or asks for an impossible partition gets
one line on stderr and exit status 2, never a Python traceback::

    $ python -m experiments.run --dataset=fashion_mnist --data_dir=/nowhere
    error: fashion_mnist: --data_dir /nowhere does not exist; fix: pass --data_dir=DIR of an existing ...

The binaries call :func:`run` instead of ``absl.app.run`` (``compare.py``, an argparse script, wraps
its main in :func:`guard` and builds its parser with :class:`ArgumentParser`). User errors are:

* absl flag errors: bad values, failed validators, unknown flags (``flags.Error``);
* ``app.UsageError``: conflicting flags found while setting up;
* ``ValueError``: the library's checks (impossible partitions, data validation), whose messages end in
  ``fix: ...``;
* ``bfedjax.data.DataUnavailableError``: missing data;
* ``OSError``: a path the user gave that cannot be read or written.

Anything else (``TypeError``, ``KeyError``, an XLA error) is a bug in bfedjax rather than in the command
line, and keeps its traceback so that it can be reported. A ``ValueError`` can also come from deep inside
JAX or Flax; when its message names no fix, the line says how to see where it came from: setting
``BFEDJAX_TRACEBACK=1`` re-raises every user error with its full traceback.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

from absl import app, flags

TRACEBACK_ENV = "BFEDJAX_TRACEBACK"
EXIT_CODE = 2  # the usual exit status of a command-line usage error (argparse, getopt)
INTERRUPTED_EXIT_CODE = 130  # a shell's status for a process ended by Ctrl-C (128 + SIGINT)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types a person fixes by changing the command line (imports the data package lazily)."""
    from bfedjax.data.sources import DataUnavailableError
    return flags.Error, app.UsageError, ValueError, DataUnavailableError, OSError, ImportError


def _collapse(text: str) -> str:
    return " ".join(text.split())


def _names_fix(text: str) -> bool:
    return "fix:" in text or "e.g." in text


def message(err: BaseException) -> str:
    """``err`` as one line that names the fix (without the ``error: `` prefix)."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return (f"{err.filename}: {err.strerror}; fix: check the path (an input must exist and be readable, "
                "an output folder writable)")
    text = _collapse(str(err)) or type(err).__name__
    if isinstance(err, flags.Error) and text.startswith("ERROR:: "):  # absl's own prefix (an unreadable --flagfile)
        text = text[len("ERROR:: "):]
    if isinstance(err, flags.Error) and "Unable to open flagfile" in text:
        return f"{text}; fix: give the path of an existing flagfile (e.g. experiments/configs/fola_fmnist_demo.flags)"
    if isinstance(err, flags.Error) and not _names_fix(text):
        return f"{text}; fix: see --helpshort for the flags and their values"
    if not _names_fix(text) and not isinstance(err, app.UsageError):
        return f"{text} ({type(err).__name__}; {TRACEBACK_ENV}=1 shows where it was raised)"
    return text


def report(err: BaseException, stream=None) -> int:
    """Writes ``error: <message>`` on one line to ``stream`` (stderr) and returns the exit status, 2."""
    print(f"error: {message(err)}", file=stream or sys.stderr, flush=True)
    return EXIT_CODE


def guard(main):
    """``main`` with user errors turned into one line on stderr and ``SystemExit(2)``; other errors pass."""
    @functools.wraps(main)
    def guarded(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - narrowed just below
            if not isinstance(err, user_errors()) or os.environ.get(TRACEBACK_ENV):
                raise
            # the process ends here: reads still pending in tensorstore (after a failed checkpoint restore)
            # would print "Event loop is closed" tracebacks through the unraisable hook at exit
            sys.unraisablehook = lambda unraisable: None
            sys.exit(report(err))
    return guarded


def parse_flags(argv: list[str]) -> list[str]:
    """``absl.app.run``'s flags parser: ``FLAGS(argv)`` with a bad flag reported as one line."""
    return guard(flags.FLAGS)(argv)


def run(main, argv: list[str] | None = None, interrupted: str = "") -> None:
    """``absl.app.run(main)`` whose flag errors and user errors in ``main`` are one line, exit status 2.

    Ctrl-C (``KeyboardInterrupt``) prints one line, ``interrupted; <interrupted>`` (the binary's way to carry
    on, e.g. that a rerun resumes from the last checkpoint), and ends the process at once with status 130,
    as a kill would: background writers (orbax's checkpoint threads) would otherwise print their own
    tracebacks while the interpreter shuts down. A checkpoint being written is left unfinished, which a
    resumed run skips (``bfedjax.checkpoint``)."""
    try:
        app.run(guard(main), argv=argv, flags_parser=parse_flags)
    except KeyboardInterrupt:
        print(f"interrupted{'; ' + interrupted if interrupted else ''}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(INTERRUPTED_EXIT_CODE)


def check_list(name: str, item_ok, what: str, example: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Registers a validator of the list flag ``--name``: every item passes ``item_ok`` (which may raise
    ``ValueError``, e.g. ``int(item)``); otherwise ``--name must be <what>, e.g. --name=<example>``."""
    def ok(item) -> bool:
        try:
            return bool(item_ok(item))
        except (TypeError, ValueError):
            return False

    flags.register_validator(name, lambda items: items is None or all(ok(item) for item in items),
                             message=f"--{name} must be {what}, e.g. --{name}={example}", flag_values=flag_values)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` whose errors raise ``app.UsageError`` (one line under :func:`guard`) instead of
    printing the usage text and exiting, and which takes no abbreviated option (as absl): an unknown flag
    such as ``--seed`` stays among the flags passed on instead of being read as ``--seeds``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        raise app.UsageError(f"{message}; fix: see --help")


__all__ = ["ArgumentParser", "EXIT_CODE", "INTERRUPTED_EXIT_CODE", "TRACEBACK_ENV", "check_list", "guard", "message",
           "parse_flags", "report", "run", "user_errors"]
