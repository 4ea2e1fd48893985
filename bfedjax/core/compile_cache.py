"""JAX's persistent compilation cache, for the binaries and notebooks: a process that runs a round program
an earlier process compiled (a rerun, another seed, a resumed run) loads XLA's executable from disk
instead of compiling it again.

JAX keeps the cache itself (``jax_compilation_cache_dir``); ``use_compilation_cache`` only picks a
directory and bounds its size. Programs compiled before the call are not cached, so call it right after
the imports, as ``experiments.run`` does (``--compilation_cache_dir``). It caches programs whose
compilation took at least ``jax_persistent_cache_min_compile_time_secs`` (JAX's default, 1 s: the round
steps, not every small helper), and caches only XLA's work: tracing and lowering run every time.
"""
from __future__ import annotations

import os

import jax

from bfedjax.optional import require

# Least recently used entries are removed beyond this size (``jax_compilation_cache_max_size``).
DEFAULT_MAX_BYTES = 2 * 2**30


def default_directory() -> str:
    """``$XDG_CACHE_HOME/bfedjax/jax``, or ``~/.cache/bfedjax/jax`` where ``XDG_CACHE_HOME`` is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "bfedjax", "jax")


def use_compilation_cache(directory: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> str | None:
    """Turns on JAX's persistent compilation cache in ``directory`` (default ``default_directory()``),
    at most ``max_bytes`` on disk. Returns the directory JAX caches in, or ``None`` if it caches nothing.

    A cache the user already set (``JAX_COMPILATION_CACHE_DIR``, or ``jax.config``) is left as it is and
    returned; a cache the user switched off (``JAX_ENABLE_COMPILATION_CACHE=false``) stays off (``None``).
    Programs already compiled in this process are not written to the cache; the ones compiled after the
    call are.

    Raises ``ValueError`` if ``directory`` cannot be created or written, ``ImportError`` (naming the
    extra) without ``filelock``, which JAX needs to bound the size.
    """
    if not jax.config.jax_enable_compilation_cache:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes}; fix: a size in bytes >= 1, e.g. {DEFAULT_MAX_BYTES}")
    require("filelock")  # JAX's size bound locks the directory with it
    directory = os.path.abspath(os.path.expanduser(directory or default_directory()))
    try:
        os.makedirs(directory, exist_ok=True)
        writable = os.access(directory, os.W_OK | os.X_OK)
    except OSError as err:
        raise ValueError(f"compilation cache directory {directory} cannot be created ({err.strerror}); "
                         "fix: name a writable directory") from None
    if not writable:
        raise ValueError(f"compilation cache directory {directory} is not writable; fix: name a writable directory")
    jax.config.update("jax_compilation_cache_max_size", int(max_bytes))
    jax.config.update("jax_compilation_cache_dir", directory)
    return directory


__all__ = ["DEFAULT_MAX_BYTES", "default_directory", "use_compilation_cache"]
