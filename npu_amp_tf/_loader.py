"""Build and load the C++ custom ops against the TensorFlow installed *now*.

The C++ sources ship inside the package (``npu_amp_tf/_csrc`` in a wheel,
``custom_ops/`` in a source checkout).  On first use they are compiled with
``tf.sysconfig`` flags into one shared library, cached per user under

    $NPU_AMP_TF_CACHE_DIR  or  $XDG_CACHE_HOME/npu_amp_tf  or  ~/.cache/npu_amp_tf

keyed by TensorFlow version, compile flags, compiler and a hash of the
sources.  A file lock keeps two processes from building the same key at once;
the second one waits and then loads the first one's result.
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .errors import BuildError

LIB_NAME = "libnpu_amp_tf.so"
_lock = threading.Lock()
_module = None
_path: Path | None = None


def source_dir() -> Path:
    """Where the C++ sources are: inside the installed package, else the checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "_csrc", here.parent / "custom_ops"):
        if cand.is_dir() and any(cand.glob("*.cc")):
            return cand
    raise BuildError(
        f"C++ sources of npu_amp_tf not found (looked in {here / '_csrc'} and "
        f"{here.parent / 'custom_ops'}); reinstall the package with `pip install .`")


def sources() -> list[Path]:
    return sorted(source_dir().glob("*.cc"))


def cache_root() -> Path:
    env = os.environ.get("NPU_AMP_TF_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "npu_amp_tf"


def find_compiler() -> str:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    raise BuildError(
        "no C++ compiler found to build the npu_amp_tf custom ops (looked for $CXX, g++, c++, "
        "clang++). Install one, for example `apt-get install g++` (Debian/Ubuntu) or "
        "`yum install gcc-c++`, or point $CXX at it.")


def _flags():
    import tensorflow as tf

    return list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags())


def build_key(compiler: str) -> str:
    import tensorflow as tf

    cflags, lflags = _flags()
    h = hashlib.sha256()
    for src in sorted(source_dir().iterdir()):
        if src.suffix in (".cc", ".h"):
            h.update(src.name.encode())
            h.update(src.read_bytes())
    h.update(" ".join(cflags + lflags + [compiler, sys.version]).encode())
    return f"tf{tf.__version__}-{h.hexdigest()[:16]}"


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            "building the npu_amp_tf custom ops failed:\n  " + " ".join(cmd) + "\n" +
            proc.stderr[-4000:])


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compile the custom ops if no build exists for this TF and these sources."""
    compiler = find_compiler()
    key = build_key(compiler)
    out_dir = cache_root() / key
    lib = out_dir / LIB_NAME
    if lib.exists() and not force:
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock_fh:
        fcntl.flock(lock_fh, fcntl.LOCK_EX)  # another process may be building this key
        try:
            if lib.exists() and not force:
                return lib
            cflags, lflags = _flags()
            srcs = sources()
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                objs = [Path(tmp) / (s.stem + ".o") for s in srcs]
                common = [compiler, "-O2", "-fPIC", "-Wno-deprecated-declarations",
                          "-I", str(source_dir()), *cflags]
                if verbose:
                    print(f"npu_amp_tf: compiling {len(srcs)} C++ sources into {lib}", file=sys.stderr)
                workers = max(1, min(len(srcs), os.cpu_count() or 1))
                with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                    list(pool.map(_run, [[*common, "-c", str(s), "-o", str(o)]
                                         for s, o in zip(srcs, objs)]))
                tmp_lib = Path(tmp) / LIB_NAME
                _run([compiler, "-shared", "-o", str(tmp_lib), *map(str, objs), *lflags])
                os.replace(tmp_lib, lib)  # atomic: readers never see a half-written file
        finally:
            fcntl.flock(lock_fh, fcntl.LOCK_UN)
    return lib


def prebuilt() -> Path | None:
    """``$NPU_AMP_TF_LIBRARY``: a library built elsewhere (Bazel, see
    the top-level BUILD) to load instead of compiling one."""
    env = os.environ.get("NPU_AMP_TF_LIBRARY")
    if not env:
        return None
    p = Path(env)
    if not p.is_file():
        raise BuildError(f"NPU_AMP_TF_LIBRARY={env!r} is not a file; point it at a built "
                         "libnpu_amp_tf.so or unset it to build from source")
    return p.resolve()


def library_path() -> Path:
    global _path
    with _lock:
        if _path is None:
            _path = prebuilt() or build()
        return _path


def load():
    """Build if needed, then load the library into TensorFlow (ops, kernels and
    the ``NpuAmpOptimizer`` grappler registration).  Returns the op module."""
    global _module
    with _lock:
        if _module is None:
            import tensorflow as tf

            global _path
            pre = prebuilt()
            if _path is None:
                _path = pre or build()
            try:
                _module = tf.load_op_library(str(_path))
            except (tf.errors.OpError, OSError) as exc:
                if pre is not None:  # the user's own file: theirs to fix
                    raise BuildError(f"NPU_AMP_TF_LIBRARY={str(pre)!r} does not load: {exc}") from exc
                # a corrupt or truncated cached build (disk full, a killed copy...):
                # say so, rebuild it and go on
                import warnings

                warnings.warn(f"npu_amp_tf: the cached custom-op library {_path} does not load "
                              f"({str(exc).strip()[:300]}); rebuilding it", RuntimeWarning, stacklevel=2)
                try:
                    os.unlink(_path)
                except OSError:
                    pass
                _path = build(force=True)
                try:
                    _module = tf.load_op_library(str(_path))
                except (tf.errors.OpError, OSError) as exc2:
                    raise BuildError(f"the rebuilt custom-op library {_path} does not load either: "
                                     f"{exc2}") from exc2
        return _module


def main(argv=None):
    """``python -m npu_amp_tf._loader [--force]``: build the custom ops now."""
    force = "--force" in (argv if argv is not None else sys.argv[1:])
    path = build(force=force, verbose=True)
    print(path)


if __name__ == "__main__":
    main()
