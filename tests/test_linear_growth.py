"""Issue 17 (helper 17k): the pipeline's work grows linearly with the graph.

``benchmarks/precision.py`` once measured 4.02x nodes -> 7.00x time on the
BERT-like graph (12k -> 48k nodes).  Profiled (17k, docs/benchmarks.md
"2026-12-02 (17k)"), every Python function's call count grew with the node
count, and the instructions inside ``NpuAmpOptimizer::Optimize`` (callgrind)
grew 4.1x: the excess was the machine (a single big-graph sample at load
4-6, grappler's own super-linear item build in the subtracted baseline,
per-node memory costs), not a quadratic loop.

This test keeps it so by counting *work*, never time: every Python function
call and every call of a C function from Python (``sys.setprofile``: a
deterministic count) of one offline pipeline run (unfuse, fusion,
precision, cleanup, the OpDef guard, serialisation) on the BERT-like builder
at two sizes.  A loop over every node inside a per-node loop makes some
function's count grow with the square of the node count: caught below, and
the planted fault shows that it would be.  (Quadratic work *inside* one C
call, e.g. ``x in some_list``, is not counted; the callgrind figures cover
it.)
"""
import collections
import sys

import pytest

from npu_amp_tf import pipeline
from npu_amp_tf.options import Options
from real_models import bert_training_graph

#: the whole run's calls may grow this much faster than the node count
TOTAL_SLACK = 1.15
#: one function's calls may grow this much faster (small counts aside: fixed
#: per-run work and per-layer-kind work make small counts uneven)
PER_FUNCTION_SLACK = 1.6
MIN_CALLS = 300


def _graph(layers):
    g, fetches = bert_training_graph(layers=layers, hidden=64, heads=2, seq=8, batch=2, vocab=100,
                                     ffn=128)
    return g.as_graph_def(), fetches


def _calls(gd, fetches, options):
    """{(file, function): calls} of one pipeline run (after a warm-up run:
    imports and lru caches filled)."""
    counts = collections.Counter()

    def prof(frame, event, arg):
        if event == "call":
            code = frame.f_code
            counts[(code.co_filename.rsplit("/", 1)[-1], code.co_name)] += 1
        elif event == "c_call":
            counts[("C", getattr(arg, "__qualname__", repr(arg)))] += 1

    pipeline.optimize(gd, options, fetches=fetches)
    sys.setprofile(prof)
    try:
        pipeline.optimize(gd, options, fetches=fetches)
    finally:
        sys.setprofile(None)
    return counts


def _superlinear(small, big, ratio):
    """The problems: total calls, and each function's calls, that grew faster
    than ``ratio`` (the node-count ratio) allows."""
    problems = []
    total = sum(big.values()) / sum(small.values())
    if total > TOTAL_SLACK * ratio:
        problems.append(f"all calls grew {total:.2f}x for {ratio:.2f}x nodes")
    for key, n in big.items():
        if n < MIN_CALLS:
            continue
        grew = n / max(small.get(key, 0), 1)
        if grew > PER_FUNCTION_SLACK * ratio:
            problems.append(f"{key}: {small.get(key, 0)} -> {n} calls ({grew:.2f}x)")
    return problems


@pytest.fixture(scope="module")
def sizes():
    return _graph(2), _graph(8)


@pytest.mark.parametrize("native", [False, True], ids=["python_paint", "native_paint"])
@pytest.mark.parametrize("mode", ["allow_mix_precision", "allow_mix_precision_bf16"])
def test_pipeline_work_grows_linearly(sizes, mode, native, monkeypatch):
    from graph_passes.precision import amp

    (gd_s, f_s), (gd_b, f_b) = sizes
    ratio = len(gd_b.node) / len(gd_s.node)
    assert ratio > 3  # (2 -> 8 layers: ~1.8k -> ~6.2k nodes)
    # (issue 17l) the painting loops in Python (the reference) or in C++ (the
    # library loaded: the pipeline hands the pass its entry point)
    monkeypatch.setattr(amp.PrecisionPass, "native_paint", native)
    if native:
        from npu_amp_tf import bridge

        bridge.library()
        assert pipeline.native_paint_entry() is not None
    options = Options.from_kwargs(precision_mode=mode)
    small, big = _calls(gd_s, f_s, options), _calls(gd_b, f_b, options)
    # the count sees the passes' work (not only the set-up): per-node functions of each stage
    # (issue 17t: with bulk_apply the native result is applied by _apply_bulk)
    paint = (("native.py", "_apply_bulk" if amp.PrecisionPass.bulk_apply else "_apply") if native
             else ("amp.py", "_decide"))
    for key in (("graph.py", "consumers"), paint, ("amp.py", "_fix_edges")):
        assert small[key] > 0, key
    assert sum(big.values()) > 2.5 * sum(small.values())
    assert _superlinear(small, big, ratio) == []


def test_planted_quadratic_loop_is_caught(sizes, monkeypatch):
    """The same count with a per-node loop over every node planted in the
    precision pass (what a quadratic defect looks like): flagged."""
    from graph_passes.precision import amp

    (gd_s, f_s), (gd_b, f_b) = sizes
    ratio = len(gd_b.node) / len(gd_s.node)
    options = Options.from_kwargs(precision_mode="allow_mix_precision")
    monkeypatch.setattr(amp.PrecisionPass, "native_paint", False)  # (planted in the Python loops)
    orig = amp.PrecisionPass._decide

    def _decide(self, node, info, cur):
        for other in list(self.g.nodes)[:: 8]:  # a scan of the graph per decided node
            self.g.nodes.get(other)
        return orig(self, node, info, cur)

    monkeypatch.setattr(amp.PrecisionPass, "_decide", _decide)
    problems = _superlinear(_calls(gd_s, f_s, options), _calls(gd_b, f_b, options), ratio)
    assert any("dict', 'get'" in p or "dict.get" in p for p in problems), problems
