"""Deferred frees (issue 17): what a grappler callback only has to destroy
(the nodes the layer-norm fusion before the parse replaced, the patch parsed
for the OpDef pre-check, the index, the gradient-region mirrors) is
destroyed on one helper thread of the library (custom_ops/deferred_free.cc,
``bridge.DEFER_FREES``), outside grappler's timer around the optimizer.

Checked here: inside grappler, on real training graphs, the output is
byte-identical with the frees inline; the frees were handed over and all of
them ran (the library's own counts, after a drain); a process that exits
with frees still queued exits cleanly (a subprocess: the exit handler closes
the queue while TensorFlow's statics are still alive).
"""
import os
import subprocess
import sys
import textwrap

import pytest

from npu_amp_tf import bridge
from test_precision_core import _build
from test_speed_paths import optimize_rewritten, plugin_only_grappler

pytestmark = pytest.mark.skipif(bridge.deferred_free_counts() is None,
                                reason="the library has no deferred frees")


@pytest.mark.parametrize("name", ["bert_like", "keras_resnet50_training"])
def test_deferred_frees_leave_the_output_unchanged(k2, monkeypatch, name):
    gd, fetches = _build(name, k2)
    mg, cfg = plugin_only_grappler(gd, fetches)
    outs = {}
    for on in (False, True, False):
        monkeypatch.setattr(bridge, "DEFER_FREES", on)
        bridge.drain_deferred_frees()
        before = bridge.deferred_free_counts()
        outs.setdefault(on, []).append(optimize_rewritten(cfg, mg, f"{name}-{on}-{len(outs)}".encode())[0])
        bridge.drain_deferred_frees()
        queued, ran = bridge.deferred_free_counts()
        handed = queued - before[0]
        if on:
            # the callback's leftovers went to the helper (the Sink's at least;
            # on BERT-like also the replaced nodes and the run's mirror), and ran
            assert handed >= (3 if name == "bert_like" else 1), handed
        else:
            assert handed == 0
        assert ran == queued
    assert outs[True][0] == outs[False][0] == outs[False][1]


def test_exit_with_frees_queued_is_clean(tmp_path):
    """Many callbacks, then the interpreter exits at once (no drain): the
    exit handler closes the queue; the process ends with status 0 and the
    script's last line printed."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{here!r}, {root!r}]
        import tensorflow as tf
        from npu_amp_tf import bridge
        from test_precision_core import _build
        from test_speed_paths import plugin_only_grappler
        from tensorflow.python.grappler import tf_optimizer
        gd, fetches = _build("bert_like", tf.keras)
        mg, cfg = plugin_only_grappler(gd, fetches)
        for i in range(4):
            tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"x%d" % i)
        queued, ran = bridge.deferred_free_counts()
        assert queued > 0, (queued, ran)
        print("done", queued, flush=True)
    """)
    path = tmp_path / "exit_with_frees.py"
    path.write_text(script)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("done"), proc.stdout
