"""The ``fusion`` pass: applies the registered fusion rules up to ``graph_level``.

Preconditions: none (runs before precision and layout, so it sees the
user's dtypes).  Postconditions: no registered rule matches any more (the
pass sweeps until a sweep changes nothing, so it is idempotent); every fused
or skipped match is in the report with the rule name and a reason; emitted
ops have a kernel for their device and dtype.

    level 0: nothing
    level 1: cleanups      x -> Cast(f16->f32) -> Cast(f32->f16)      =>  x -> Identity
    level 2: fusions       MatMul -> BiasAdd -> Relu                   =>  _FusedMatMul[BiasAdd,Relu]
    level 3: aggressive    Conv2D -> FusedBatchNormV3 (inference)      =>  Conv2D(W') -> BiasAdd(b')
"""
from __future__ import annotations

from ..manager import Pass, register_pass
from .cleanups import merge_duplicate_casts
from .core import RULES, ShapeOracle, apply_rule

MAX_SWEEPS = 6


@register_pass("fusion")
class FusionPass(Pass):
    def run(self, graph, ctx):
        level = ctx.option("graph_level", 2) if ctx is not None else 2
        level = 2 if level is None else int(level)
        stats = {"graph_level": level, "fused": {}, "skipped": {}, "casts_merged": 0}
        if level <= 0:
            return stats
        rules = [r for r in RULES.values() if r.graph_level <= level]
        for sweep in range(MAX_SWEEPS):
            changed = 0
            for rule in rules:
                changed += apply_rule(graph, rule, ctx, ShapeOracle(graph), stats)
            # after the chain rules, which need single-consumer casts
            merged = merge_duplicate_casts(graph, ctx)
            stats["casts_merged"] += merged
            changed += merged
            stats["sweeps"] = sweep + 1
            if not changed:
                break
        stats.pop("_skips_seen", None)
        if ctx is not None:
            total = sum(stats["fused"].values())
            ctx.report.summary["fusions"] = ctx.report.summary.get("fusions", 0) + total
        return stats
