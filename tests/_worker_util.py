"""Run a test worker script in a fresh Python process (a kernel TF cannot run may
abort the process) and read back the ``RESULT <json>`` lines it prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_worker(worker: str, kind: str, onednn: bool = True, timeout: int = 600,
               portable: bool = False) -> list[dict]:
    """``worker kind`` with oneDNN on (TF's default) or off, and with the BF16 kernels'
    portable loops forced (``NPU_AMP_TF_BF16_PORTABLE=1`` in the worker only) when
    ``portable``; asserts it finished (exit 0 and a ``DONE`` line) and returns the
    decoded ``RESULT`` lines."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    if onednn:
        env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    else:
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    if portable:
        env["NPU_AMP_TF_BF16_PORTABLE"] = "1"
    p = subprocess.run([sys.executable, worker, kind], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0 and "DONE" in p.stdout, \
        f"worker {kind} (oneDNN {'on' if onednn else 'off'}) failed rc={p.returncode}:\n{p.stderr[-3000:]}"
    return [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]


def cached_results(worker: str, timeout: int, transform=None):
    """``results(kind, onednn=True)``: :func:`run_worker` once per (kind, oneDNN) in this
    test session, its RESULT lines passed through ``transform`` when given."""
    cache = {}

    def results(kind: str, onednn: bool = True):
        if (kind, onednn) not in cache:
            out = run_worker(worker, kind, onednn, timeout=timeout)
            cache[kind, onednn] = transform(out) if transform else out
        return cache[kind, onednn]

    return results


def run_from(sess, variables: dict, start, fetches, feeds):
    """In a worker: load ``start`` (name -> value; None: read the initialised values,
    so later configurations start where the first one did) into ``variables``,
    run ``fetches`` once with the executed partition graphs recorded, and return
    ``(start, outputs, RunMetadata, {name: value after the run})``."""
    import tensorflow as tf

    tf1 = tf.compat.v1
    if start is None:
        start = {k: sess.run(v) for k, v in variables.items()}
    for k, v in variables.items():
        v.load(start[k], sess)
    md = tf1.RunMetadata()
    out = sess.run(fetches, feeds, options=tf1.RunOptions(output_partition_graphs=True), run_metadata=md)
    return start, out, md, {k: sess.run(v) for k, v in variables.items()}


def rel_l2(a, b) -> float:
    """||a - b|| / ||b|| in float64 (0-safe)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def onednn_on() -> bool:
    from graph_passes.fusion.builtin import onednn_enabled
    return onednn_enabled()


def executed_ops(md) -> dict:
    """{"op:dtype": count} over the partition graphs of a traced run (dtype: attr T, else "")."""
    from collections import Counter

    import tensorflow as tf
    ops = Counter()
    for pg in md.partition_graphs:
        for n in pg.node:
            dt = tf.dtypes.as_dtype(n.attr["T"].type).name if "T" in n.attr else ""
            ops[f"{n.op}:{dt}"] += 1
    return dict(ops)
