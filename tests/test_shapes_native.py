"""Issue 17: the fusion pass's producer walks of ``shapes.local_shape`` in C++
over the gradient-region search's mirror (``NpuAmpGrShape``,
``grad_region.NATIVE_SHAPES``), against the Python walk it replaces.

The C++ walk reads the ops and inputs of the mirror (current after a sync)
and the attrs of the NodeDef bytes the graph was built from; a node edited
since whose attrs it needs, or a form it leaves to Python, makes it give up
(``shapes.UNANSWERED``) and Python walks that tensor.  So every answer it
gives must be Python's:

* every tensor of real training graphs (the BERT-like builder, a Keras 2
  transformer, Keras ResNet50, TF-Slim ResNet-v1-50, learning-phase conds)
  in two orders, and the known ones against grappler's own shape inference
  (an independent source);
* a graph of every op form the walk covers, with and without recorded
  ``_output_shapes``, and hand-made edge cases (padded int constants, "x:0"
  names, a cycle, wrong attr kinds);
* after edits (a constant replaced, a node removed): the edited cone is left
  to Python, the rest answered as on the current graph, and an answer given
  before an edit is kept, as Python's memo keeps it;
* through grappler: byte-identical output and report with the switch on and
  off, every answer compared with the Python walk (the suite's CHECK_NATIVE).
"""
import numpy as np
import pytest
import tensorflow as tf

from graph_passes import shapes as S
from graph_passes.fusion import grad_region as gr
from graph_passes.graph import Graph
from test_precision_bulk import _library  # noqa: F401  (an autouse fixture: the library loaded)
from test_precision_fast import _strip_times
from test_precision_native import _graph
from test_speed_paths import optimize_rewritten, plugin_only_grappler

tf1 = tf.compat.v1

REAL = ["bert_like", "keras_transformer_training", "keras_resnet50_training", "slim_resnet_v1_50",
        "learning_phase_conds"]


@pytest.fixture(autouse=True)
def _needs_native():
    if gr.native is None or not getattr(gr.native, "can_shape", False):
        pytest.skip("the C++ shape walk is not loaded")


class _Walk:
    """A graph built from bytes, its mirror, and a C++ memo."""

    def __init__(self, gd):
        self.g = Graph(gd)
        self.g.source_bytes = gd.SerializeToString()
        self.m = gr._Mirror(gr.native, self.g)
        assert self.m.ok and self.m.attrs
        self.memo = gr.native.shape_memo()
        self.buf = gr.native.shape_buffer()

    def __del__(self):
        gr.native.free_shape_memo(self.memo)

    def sync(self):
        assert self.m.sync(self.g, None)

    def ask(self, ref):
        ok, sh = gr.native.shape(self.m.h, self.memo, ref, self.buf)
        return sh if ok else S.UNANSWERED


def _refs(g):
    """Every node's output 0 and every data input as written (other ports)."""
    refs = dict.fromkeys(g.nodes)
    for node in g.nodes.values():
        for i in node.input:
            if not i.startswith("^"):
                refs[i] = None
    return list(refs)


def _compare(w, refs, memo=None):
    """(answered, known) after checking each C++ answer against Python's walk
    with a memo filled in the same order."""
    memo = {} if memo is None else memo
    answered = known = 0
    for ref in refs:
        got = w.ask(ref)
        want = S.local_shape(w.g, ref, memo)
        if got is not S.UNANSWERED:
            assert got == want, ref
            answered += 1
            known += got is not None
    return answered, known


@pytest.mark.parametrize("name", REAL)
def test_every_tensor_of_real_graphs(k2, name):
    """In graph order and reversed (long walks first): each answer is the
    Python walk's, nearly every tensor is answered, and each known shape is
    grappler's wherever grappler infers a fully known one."""
    gd, _ = _graph(name, k2)
    inferred = S.infer_shapes(gd)
    for order in (1, -1):
        w = _Walk(gd)
        refs = _refs(w.g)[::order]
        answered, known = _compare(w, refs)
        assert answered >= 0.98 * len(refs), (answered, len(refs))
        assert known >= 0.3 * len(refs), (known, len(refs))
    agree = 0
    for ref in refs:
        got = w.ask(ref)
        if got is S.UNANSWERED or got is None:
            continue
        node, port, _ = gr.parse_tensor(ref)
        theirs = inferred.get(node)
        if theirs is None or port >= len(theirs) or theirs[port] is None or min(theirs[port], default=0) < 0:
            continue
        assert list(theirs[port]) == got, ref
        agree += 1
    assert agree >= 0.25 * len(refs), (agree, len(refs))


#: placeholders built without a shape (so that TF builds the ill-shaped ops
#: below), given one in the GraphDef: the walks read the attr
_PATCHED = {"ux": [4, 6, 8], "um": [24, 8], "ub1": [2, 6, 8], "ub2": [3, 8, 7]}


def _forms_graph_def(add_shapes=False):
    """One of each op form the walk covers, from TF itself."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 6, 8], name="x")
        u = tf1.placeholder(tf.float32, [None, 8], name="u")  # an unknown dim
        ux, um, ub1, ub2 = (tf1.placeholder(tf.float32, None, name=n) for n in _PATCHED)
        w = tf1.get_variable("w", [8, 5], use_resource=True)
        wv = tf1.get_variable("wv", [8, 3], use_resource=False)
        r1 = tf.reshape(x, [-1, 8], name="r1")
        r2 = tf.reshape(x, tf.shape(r1), name="r2")  # a Shape operand
        tf.reshape(x, tf.constant(np.array([24, 8], np.int64)), name="r3")  # int64 tensor_content
        tf.reshape(ux, [5, -1], name="bad_reshape")  # 192 is no multiple of 5
        tf.matmul(r1, w, name="mm")
        tf.matmul(r1, wv, name="mmv")
        tf.matmul(w, r1, transpose_a=True, transpose_b=True, name="mm_t")
        tf.matmul(um, um, name="mm_bad")  # 8 != 24
        tf.matmul(u, w, name="mm_unknown")
        bx = tf.zeros([2, 1, 6, 8], name="bx")
        by = tf.zeros([3, 8, 7], name="by")
        tf.linalg.matmul(bx, by, name="bmm2")  # BatchMatMulV2, broadcast batch
        tf.raw_ops.BatchMatMul(x=tf.zeros([2, 6, 8]), y=tf.zeros([2, 7, 8]), adj_y=True, name="bmm1")
        tf.raw_ops.BatchMatMul(x=ub1, y=ub2, name="bmm1_bad")  # batch dims 2 != 3
        tf.fill(tf.shape(x), 1.0, name="fill")
        tf.broadcast_to(tf.constant(1.0), [3, 4], name="bcast")
        tf.tile(x, [2, 1, 3], name="tile")
        tf.transpose(x, [2, 0, 1], name="tr")
        tf.reduce_sum(x, [1], keepdims=True, name="sum_keep")
        tf.reduce_mean(x, -1, name="mean_neg")
        tf.reduce_max(x, [0, 2], name="max2")
        tf.raw_ops.Sum(input=ux, axis=tf.constant([3]), name="sum_bad")  # out of range
        sd = tf.math.squared_difference(x, tf.reduce_mean(x, -1, keepdims=True), name="sqd")
        tf.add_n([sd, sd, x], name="addn")
        tf.add_n([tf.reshape(u, [-1]), tf.reshape(x, [-1])], name="addn_second")
        tf.nn.relu(tf.nn.bias_add(r1, tf.zeros([8])), name="relu")
        tf.add(x, tf.zeros([6, 1]), name="bc_add")
        tf.add(ux, tf.zeros([5, 1]), name="bc_bad")
        tf.identity(tf.stop_gradient(r2), name="ident")
        tf.cast(x, tf.float16, name="cast")
    gd = g.as_graph_def(add_shapes=add_shapes)
    for n in gd.node:
        if n.name in _PATCHED:
            n.attr["shape"].shape.Clear()
            for d in _PATCHED[n.name]:
                n.attr["shape"].shape.dim.add(size=d)
    return gd


@pytest.mark.parametrize("add_shapes", [False, True])
def test_every_op_form(add_shapes):
    """Every tensor of the forms graph answered, as Python answers it; with
    ``_output_shapes`` recorded (then most answers come from the attr)."""
    gd = _forms_graph_def(add_shapes)
    w = _Walk(gd)
    refs = _refs(w.g)
    answered, known = _compare(w, refs)
    assert answered == len(refs)
    want = {"r1": [24, 8], "r2": [24, 8], "r3": [24, 8], "mm": [24, 5], "mmv": [24, 3],
            "mm_t": [5, 24], "bmm2": [2, 3, 6, 7], "bmm1": [2, 6, 7], "fill": [4, 6, 8],
            "bcast": [3, 4], "tile": [8, 6, 24], "tr": [8, 4, 6], "sum_keep": [4, 1, 8],
            "mean_neg": [4, 6], "max2": [6], "sqd": [4, 6, 8], "addn": [4, 6, 8], "relu": [24, 8],
            "bc_add": [4, 6, 8], "ident": [24, 8], "cast": [4, 6, 8], "addn_second": [192]}
    for ref, sh in want.items():
        assert w.ask(ref) == sh, ref
    for ref in ("bad_reshape", "mm_bad", "mm_unknown", "bmm1_bad", "sum_bad", "bc_bad", "u"):
        assert w.ask(ref) is None, ref


def _node(name, op, inputs=(), **attrs):
    from tensorflow.core.framework import node_def_pb2

    n = node_def_pb2.NodeDef(name=name, op=op, input=list(inputs))
    for k, v in attrs.items():
        n.attr[k].CopyFrom(v)
    return n


def test_edge_cases_left_to_python():
    """Forms the C++ walk does not decode as Python does are left to it, and
    ``local_shape`` with the ask gives Python's answer: an int constant
    padded by ``tf.make_ndarray``, a tensor named "x:0", a cycle.  A bool
    attr given as another kind reads False, as in Python."""
    from tensorflow.core.framework import attr_value_pb2, graph_pb2, tensor_pb2, tensor_shape_pb2

    def av(**kw):
        return attr_value_pb2.AttrValue(**kw)

    def shape(*dims):
        return tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d)
                                                      for d in dims])

    f32 = av(type=1)
    gd = graph_pb2.GraphDef()
    gd.node.extend([
        _node("p", "Placeholder", dtype=f32, shape=av(shape=shape(2, 3, 4))),
        # a [3] int32 listed as one value: tf.make_ndarray repeats it, [4, 4, 4]
        _node("padded", "Const", dtype=av(type=3), value=av(tensor=tensor_pb2.TensorProto(
            dtype=3, tensor_shape=shape(3), int_val=[4]))),
        _node("rp", "Reshape", ["p", "padded"], T=f32, Tshape=av(type=3)),
        # listed in full (packed varints, a negative one among them)
        _node("listed", "Const", dtype=av(type=3), value=av(tensor=tensor_pb2.TensorProto(
            dtype=3, tensor_shape=shape(2), int_val=[-1, 8]))),
        _node("rl", "Reshape", ["p", "listed"], T=f32, Tshape=av(type=3)),
        _node("named0", "Identity", ["p:0"], T=f32),
        _node("c1", "Identity", ["c2"], T=f32),
        _node("c2", "Identity", ["c1"], T=f32),
        _node("q", "Placeholder", dtype=f32, shape=av(shape=shape(3, 5))),
        _node("mm_i", "MatMul", ["q", "q"], T=f32, transpose_a=av(i=1)),  # not a bool: False
        _node("mm_b", "MatMul", ["q", "q"], T=f32, transpose_a=av(b=True)),
    ])
    w = _Walk(gd)
    assert w.ask("rp") is S.UNANSWERED
    assert w.ask("named0") is S.UNANSWERED
    assert w.ask("c1") is S.UNANSWERED
    assert w.ask("mm_i") is None  # [3,5] x [3,5] without the transpose
    assert w.ask("mm_b") == [5, 5]
    assert w.ask("rl") == [3, 8] == S.local_shape(w.g, "rl", {})
    w.sync()
    for ref in ("rp", "named0", "c1", "c2", "mm_i", "mm_b", "p"):
        ask = gr._ShapeAsk(w.g)
        assert S.local_shape(w.g, ref, {}, ask) == S.local_shape(w.g, ref, {}), ref
    assert S.local_shape(w.g, "rp", {}) == [4, 4, 4]
    assert S.local_shape(w.g, "c1", {}) is None


def test_edits_are_left_to_python_and_answers_kept(k2):
    """After edits synced to the mirror: the edited cone is left to Python
    (a Reshape whose shape constant was replaced), a removed node answers
    None, every answer equals the Python walk on the current graph with
    fresh memos; and with the memo of before the edits, the answer given
    then is kept (Python's memo keeps it too)."""
    from tensorflow.core.framework import node_def_pb2

    gd = _forms_graph_def()
    w = _Walk(gd)
    kept = {}
    assert S.local_shape(w.g, "r3", kept, w.ask) == [24, 8]
    # the shape constant of r3 replaced by one giving another shape
    const = next(i for i in w.g.nodes["r3"].input if not i.startswith("^") and i != "x")
    old = w.g.nodes[const]
    new = node_def_pb2.NodeDef()
    new.CopyFrom(old)
    new.attr["value"].tensor.tensor_content = np.array([12, 16], np.int64).tobytes()
    w.g.remove_node(const, force=True)
    w.g.add_node(new)
    w.g.remove_node("mm_t", force=True)
    w.sync()
    assert w.ask("mm_t") is None
    fresh = _Walk.__new__(_Walk)
    fresh.g, fresh.m, fresh.buf = w.g, w.m, w.buf
    fresh.memo = gr.native.shape_memo()
    assert fresh.ask("r3") is S.UNANSWERED
    assert S.local_shape(w.g, "r3", {}, fresh.ask) == [12, 16]
    answered, _ = _compare(fresh, _refs(w.g))
    assert answered >= len(_refs(w.g)) - 3
    # the memo of before: both keep the first answer
    assert w.ask("r3") == [24, 8]
    assert S.local_shape(w.g, "r3", kept, w.ask) == [24, 8]


@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_through_grappler_identical(k2, monkeypatch, name, mode):
    """Through grappler: the same output bytes and report with the C++ walk
    and without; with it, answers were given (and each compared with the
    Python walk: CHECK_NATIVE)."""
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(gr, "NATIVE_SHAPES", on)
        calls = []
        real = type(gr.native).shape

        def spy(self, h, memo, ref, buf, _calls=calls, _real=real):
            got = _real(self, h, memo, ref, buf)
            _calls.append(got[0])
            return got

        monkeypatch.setattr(type(gr.native), "shape", spy)
        checked = gr.CHECKED_SHAPES[0]
        gd, fetches = _graph(name, k2)
        mg, cfg = plugin_only_grappler(gd, fetches)
        cfg.graph_options.rewrite_options.custom_optimizers[0].parameter_map["precision_mode"].s = mode.encode()
        out, rep = optimize_rewritten(cfg, mg, name.encode())
        runs[on] = (out, _strip_times(rep))
        if on:
            assert sum(calls) > 0, calls
            if gr.CHECK_NATIVE:
                assert gr.CHECKED_SHAPES[0] > checked
        else:
            assert calls == []
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1]


def test_no_asker_without_the_call_or_a_mirror(k2, monkeypatch):
    """Python walks when the library lacks the call or the graph has no
    mirror (or one of names only)."""
    gd = _forms_graph_def()
    g = Graph(gd)
    assert gr.shape_asker(g) is None  # no mirror
    g.source_bytes = gd.SerializeToString()
    setattr(g, gr._MIRROR_ATTR, gr._Mirror(gr.native, g))
    assert gr.shape_asker(g) is not None
    monkeypatch.setattr(gr.native, "can_shape", False)
    assert gr.shape_asker(g) is None
    monkeypatch.undo()
    g2 = Graph(gd)  # no source bytes: a mirror of names, ops and inputs
    m2 = gr._Mirror(gr.native, g2)
    assert m2.ok and not m2.attrs
    setattr(g2, gr._MIRROR_ATTR, m2)
    assert gr.shape_asker(g2) is None
