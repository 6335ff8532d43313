"""The ``fusion`` pass: applies the registered fusion rules up to ``graph_level``.

Preconditions: none (runs before precision and layout, so it sees the
user's dtypes).  Postconditions: no registered rule matches any more (the
pass sweeps to a fix-point, a sweep that changes nothing, so it is
idempotent); every fused or skipped match is in the report with the rule name
and a reason (or, for a rule its policy turns off in this run, the rule
once in the stats' ``rules_off``); emitted ops have a kernel for their device and dtype.

A rule whose policy (:attr:`FusionRule.policy`) says it cannot apply in
this run (e.g. measured to pay in BF16 only, under an FP16 plan) is not
matched: the stats list it once under ``rules_off`` (``core.RULE_POLICY``;
False matches it and reports a skip per anchor, the reference).

A sweep after the first runs a rule again only if the graph changed since
its last run; a rule that declares what it reads (:attr:`FusionRule.reads`)
only if a change since could reach a node its matching or build reads
(``pattern.affected_anchors``), and then first matches (and builds, without
editing) only at the anchors such a change reaches: when none of them would
fuse or report anything new, the rule is not run (``skip_untouched``; False
runs every rule again, the reference).

When a rule that searches gradient regions (:attr:`FusionRule.searches_gradient`)
has anchor candidates, the pass starts loading the search's C++ mirror of the
graph on a helper thread as it begins (``grad_region.preload``), so that the
load overlaps the rules before the first search.

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

import sys

from ..graph import parse_tensor
from ..manager import Pass, register_pass
from ..pattern import Changes, affected_anchors, anchor_candidates
from .cleanups import merge_duplicate_casts
from .core import (CONST_MEMO_ATTR, RULES, ShapeOracle, Trail, apply_rule, policy_reason, quiet_at,
                   rule_off)
from .builtin import _FUSED_KERNEL_MEMO_ATTR, NORM_MEMO_ATTR
from . import prefuse
from .grad_region import mark_original_names, preload

#: safety bound on sweeps: this many per node of the input graph (a fix-point is
#: normally reached in 2-3 sweeps; each sweep that changes anything shrinks the graph)
MAX_SWEEPS_PER_NODE = 1
MIN_SWEEP_BOUND = 8
_MERGE = object()  # merge_duplicate_casts' key among the idle rules


@register_pass("fusion")
class FusionPass(Pass):
    tracks_edits = True  # every edit through Graph methods (fusion.core)
    #: skip a declaring rule when no change since its last run reaches what it reads
    #: (False: the reference, every rule runs again after any change)
    skip_untouched = True
    #: rule runs on an unchanged graph share one ShapeOracle (False: the
    #: reference, a fresh oracle per rule run; see :meth:`_shapes`)
    share_shapes = True

    def run(self, graph, ctx):
        #: (sweep, rule name) of every rule run skipped by skip_untouched (for tests)
        self.skipped_runs = []
        self._oracle = None
        setattr(graph, CONST_MEMO_ATTR, {})
        try:
            return self._run(graph, ctx)
        finally:
            delattr(graph, CONST_MEMO_ATTR)
            for attr in (NORM_MEMO_ATTR, _FUSED_KERNEL_MEMO_ATTR):  # (builtin's memos: analyze_norm, policies)
                if hasattr(graph, attr):
                    delattr(graph, attr)
            self._oracle = None

    def _shapes(self, graph) -> ShapeOracle:
        """A ``ShapeOracle`` for the graph as it is now: the previous one (and
        its memo of producer-walked shapes) while nothing changed the graph
        since that one was made (``graph.version`` and the edit log: attr
        edits declared with ``touch`` too), else a fresh one.  The reference
        gave every rule run a fresh oracle; on an unchanged graph both answer
        every question the same (``shapes.local_shape`` is a function of the
        graph), only the walks are not repeated (BERT-12: the residual side
        inputs of ``bias_add``, then of ``bias``, each walked down the whole
        forward pass)."""
        if not self.share_shapes:
            return ShapeOracle(graph)
        key = (graph.version, _edit_mark(graph))
        if self._oracle is None or self._oracle[0] != key:
            self._oracle = (key, ShapeOracle(graph))
        return self._oracle[1]

    def _run(self, graph, ctx):
        level = ctx.option("graph_level", 2) if ctx is not None else 2
        level = 2 if level is None else int(level)
        stats = {"graph_level": level, "fused": {}, "skipped": {}, "casts_merged": 0}
        if level <= 0:
            return stats
        rules = [r for r in RULES.values() if r.graph_level <= level]
        # (issue 17) the layer-norm rule's first run made in C++ before the
        # parse (prefuse.py): its fusions reported as the rule's own
        pre = getattr(ctx, "prefused", None) if ctx is not None else None
        prefuse.record(ctx, pre, stats)
        # the gradient-region search names autodiff's ops after forward nodes,
        # some of which earlier fusions remove (grad_region.attributed_forward)
        mark_original_names(graph, pre.removed if pre is not None else ())
        # (issue 17) a run before the parse that reached its last anchor was
        # the rule's whole first run on this graph: run again now it would
        # fuse and report nothing (CHECK_NATIVE checks that of every run), so
        # the rule starts idle, as after a run that changed nothing
        done = prefuse.finished_rules(pre)
        _preload_mirror(graph, rules, ctx, done)
        bound = max(MIN_SWEEP_BOUND, MAX_SWEEPS_PER_NODE * len(graph.nodes))
        # rule -> (graph.version, edit mark, removal mark, no overlap dropped)
        # after a run of it that changed nothing: while no other rule changes
        # the graph, running it again would find the same matches, fuse none and
        # report nothing new (skips are reported once)
        idle: dict = {name: (graph.version, _edit_mark(graph), 0, False) for name in done}
        trail = Trail()
        dirty_cache: dict = {}
        for sweep in range(bound):
            changed = 0
            active = []
            for rule in rules:
                if rule.policy is not None and rule_off(graph, rule, ctx, stats):
                    continue  # (core.RULE_POLICY: reported once in stats["rules_off"])
                rec = idle.get(rule.name)
                if rec is not None:
                    if rec[0] == graph.version:
                        continue
                    if self._untouched(graph, rule, rec, trail, dirty_cache, ctx, stats):
                        self.skipped_runs.append((sweep + 1, rule.name))
                        idle[rule.name] = (graph.version, _edit_mark(graph), len(trail.removed_inputs), True)
                        continue
                v = graph.version
                marks = (_edit_mark(graph), len(trail.removed_inputs))
                n = apply_rule(graph, rule, ctx, self._shapes(graph), stats, trail)
                changed += n
                if n:
                    active.append(rule.name)
                elif graph.version == v:
                    idle[rule.name] = (v, *marks, not trail.dropped)
            # after the chain rules, which need single-consumer casts
            merged = 0
            if idle.get(_MERGE) != graph.version:
                v = graph.version
                merged = merge_duplicate_casts(graph, ctx, trail)
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

    def _untouched(self, graph, rule, rec, trail, cache, ctx, stats) -> bool:
        """Whether running ``rule`` (idle since ``rec``) again would change
        nothing and report nothing new (see the module docstring)."""
        if (not self.skip_untouched or rule.reads is None or not rec[3] or trail.unknown):
            return False
        key = (graph.version, rec[1], rec[2])
        dirty = cache.get(key)
        if dirty is None:
            if len(cache) > 64:
                cache.clear()
            dirty = cache[key] = _dirty_since(graph, trail, rec[1], rec[2])
        if dirty is False:
            return False
        anchors = affected_anchors(graph, rule.pattern, dirty, rule.reads)
        if not anchors:
            return True
        return quiet_at(graph, rule, ctx, self._shapes(graph), stats, sorted(anchors), trail)


def _preload_mirror(graph, rules, ctx, idle=()) -> bool:
    """Start loading the gradient-region search's C++ mirror of the graph
    (``grad_region.preload``) when a rule that searches gradient regions
    (:attr:`FusionRule.searches_gradient`), not turned off by its policy nor
    starting idle (``idle``: names), has anchor candidates: the load then
    overlaps the rules before it."""
    protected = ctx.protected if ctx is not None else frozenset()
    for rule in rules:
        if not rule.searches_gradient or rule.name in idle:
            continue
        if policy_reason(graph, rule, ctx):
            continue
        if anchor_candidates(graph, rule.pattern, protected, rule.escapes):
            return preload(graph)
    return False


def _edit_mark(graph) -> int:
    return graph.edits_since(sys.maxsize)[1]


def _dirty_since(graph, trail, edit_mark, removal_mark):
    """``pattern.Changes`` of the nodes created or edited since the marks, or
    whose readers changed (the producers of their inputs and of removed
    nodes' inputs), or False when the graph cannot say (``Graph.touch_all``)."""
    names, _ = graph.edits_since(edit_mark)
    if names is None:
        return False
    nodes = graph.nodes
    dirty = set()
    for name in set(names):
        node = nodes.get(name)
        if node is None:
            continue
        dirty.add(name)
        for inp in node.input[:]:
            dirty.add(parse_tensor(inp)[0])
    dirty.update(trail.removed_inputs[removal_mark:])
    return Changes(graph, dirty)
