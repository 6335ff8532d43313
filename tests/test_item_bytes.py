"""Issue 17 (stop 39): ``NpuAmpOptimizer`` serializes the item grappler hands
it into one buffer kept between calls (``ItemBytes`` in
custom_ops/grappler_bridge.cc) instead of a fresh string per call, whose pages
the kernel faulted in and zeroed again every time (TF 2.21.0, Keras ResNet50
training graph: 14.3 -> 7.2 ms of thread CPU).  The kept buffer is usually
larger than the graph in hand (a big graph came before): Python must get
exactly the graph's bytes, the same bytes for the same graph whatever came
before, and the fingerprints built on them must keep working.

Oracles: the item's own node names (the fan-in of the fetch in the graph
handed to grappler, computed here from that graph), the bytes'
own re-serialized size (no trailing bytes of an earlier, larger graph), the
bytes of the same graph captured after a small and after a large graph, and
the memo and the C++ "seen" skip, which both key on those bytes."""
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.grappler import tf_optimizer

from npu_amp_tf import bridge
from test_speed_paths import plugin_only_grappler

tf1 = tf.compat.v1


def _mlp(width, layers, name="loss"):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, width], name="x")
        h = x
        for i in range(layers):
            w = tf1.get_variable(f"w{i}", [width, width])
            h = tf.nn.relu(tf.matmul(h, w))
        tf.reduce_mean(h, name=name)
    return g.as_graph_def()


def _fanin(gd, fetch):
    """The names of ``fetch`` and every node it depends on (data or control):
    what grappler keeps of the graph for that fetch."""
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in gd.node}
    seen, stack = set(), [fetch]
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(inputs[name])
    return sorted(seen)


@pytest.fixture
def captured(monkeypatch):
    """The item bytes of every callback, in order."""
    got = []
    real = bridge.handle

    def spy(graph_bytes, *a, **k):
        got.append(bytes(graph_bytes))
        return real(graph_bytes, *a, **k)

    monkeypatch.setattr(bridge, "handle", spy)
    bridge.register()
    bridge.clear_reports()  # (the memo and the C++ "seen" fingerprints too)
    return got


def _optimize(gd, graph_id):
    """One grappler call with the plugin alone: {counter: increase} of
    ``bridge.stats()`` (rewritten, cached, unchanged, skipped_seen...)."""
    mg, cfg = plugin_only_grappler(gd, fetches=("loss",))
    before = bridge.stats()
    tf_optimizer.OptimizeGraph(cfg, mg, graph_id=graph_id)
    after = bridge.stats()
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_a_small_graph_after_a_large_one_gets_exactly_its_bytes(captured):
    small, large = _mlp(8, 2), _mlp(64, 60)
    _optimize(small, b"small-first")
    _optimize(large, b"large")
    _optimize(small, b"small-after-large")
    assert len(captured) == 3
    first, big, after = captured
    assert len(big) > 10 * len(first)
    for data, gd in ((first, small), (big, large), (after, small)):
        parsed = graph_pb2.GraphDef.FromString(data)
        # every byte is the graph's: re-serialized, the same size (a tail of
        # the larger graph's bytes would add fields or fail to parse)
        assert len(parsed.SerializeToString()) == len(data)
        assert sorted(n.name for n in parsed.node) == _fanin(gd, "loss")
    # deterministic: the same graph, the same bytes, whatever the buffer held before
    assert after == first


def test_the_memo_and_the_seen_skip_still_recognise_a_graph(captured):
    gd = _mlp(8, 3)
    assert _optimize(gd, b"memo-1").get("rewritten") == 1
    _optimize(_mlp(64, 40), b"memo-large")  # the kept buffer grows past the small graph
    # the same bytes again: Python's memo answers (keyed by the C++ fingerprint of the bytes)
    assert _optimize(gd, b"memo-2").get("cached") == 1
    assert captured[0] == captured[2]

    # a graph the plugin leaves unchanged is remembered by its fingerprint in
    # C++ and not handed to Python again
    plain = graph_pb2.GraphDef()
    with tf.Graph().as_default() as g:
        a = tf1.placeholder(tf.float32, [2], name="a")
        tf.identity(a, name="loss")
    plain.CopyFrom(g.as_graph_def())
    n = len(captured)
    first = _optimize(plain, b"plain-1")
    assert first.get("unchanged") == 1, first
    _optimize(_mlp(64, 40), b"plain-large")
    assert _optimize(plain, b"plain-2") == {"skipped_seen": 1}
    assert len(captured) == n + 2  # plain-1 and the large graph; plain-2 never reached Python
