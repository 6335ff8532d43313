"""The ``fusion`` pass: applies the registered fusion rules up to ``graph_level``.

Preconditions: none (runs before precision and layout, so it sees the
user's dtypes).  Postconditions: no registered rule matches any more (the
pass sweeps to a fix-point, a sweep that changes nothing, so it is
idempotent); every fused or skipped match is in the report with the rule name
and a reason; emitted ops have a kernel for their device and dtype.

Every fusion removes at least one node or merges two Casts, so the sweeps
terminate; the safety bound (``MAX_SWEEPS_PER_NODE`` sweeps per node of the
input graph, at least 8) only guards against a user rule that rewrites a
pattern into itself.  Hitting it leaves a report warning naming the rules
that still changed the graph.

    level 0: nothing
    level 1: cleanups      x -> Cast(f16->f32) -> Cast(f32->f16)      =>  x -> Identity
    level 2: fusions       MatMul -> BiasAdd -> Relu                   =>  _FusedMatMul[BiasAdd,Relu]
    level 3: aggressive    Conv2D -> FusedBatchNormV3 (inference)      =>  Conv2D(W') -> BiasAdd(b')
"""
from __future__ import annotations

from ..manager import Pass, register_pass
from .cleanups import merge_duplicate_casts
from .core import RULES, ShapeOracle, apply_rule
from .grad_region import ORIGINAL_NAMES_ATTR

#: safety bound on sweeps: this many per node of the input graph (a fix-point is
#: normally reached in 2-3 sweeps; each sweep that changes anything shrinks the graph)
MAX_SWEEPS_PER_NODE = 1
MIN_SWEEP_BOUND = 8
_MERGE = object()  # merge_duplicate_casts' key among the idle rules


@register_pass("fusion")
class FusionPass(Pass):
    tracks_edits = True  # every edit through Graph methods (fusion.core)
    def run(self, graph, ctx):
        level = ctx.option("graph_level", 2) if ctx is not None else 2
        level = 2 if level is None else int(level)
        stats = {"graph_level": level, "fused": {}, "skipped": {}, "casts_merged": 0}
        if level <= 0:
            return stats
        rules = [r for r in RULES.values() if r.graph_level <= level]
        # the gradient-region search names autodiff's ops after forward nodes,
        # some of which earlier fusions remove (grad_region.attributed_forward)
        setattr(graph, ORIGINAL_NAMES_ATTR, frozenset(graph.nodes))
        bound = max(MIN_SWEEP_BOUND, MAX_SWEEPS_PER_NODE * len(graph.nodes))
        # rule -> graph.version after a run of it that changed nothing: while no
        # other rule changes the graph, running it again would find the same
        # matches, fuse none and report nothing new (skips are reported once)
        idle: dict = {}
        for sweep in range(bound):
            changed = 0
            active = []
            for rule in rules:
                if idle.get(rule.name) == graph.version:
                    continue
                v = graph.version
                n = apply_rule(graph, rule, ctx, ShapeOracle(graph), stats)
                changed += n
                if n:
                    active.append(rule.name)
                elif graph.version == v:
                    idle[rule.name] = v
            # after the chain rules, which need single-consumer casts
            merged = 0
            if idle.get(_MERGE) != graph.version:
                v = graph.version
                merged = merge_duplicate_casts(graph, ctx)
                if not merged and graph.version == v:
                    idle[_MERGE] = v
            stats["casts_merged"] += merged
            changed += merged
            stats["sweeps"] = sweep + 1
            if not changed:
                break
        else:
            if ctx is not None:
                ctx.warn(f"fusion: no fix-point after {bound} sweeps (safety bound); rules still "
                         f"changing the graph: {active or ['merge_duplicate_casts']}. A rule probably "
                         f"rewrites its own pattern into itself.")
            stats["fixpoint"] = False
        stats.pop("_skips_seen", None)
        if ctx is not None:
            total = sum(stats["fused"].values())
            ctx.report.summary["fusions"] = ctx.report.summary.get("fusions", 0) + total
        return stats
