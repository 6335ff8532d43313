"""Shared test helpers.  Tests build real graphs with TensorFlow itself."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# (issue 17) every gradient-region search runs in C++ and in Python, and
# the two are compared (graph_passes.fusion.grad_region.CHECK_NATIVE); the
# workers the tests start inherit it
os.environ.setdefault("NPU_AMP_TF_CHECK_NATIVE_GRAD_REGION", "1")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

TF_VERSION = tuple(int(x) for x in tf.__version__.split(".")[:2])

# Two logical CPU devices for the whole session, so that MirroredStrategy tests
# really all-reduce between two replicas.  This must run before TensorFlow
# initialises its runtime, hence here (conftest is imported first).
TWO_CPUS = ["/cpu:0", "/cpu:1"]
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
HAS_ESTIMATOR = hasattr(tf, "estimator") and TF_VERSION < (2, 16)


def keras2():
    """Keras 2: tf.keras on TF 2.15, the tf_keras package on newer TF (None if absent)."""
    if TF_VERSION < (2, 16):
        return tf.keras
    try:
        import tf_keras
        return tf_keras
    except ImportError:
        return None


requires_estimator = pytest.mark.skipif(
    not HAS_ESTIMATOR, reason=f"tf.estimator is gone in TensorFlow {tf.__version__} (last in 2.15)")
requires_keras2 = pytest.mark.skipif(
    keras2() is None, reason=f"Keras 2 (tf_keras) is not installed for TensorFlow {tf.__version__}")


@pytest.fixture(scope="module")
def real_graphs():
    """[(label, GraphDef, fetches)] of the real training graphs the reference
    switches are compared on (test_graph_fast_paths._real_graphs: the BERT-like
    builder, Keras ResNet-50, a Keras transformer block, TF-Slim ResNet-v1-50)."""
    from test_graph_fast_paths import _real_graphs

    k = keras2()
    if k is None:
        pytest.skip("Keras 2 (tf_keras) not installed")
    return list(_real_graphs(k))


@pytest.fixture
def k2():
    k = keras2()
    if k is None:
        pytest.skip("Keras 2 (tf_keras) not installed")
    return k


def pytest_terminal_summary(terminalreporter):
    """The lane's peak memory, for reading CI logs (two lanes share the machine)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    terminalreporter.write_line(f"peak RSS of the test process: {peak:.0f} MiB")
    import sys

    gr = sys.modules.get("graph_passes.fusion.grad_region")
    if gr is not None and gr.CHECKED[0]:
        terminalreporter.write_line(f"gradient-region searches run in C++ and in Python and compared: "
                                    f"{gr.CHECKED[0]}, and their finishes with the C++ hints and "
                                    f"without: {gr.CHECKED_FINISH[0]}, and producer-walked shapes from the "
                                    f"C++ walk and Python's: {gr.CHECKED_SHAPES[0]}, and layer-norm "
                                    f"analyses: {gr.CHECKED_NORMS[0]}; differing: "
                                    f"{len(gr.CHECKED[1])}")
        for fwd, a, b in gr.CHECKED[1][:5]:
            terminalreporter.write_line(f"C++ and Python gradient-region searches (or finishes) differ for "
                                        f"{fwd[:3]}...:\n  C++:    {a!r}\n  Python: {b!r}")
    np_ = sys.modules.get("graph_passes.fusion.norm_plan")
    if np_ is not None and np_.CHECKED_PLANS[1]:
        terminalreporter.write_line(f"layer-norm plans made in C++ and compared with Python's: "
                                    f"{np_.CHECKED_PLANS[1]}; differing: {len(np_.CHECKED_PLANS[2])}")
        if np_.LEFT:  # (where the planner left anchors to Python, most frequent first)
            top = sorted(np_.LEFT.items(), key=lambda kv: -kv[1])[:5]
            terminalreporter.write_line("anchors the layer-norm planner left to Python, by why: " +
                                        "; ".join(f"{n}x {why or '?'}" for why, n in top))
        for anchor, a, b in np_.CHECKED_PLANS[2][:5]:
            terminalreporter.write_line(f"the C++ and Python layer-norm plans differ at '{anchor}':\n"
                                        f"  C++:    {a!r}\n  Python: {b!r}")
    pf = sys.modules.get("graph_passes.fusion.prefuse")
    if pf is not None and (pf.CHECKED[0] or pf.LEFT):
        terminalreporter.write_line(f"layer-norm fusions made in C++ before the parse: {pf.CHECKED[1]} in "
                                    f"{pf.CHECKED[0]} graphs; runs compared with the Python rule's: "
                                    f"{pf.CHECKED[2]}; differing: {len(pf.CHECKED[3])}; the passes' shape "
                                    f"lookups answered from its walks and compared with Python's: "
                                    f"{pf.CHECKED_SHAPES[0]}; runs to their last anchor after which the "
                                    f"rule run again found nothing: {pf.CHECKED_IDLE[0]}")
        if pf.LEFT:
            top = sorted(pf.LEFT.items(), key=lambda kv: -kv[1])[:6]
            terminalreporter.write_line("runs before the parse that ended early or did not run, by why: " +
                                        "; ".join(f"{n}x {why or '?'}" for why, n in top))
        for problems in pf.CHECKED[3][:5]:
            terminalreporter.write_line(f"the C++ layer-norm fusion before the parse differs: {problems}")


    pl = sys.modules.get("npu_amp_tf.pipeline")
    if pl is not None and pl.CHECKED_RECORDS[0]:
        terminalreporter.write_line(f"patches with records assembled and compared with the whole graph: "
                                    f"{pl.CHECKED_RECORDS[0]}; differing: {len(pl.CHECKED_RECORDS[1])}")
        for d in pl.CHECKED_RECORDS[1][:5]:
            terminalreporter.write_line(f"a patch with records differs from the whole graph: {d}")


def pytest_sessionfinish(session, exitstatus):
    """A C++ gradient-region search that differed from Python's fails the
    run, even where a pass's error handling kept the test from seeing it."""
    import sys

    gr = sys.modules.get("graph_passes.fusion.grad_region")
    np_ = sys.modules.get("graph_passes.fusion.norm_plan")
    pf = sys.modules.get("graph_passes.fusion.prefuse")
    if ((gr is not None and gr.CHECKED[1]) or (np_ is not None and np_.CHECKED_PLANS[2])
            or (pf is not None and pf.CHECKED[3])):
        session.exitstatus = 1  # (pytest_terminal_summary prints them)


def assert_same(a, b, what="the values"):
    """``assert a == b`` for long strings or bytes (a report's JSON, a
    serialised graph), explained by the first difference.  pytest's own
    explanation is a difflib diff, quadratic on one long line, and it is not
    truncated under ``-vv`` or with ``CI`` set: the tests that plant a fault
    expect this assertion to fail, and would wait on that diff for hours."""
    if a == b:
        return
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, i - 60)
    raise AssertionError(f"{what} differ at index {i} (lengths {len(a)} and {len(b)}): "
                         f"{a[lo:i + 60]!r} vs {b[lo:i + 60]!r}")
