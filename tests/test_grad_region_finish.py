"""Issue 17: ``grad_region._finish`` with the C++ search's hints
(``grad_region.NATIVE_FINISH``; ``FinishHints`` in custom_ops/grad_region.cc):
its two checks' verdicts, the region's order, the nodes on its boundary and
the control-cycle check come from C++, and Python walks only the boundary.

* Direct calls on TF1 autodiff graphs (a plain region, a residual sum, an
  upstream scale; an inner tensor read outside F and G, and a region waiting
  on its own reader, which ``_finish`` refuses): the same GradRegion, or the
  same refusal, as the reference.
* Through grappler on the BERT-like graph and a Keras 2 transformer, FP16
  and BF16: byte-identical output and the same report with the hints and
  without, every found region finished with hints, and some of them with
  control inputs from outside (BF16) whose cycle check C++ did.
* Planted faults: a boundary missing a node, a check's verdict flipped, a
  cycle check skipped wrongly; each is caught by the comparison the test
  suite runs (``CHECK_NATIVE``).
"""
import collections

import pytest

from graph_passes.fusion.grad_region import GradRegionRefused, find_grad_region
from test_grad_region import _native_lib, _tf1_graph
from test_precision_fast import _strip_times
from test_precision_native import _graph
from test_speed_paths import optimize_rewritten, plugin_only_grappler

VARIANTS = ["plain", "residual", "upstream_scale", "probe", "cycle"]


def _outcome(fn):
    try:
        r = fn()
    except GradRegionRefused as e:
        return ("refused", str(e), sorted(e.why_not.items()))
    return ("found", r.nodes, r.dy, list(r.outputs.items()), r.ctrl_inputs, r.ctrl_consumers,
            sorted(r._fwd_dep.items()), sorted(r._dy_dep.items()))


def _spy_hints(monkeypatch, gr):
    seen = []
    real = gr._hints

    def hints(parts, n):
        h = real(parts, n)
        seen.append(h)
        return h

    monkeypatch.setattr(gr, "_hints", hints)
    return seen


@pytest.mark.parametrize("variant", VARIANTS)
def test_hinted_finish_equals_the_reference_on_direct_calls(monkeypatch, variant):
    """The same GradRegion or refusal with the hints and without; where
    _finish refuses (an inner tensor read outside F and G: its first check;
    a region waiting on its own reader: the cycle check), C++ saw it and
    Python gave the message."""
    gr = _native_lib()
    monkeypatch.setattr(gr, "CHECK_NATIVE", False)
    seen = _spy_hints(monkeypatch, gr)
    outcomes = []
    for on in (True, False):
        monkeypatch.setattr(gr, "NATIVE_FINISH", on)
        seen.clear()
        outcomes.append(_outcome(lambda: _direct(gr, variant)))
        if on:
            hints = list(seen)
    assert outcomes[0] == outcomes[1]
    assert hints and hints[-1] is not None
    ok1, ok2, cycle, order, boundary = hints[-1]
    assert sorted(order) == list(range(len(order))) and boundary == sorted(boundary)
    if variant == "probe":
        assert outcomes[0][0] == "refused" and "'ln/Mean' is also read by 'probe'" in outcomes[0][1]
        assert ok1 is False
    elif variant == "cycle":
        assert outcomes[0][0] == "refused" and "waits on 'late_reader'" in outcomes[0][1]
        assert cycle == 2
    else:
        assert outcomes[0][0] == "found" and ok1 and ok2 and cycle in (0, 1)
        assert len(boundary) < len(order)  # (Python walked fewer nodes than the region has)


@pytest.mark.parametrize("name", ["bert_like", "keras_transformer_training"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_hinted_finish_through_grappler(k2, monkeypatch, name, mode):
    gr = _native_lib()
    monkeypatch.setattr(gr, "CHECK_NATIVE", False)
    seen = _spy_hints(monkeypatch, gr)
    finishes = collections.Counter()
    real_finish = gr._finish

    def finish(*a, hints=None):
        finishes["hinted" if hints is not None else "reference"] += 1
        return real_finish(*a, hints=hints)

    monkeypatch.setattr(gr, "_finish", finish)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(gr, "NATIVE_FINISH", on)
        seen.clear()
        gd, fetches = _graph(name, k2)
        mg, cfg = plugin_only_grappler(gd, fetches)
        cfg.graph_options.rewrite_options.custom_optimizers[0].parameter_map["precision_mode"].s = mode.encode()
        runs[on] = optimize_rewritten(cfg, mg, name.encode())
        if on:
            hinted, found = dict(finishes), [h for h in seen if h is not None]
            finishes.clear()
    assert runs[True][0] == runs[False][0]
    assert _strip_times(runs[True][1]) == _strip_times(runs[False][1])
    assert found and hinted == {"hinted": len(found)}, (hinted, len(found))
    assert finishes == {"reference": len(found)}  # (the switch off: every finish walked in Python)
    if mode.endswith("bf16"):
        assert any(h[2] == 1 for h in found)  # control inputs from outside: C++ checked for cycles


def _direct(gr, variant="plain"):
    """find_grad_region on a TF1 graph (``_tf1_graph``): ``residual`` /
    ``upstream_scale`` its options; ``probe`` first adds a node outside F
    and G reading an inner tensor of F; ``cycle`` a node outside G that
    reads G's first node and that G's last node waits on (the fused node
    would wait on its own reader)."""
    from tensorflow.core.framework import attr_value_pb2

    f32 = {"T": attr_value_pb2.AttrValue(type=1)}
    graph, fwd, inputs, _ = _tf1_graph(**({variant: True} if variant in ("residual", "upstream_scale") else {}))
    if variant == "probe":
        graph.new_node("Identity", "probe", ["ln/Mean"], f32)
    if variant == "cycle":
        check = gr.CHECK_NATIVE
        gr.CHECK_NATIVE = False
        try:
            r = find_grad_region(graph, fwd, ["ln/y"], inputs)
        finally:
            gr.CHECK_NATIVE = check
        graph.new_node("Identity", "late_reader", [r.nodes[0]], f32)
        graph.add_control_input(r.nodes[-1], "late_reader")
    return find_grad_region(graph, fwd, ["ln/y"], inputs)


@pytest.mark.parametrize("fault", ["boundary", "ok1", "cycle", "order"])
def test_the_comparison_catches_a_planted_fault(monkeypatch, fault):
    """With CHECK_NATIVE (the suite's setting), a wrong hint raises and is
    recorded, so the session fails even where a pass swallowed it."""
    gr = _native_lib()
    real = gr._hints

    def wrong(parts, n):
        ok1, ok2, cycle, order, boundary = real(parts, n)
        if fault == "boundary":
            boundary = boundary[1:]
        elif fault == "ok1":
            ok1 = True
        elif fault == "cycle":
            cycle = 1
        else:
            order = order[::-1]
        return ok1, ok2, cycle, order, boundary

    monkeypatch.setattr(gr, "_hints", wrong)
    monkeypatch.setattr(gr, "CHECK_NATIVE", True)
    monkeypatch.setattr(gr, "CHECKED", [0, []])
    # ok1: the reference refuses (a probe reads an inner tensor), the wrong verdict lets it through;
    # cycle: the reference refuses (the region waits on its own reader), the wrong verdict skips the check
    with pytest.raises(AssertionError, match="differs from the reference"):
        _direct(gr, {"ok1": "probe", "cycle": "cycle"}.get(fault, "plain"))
    assert len(gr.CHECKED[1]) == 1
