"""benchmarks/fusion_pass.py (issue 17o): the fusion pass replayed on the graph it got
inside grappler must be the pass grappler ran, or its timings and A/B mean nothing.

One small BERT-like training graph (2 layers, tiny sizes) through grappler with the
plugin alone (the benchmark's config); the replay on a fresh Graph (same bytes, same
C++ index, same shape source) must give the bytes the pass left inside grappler, fuse
every layer norm the builder made (one after the embeddings, two per layer: counted
from tests/real_models.py, not from the pass), and an A/B of a reference switch must
report both paths identical."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

LAYERS = 2


def _import_bench(name):
    """A benchmarks/ module, the environment put back after (they set TF environment variables)."""
    import importlib

    saved = dict(os.environ)
    try:
        return importlib.import_module(name)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def captured():
    fpb = _import_bench("fusion_pass")
    from real_models import bert_training_graph

    from graph_passes.fusion import prefuse

    g, fetches = bert_training_graph(layers=LAYERS, hidden=32, heads=2, seq=8, batch=2, vocab=50, ffn=64)
    # (the pass's own layer-norm fusions, for the breakdown to name a rule that fused: not the
    # ones made before the parse, which the replay reports but does not make)
    saved, prefuse.PREFUSE = prefuse.PREFUSE, False
    try:
        return fpb, fpb.capture("bert", g, fetches)
    finally:
        prefuse.PREFUSE = saved


def test_replay_is_the_pass_grappler_ran(captured):
    fpb, cap = captured
    assert cap.output is not None and cap.nodes > 100
    t, graph, ctx, stats = fpb.run_once(cap)
    assert graph.serialize() == cap.output
    # the builder's layer norms: emb_ln, then attn_ln and out_ln per layer
    assert stats["fused"].get("layer_norm") == 1 + 2 * LAYERS
    assert t > 0


def test_ab_of_a_reference_switch_reports_identity(captured, capsys):
    fpb, cap = captured
    from graph_passes.fusion.fusion_pass import FusionPass

    res = fpb.ab(cap, "graph_passes.fusion.fusion_pass.FusionPass.skip_untouched", 1)
    assert res["identical"] and res["on_s"] > 0 and res["off_s"] > 0
    assert FusionPass.skip_untouched is True  # restored
    assert "identical" in capsys.readouterr().out


def test_ab_of_two_switches_names_what_differs(captured, capsys):
    """``A+B`` flips both switches together; RULE_POLICY changes the report (the BF16-only rules,
    and under this FP16 plan the bias family with its per-anchor kernel warnings, are listed once
    in the fusion stats, not per anchor) but not the graph, and the line says so."""
    fpb, cap = captured
    from graph_passes.fusion import builtin, core

    res = fpb.ab(cap, "graph_passes.fusion.core.RULE_POLICY+graph_passes.fusion.builtin.KERNEL_FIRST", 1)
    assert not res["identical"] and res["differ"] == " (stats, decisions, warnings)", res
    assert core.RULE_POLICY is True and builtin.KERNEL_FIRST is True  # both restored
    assert "DIFFER (stats, decisions, warnings)" in capsys.readouterr().out


def test_breakdown_names_the_rule_that_fused(captured, capsys):
    fpb, cap = captured
    fpb.breakdown(cap, 1)
    out = capsys.readouterr().out
    assert "layer_norm #" in out and "rule runs + checks" in out


def test_replay_runs_with_the_collector_paused(captured, monkeypatch):
    """The pipeline pauses Python's cyclic collector around every pass; the replay must
    too, or it times collections the callback never pays (and restores it after)."""
    import gc

    fpb, cap = captured
    from graph_passes.fusion import fusion_pass as fp

    seen = []
    orig = fp.FusionPass.run

    def run(self, g, ctx):
        seen.append(gc.isenabled())
        return orig(self, g, ctx)

    monkeypatch.setattr(fp.FusionPass, "run", run)
    assert gc.isenabled()
    fpb.run_once(cap)
    assert seen == [False] and gc.isenabled()


def test_paired_ratio_is_the_median_of_each_rounds_ratio():
    """benchmarks/precision.py's paired figures: per round, ours / AMP by the log, and by
    process CPU less that round's 'nothing on' run; the median over rounds, rounds without
    a figure left out.  Expected values worked out by hand below."""
    pb = _import_bench("precision")
    rounds = {
        # a slow spell in round 2 makes every mode slower there: the minima of each side come
        # from different rounds (ours 0.50 - off 0.40 = 0.10, AMP 0.46 - 0.40 = 0.06: 1.67x)
        "cpu": {"off": [0.40, 0.60, 0.42], "amp": [0.46, 0.68, 0.47], "ours": [0.50, 0.66, 0.52]},
        "log": {"amp": [0.060, 0.080, None], "ours": [0.090, 0.060, 0.070]},
    }
    r_log, r_cpu, n_log, n_cpu = pb.paired(rounds)
    # log: rounds 1 and 2 only (round 3 lacks AMP's line): 1.5 and 0.75 -> median 1.125
    assert (n_log, round(r_log, 6)) == (2, 1.125)
    # CPU: (0.10 / 0.06, 0.06 / 0.08, 0.10 / 0.05) = (1.667, 0.75, 2.0) -> median 1.667
    assert n_cpu == 3 and abs(r_cpu - 0.10 / 0.06) < 1e-9
    # a round where the baseline moved above a mode gives no CPU ratio
    r_log, r_cpu, n_log, n_cpu = pb.paired({"cpu": {"off": [0.5], "amp": [0.45], "ours": [0.6]}, "log": {}})
    assert (r_log, r_cpu, n_log, n_cpu) == (None, None, 0, 0)
