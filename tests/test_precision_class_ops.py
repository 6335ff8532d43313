"""Issue 17: the native painting's set-up without a Python read per node.

* ``native.CLASS_OPS``: a node's op from its class (equal signature keys,
  one op), read once per class, not from every node;
* ``native.SOURCE_DEVICES``: "" for every node no pass created or edited
  when the grappler item has no device string (``NpuAmpItemHasDevice``,
  ``Graph.source_has_device``), not every node's own;
* ``native.ONE_DEVICE``: with every device string "", the kernel flags per
  class through numpy, not per (class, device) pair.

False runs the reference.  Each real graph (Keras ResNet50, a Keras 2
transformer, TF-Slim ResNet-v1-50, the BERT-like builder) is rewritten with
the switches on and off, offline and through grappler: byte-identical
graphs, equal reports in the same order.  The facts the fast paths rest on
are checked on those graphs themselves: every node of a class has the
class's op, and the item's device answer matches the graph's devices.
"""
import json

import pytest

from graph_passes.graph import Graph
from graph_passes.precision import native as native_mod
from npu_amp_tf import bridge, pipeline
from test_precision_bulk import MODES, _library, _rewrite, assert_grappler_on_equals_off  # noqa: F401  (_library: an autouse fixture)
from test_precision_fast import _strip_times
from test_precision_native import _graph
from test_speed_paths import optimize_rewritten, plugin_only_grappler

from conftest import assert_same

SWITCHES = ("CLASS_OPS", "SOURCE_DEVICES", "ONE_DEVICE")
REAL = ["keras_resnet50_training", "keras_transformer_training", "slim_resnet_v1_50", "bert_like"]


def _set(monkeypatch, on):
    for s in SWITCHES:
        monkeypatch.setattr(native_mod, s, on)


class _Spy:
    """Records, per painting, whether each node's op is its class's op, the
    device answer and whether the one-device flags ran."""

    def __init__(self, monkeypatch):
        self.class_ops_ok, self.one_dev, self.has_device = [], [], []
        apply_bulk, flags, devices = native_mod._apply_bulk, native_mod._flags_batched, native_mod._devices

        def spy_apply(pp, out, oid, idx, names, nodes, cid, infos, lsts, rec, ops, cop):
            self.class_ops_ok.append(all(cop[cid[i]] == nodes[i].op for i in range(len(nodes))))
            return apply_bulk(pp, out, oid, idx, names, nodes, cid, infos, lsts, rec, ops, cop)

        def spy_flags(*a, **k):
            self.one_dev.append(a[-1] if len(a) == 12 else k.get("one_dev", False))
            return flags(*a, **k)

        def spy_devices(g, nodes, n, base_at):
            fn = g.source_has_device
            self.has_device.append(None if fn is None else fn())
            return devices(g, nodes, n, base_at)

        monkeypatch.setattr(native_mod, "_apply_bulk", spy_apply)
        monkeypatch.setattr(native_mod, "_flags_batched", spy_flags)
        monkeypatch.setattr(native_mod, "_devices", spy_devices)


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
@pytest.mark.parametrize("name", REAL)
def test_offline_equals_reference(k2, monkeypatch, name, mode):
    """Offline (no item: every device read), the switches on and off."""
    gd, fetches = _graph(name, k2)
    spy = _Spy(monkeypatch)
    outs, reps = [], []
    for on in (True, False):
        _set(monkeypatch, on)
        out, rep = _rewrite(monkeypatch, gd, fetches, MODES[mode], True)  # (bulk paths on)
        outs.append(out)
        reps.append(_strip_times(rep.to_json()))
    assert reps[0]["summary"]["casts_inserted"] > 0
    assert_same(outs[0], outs[1], "the switches on and off")
    assert_same(json.dumps(reps[0], default=str), json.dumps(reps[1], default=str), "the reports in their order")
    assert spy.class_ops_ok and all(spy.class_ops_ok)
    assert spy.has_device and all(h is None for h in spy.has_device)  # (offline: not known)


@pytest.mark.parametrize("name", REAL)
def test_through_grappler_equals_reference(k2, monkeypatch, name):
    """Inside grappler (the item answers: no device string), on and off."""
    spy = _Spy(monkeypatch)
    assert_grappler_on_equals_off(k2, name, lambda on: _set(monkeypatch, on))
    # the fast paths ran on the "on" side: the item had no device string,
    # and every node's op was its class's
    assert spy.has_device and all(h is False for h in spy.has_device), spy.has_device
    assert True in spy.one_dev
    assert spy.class_ops_ok and all(spy.class_ops_ok)


def test_devices_in_the_item(k2, monkeypatch):
    """A graph whose nodes carry device strings: the item says so, every
    device is read, and the output equals the reference's."""
    gd, fetches = _graph("keras_resnet50_training", k2)
    for k, n in enumerate(gd.node):
        if k % 3 == 0:
            n.device = "/device:CPU:0"
    mg, cfg = plugin_only_grappler(gd, fetches)
    spy = _Spy(monkeypatch)
    outs = []
    for on in (True, False):
        _set(monkeypatch, on)
        outs.append(optimize_rewritten(cfg, mg, b"devices"))
    assert spy.has_device and spy.has_device[0] is True
    assert spy.one_dev[0] is False
    assert outs[0][0] == outs[1][0]


def test_an_edited_node_keeps_its_device():
    """Nodes a pass created or edited keep their own device strings; the
    others read "" when the source has none."""
    from tensorflow.core.framework import graph_pb2

    gd = graph_pb2.GraphDef()
    for name in ("a", "b", "c"):
        gd.node.add(name=name, op="NoOp")
    g = Graph(gd)
    g.source_has_device = lambda: False
    g.new_node("NoOp", "d", device="/device:CPU:0")
    nodes = list(g.nodes.values())
    devs, one = native_mod._devices(g, nodes, len(nodes), g.base_positions)
    assert devs == ["", "", "", "/device:CPU:0"] and one is False
    g2 = Graph(gd)
    g2.source_has_device = lambda: False
    nodes = list(g2.nodes.values())
    assert native_mod._devices(g2, nodes, len(nodes), g2.base_positions) == (["", "", ""], True)
    g2.source_has_device = lambda: None  # (not known: every node's own)
    nodes[1].device = "/device:CPU:0"
    assert native_mod._devices(g2, nodes, len(nodes), g2.base_positions) == (["", "/device:CPU:0", ""], False)


def test_item_has_device_outside_the_callback():
    assert bridge.item_has_device(None) is None


@pytest.mark.parametrize("name", ["keras_resnet50_training", "bert_like"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_memos_refilled_per_batch(k2, monkeypatch, name, mode):
    """``native.GROUP_MEMOS`` on and off: the same memo entries after the
    painting (dtypes and facts per node) and the same graph."""
    from graph_passes.manager import PassContext
    from graph_passes.precision import amp
    from npu_amp_tf.options import Options

    gd, fetches = _graph(name, k2)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(native_mod, "GROUP_MEMOS", on)
        graph = Graph(gd)
        ctx = PassContext(Options.from_kwargs(precision_mode=mode), fetches, ())
        ctx.native_paint = pipeline.native_paint_entry()
        pp = amp.PrecisionPass()
        pp.run(graph, ctx)
        dts = {k: (v[0].name, v[1], v[2]) for k, v in pp._dts.items()}
        info = {k: (v[0], v[1].attrs, list(v[1].in_attr), v[1].fixed, v[1].fidx) for k, v in pp._info.items()}
        runs.append((dts, info, [n.SerializeToString(deterministic=True) for n in graph.nodes.values()]))
    assert len(runs[0][0]) > 100 and len(runs[0][1]) > 100
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == runs[1][1]
    assert runs[0][2] == runs[1][2]
