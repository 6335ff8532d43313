"""Run Ascend tf_adapter scripts here unchanged: ``npu_bridge`` / ``npu_device``.

``install()`` makes the compatibility packages importable under their
tf_adapter names (``npu_bridge``, ``npu_device`` and the ``hccl`` rank API
that ``npu_bridge.npu_init`` re-exports), so a script written for Huawei's
adapter imports them from here::

    import npu_amp_tf.compat
    npu_amp_tf.compat.install()          # or: npu-amp run train.py ...
    from npu_bridge.npu_init import *     # the script, unchanged

The packages live in ``npu_amp_tf/compat/_shims`` and are put at the END of
``sys.path``: where Huawei's real ``npu_bridge`` / ``npu_device`` is
installed it is never shadowed (``install()`` then does nothing and says so).

``plugin_everywhere(**params)`` is what ``npu-amp run --precision-mode ...``
and ``npu-amp profile script.py --precision-mode ...`` use for a plain TF
script: every ``Session`` without a plugin entry gets one
(:func:`npu_amp_tf.session_config`), every TF2 function runs the pipeline
(:func:`npu_amp_tf.enable`), and the given params are also forced over the
script's own entries through the ``NPU_AMP_<KEY>`` environment overrides
(the report records them).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys

log = logging.getLogger("npu_amp_tf")

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shims")
#: top-level names the compatibility layer provides
PROVIDED = ("npu_bridge", "npu_device", "hccl")
#: the two names a user's script imports; their real versions are never shadowed
ADAPTER_PACKAGES = ("npu_bridge", "npu_device")


def _origin(name):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin or (list(spec.submodule_search_locations or [None])[0])


def real_adapter() -> dict:
    """``{name: location}`` of Huawei's real ``npu_bridge`` / ``npu_device``
    found on ``sys.path`` (not this package's)."""
    out = {}
    for name in ADAPTER_PACKAGES:
        mod = sys.modules.get(name)
        loc = getattr(mod, "__file__", None) if mod is not None else _origin(name)
        if loc and not os.path.abspath(loc).startswith(SHIM_DIR):
            out[name] = loc
    return out


def installed() -> bool:
    return SHIM_DIR in sys.path


def install(verbose: bool = False) -> bool:
    """Make ``npu_bridge`` / ``npu_device`` importable from this package.

    Returns True when the compatibility packages are active, False when
    Huawei's real adapter is installed (then it is used and nothing changes).
    Idempotent."""
    real = real_adapter()
    if real:
        msg = ("npu_amp_tf.compat: Huawei's tf_adapter is installed ("
               + ", ".join(f"{k} at {v}" for k, v in sorted(real.items()))
               + "); the script runs against it, not against the compatibility layer")
        log.warning(msg)
        if verbose:
            print(msg, file=sys.stderr)
        return False
    if SHIM_DIR not in sys.path:
        sys.path.append(SHIM_DIR)
    importlib.invalidate_caches()
    if verbose:
        print("npu_amp_tf.compat: npu_bridge / npu_device come from npu-amp-tf "
              f"({SHIM_DIR})", file=sys.stderr)
    return True


def uninstall():
    """Undo :func:`install` (for tests): drop the path and the imported shims."""
    while SHIM_DIR in sys.path:
        sys.path.remove(SHIM_DIR)
    for name in list(sys.modules):
        if name.split(".")[0] in PROVIDED:
            f = getattr(sys.modules[name], "__file__", None) or ""
            if os.path.abspath(f).startswith(SHIM_DIR):
                del sys.modules[name]
    from . import _sessions

    _sessions.unpatch()


@contextlib.contextmanager
def plugin_everywhere(**params):
    """Run the pipeline with ``params`` in every Session and TF2 function made
    inside the block (see the module docstring).  ``params`` are validated
    first; an empty ``params`` changes nothing."""
    if not params:
        yield
        return
    from ..options import ENV_PREFIX, Options

    opts = Options.from_kwargs(_source="npu-amp run", _groups=("rewrite",), **params)
    env = {}
    for key, value in opts.rewrite_params().items():
        if key in opts.ge:
            continue
        if isinstance(value, (tuple, list)):
            value = ",".join(value)
        env[ENV_PREFIX + key.upper()] = str(value)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from .. import config as _config
    from . import _sessions

    _sessions.patch(default_params=dict(params))
    _config.enable(**params)
    try:
        yield opts
    finally:
        _config.disable()
        _sessions.set_default_params(None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_script(script: str, script_args=(), params=None) -> int:
    """``npu-amp run``: run ``script`` as ``__main__`` with ``sys.argv =
    [script, *script_args]`` and its directory first on ``sys.path`` (as
    ``python script.py`` does), after :func:`install` and, with ``params``,
    inside :func:`plugin_everywhere`.  Returns the script's exit status (an
    uncaught exception prints its traceback and gives 1, as Python does)."""
    import runpy
    import traceback

    from ..errors import NpuAmpError

    class ScriptError(NpuAmpError):
        pass

    if not os.path.isfile(script):
        raise ScriptError(f"script '{script}' does not exist (npu-amp run SCRIPT [script args]; "
                          "accepted: a path to a .py file)")
    install(verbose=True)
    script = os.path.abspath(script)
    old_argv, old_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [script] + list(script_args)
    sys.path.insert(0, os.path.dirname(script))
    try:
        with plugin_everywhere(**(params or {})):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exc:
                code = exc.code
                if code is None:
                    return 0
                if isinstance(code, int):
                    return code
                print(code, file=sys.stderr)
                return 1
            except BaseException:  # noqa: BLE001 - the script's own error, shown as Python would
                traceback.print_exc()
                return 1
        return 0
    finally:
        sys.argv = old_argv
        if sys.path and sys.path[0] == os.path.dirname(script):
            del sys.path[0]
        _ = old_path0


__all__ = ["run_script", "install", "uninstall", "installed", "real_adapter", "plugin_everywhere", "SHIM_DIR"]
