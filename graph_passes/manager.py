"""Passes, their context, and the manager that runs them.

A pass is a class registered by name::

    @register_pass("cleanup")
    class Cleanup(Pass):
        '''Pre/postconditions and an ASCII before/after sketch.'''
        def run(self, graph, ctx):      # mutate graph in place
            ...
            return {"removed": 3}       # stats, JSON-serialisable

Rules every pass keeps:

* idempotent: running it twice gives the same graph as running it once
  (grappler calls custom optimizers once per meta-optimizer iteration);
* nodes named in ``ctx.fetches`` / ``ctx.preserve`` keep their names and
  output dtypes (the manager checks this after each pass);
* inserted nodes get deterministic names derived from their source
  (``conv1/Conv2D/CastToFp16``), never random suffixes;
* every decision is recorded with a reason (``ctx.report.decide``).
"""
from __future__ import annotations

import time
from typing import Iterable

from . import registry
from .errors import GraphError, NpuAmpError, PassError
from .graph import Graph, parse_tensor
from .report import Report

PASS_REGISTRY: dict[str, type] = {}


def register_pass(name: str):
    def deco(cls):
        if name in PASS_REGISTRY and PASS_REGISTRY[name] is not cls:
            raise ValueError(f"a pass named '{name}' is already registered ({PASS_REGISTRY[name]})")
        cls.name = name
        PASS_REGISTRY[name] = cls
        return cls
    return deco


class Pass:
    """Base class; subclasses implement :meth:`run`.

    ``keeps_deferred``: the report's deferred figures (:meth:`Report.defer`,
    computed from the graph when read) stay true through this pass: it does
    not change the graph, or resolves them before it does.  Otherwise the
    manager computes them before the pass runs.

    ``tracks_edits``: see below (the OpDef guard's changed-node set)."""

    name = "pass"
    keeps_deferred = False
    #: every node this pass edits in place is edited through ``Graph`` methods
    #: (op types through ``set_op``) or declared with ``graph.touch(name)``
    #: (the OpDef guard then checks only those nodes); False: the manager
    #: marks every node as changed and rebuilds the op-type index after it
    tracks_edits = False

    def run(self, graph: Graph, ctx: "PassContext") -> dict:  # pragma: no cover - abstract
        raise NotImplementedError


class PassContext:
    """What a pass may know besides the graph: options (any object with
    attributes; the engine never imports the public options module), fetched
    and preserved node names, the device list, and the report."""

    def __init__(self, options=None, fetches: Iterable[str] = (), preserve: Iterable[str] = (),
                 devices: Iterable[str] = (), report: Report | None = None):
        self.options = options
        self.fetches = frozenset(parse_tensor(f)[0] for f in fetches)
        self.preserve = frozenset(parse_tensor(p)[0] for p in preserve)
        self.devices = tuple(devices)
        self.report = report if report is not None else Report()
        self.current_pass: str | None = None

    @property
    def protected(self) -> frozenset:
        return self.fetches | self.preserve

    def option(self, name, default=None):
        return getattr(self.options, name, default) if self.options is not None else default

    def warn(self, message, node=None):
        self.report.warn(message, node=node, pass_name=self.current_pass)

    def default_device_type(self) -> str:
        want = self.option("device_type", "auto")
        if want and want != "auto":
            return want
        if any("GPU" in d.upper() for d in self.devices):
            return "GPU"
        return "CPU"


def _interface(graph: Graph, names):
    out = {}
    for n in names:
        node = graph.nodes.get(n)
        if node is not None:
            out[n] = graph.output_dtypes(node)
    return out


class PassManager:
    """Runs registered passes in order, times them and gathers their stats.

    ``validate=True`` validates the graph after every pass and names the pass
    that broke it.  Errors raised inside a pass are re-raised as
    :class:`PassError` naming the pass (and the node, when known).
    """

    def __init__(self, passes: Iterable[str], validate: bool = False):
        self.pass_names = list(passes)
        unknown = [p for p in self.pass_names if p not in PASS_REGISTRY]
        if unknown:
            raise PassError(unknown[0], f"no such pass; registered: {sorted(PASS_REGISTRY)}")
        self.validate = validate

    #: (issue 17) fetch the kernels of every op type in the graph with one
    #: scan of TF's kernel registry before the passes ask about them one op
    #: type at a time (:func:`registry.prefetch_kernels`: the same answers);
    #: False: as they ask (the reference)
    prefetch_kernels = True

    def run(self, graph: Graph, ctx: PassContext) -> Report:
        if self.prefetch_kernels:
            registry.prefetch_kernels(graph.op_types())
        iface = _interface(graph, ctx.protected)
        before_problems = set(graph.validate()) if self.validate else set()
        for name in self.pass_names:
            ctx.current_pass = name
            if ctx.report.pending and not PASS_REGISTRY[name].keeps_deferred:
                ctx.report.resolve()
            repairs = graph.index_repairs
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                stats = PASS_REGISTRY[name]().run(graph, ctx) or {}
            except PassError:
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised with the pass named
                raise PassError(name, f"{type(exc).__name__}: {exc}",
                                node=getattr(exc, "node", None)) from exc
            dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
            if not PASS_REGISTRY[name].tracks_edits and hasattr(graph, "touch_all"):
                graph.touch_all()  # anything may have been edited in place,
                graph.reindex_ops()  # node.op included
            if graph.index_repairs > repairs:
                ctx.warn(f"the graph's consumers index was out of sync {graph.index_repairs - repairs} "
                         "time(s) (node inputs edited without Graph.reindex()); it was rebuilt")
            # time_s: wall; cpu_s: this thread's CPU time (what a shared machine does not inflate)
            ctx.report.passes.append({"name": name, "time_s": round(dt, 6), "cpu_s": round(cpu, 6),
                                      "stats": stats})
            after = _interface(graph, iface)
            for node_name, dts in iface.items():
                if node_name not in graph.nodes:
                    raise PassError(name, "removed a fetched/preserved node", node=node_name)
                if after[node_name] != dts:
                    raise PassError(name, f"changed the output dtypes of a fetched/preserved node "
                                          f"from {dts} to {after[node_name]}", node=node_name)
            if self.validate:
                problems = [p for p in graph.validate() if p not in before_problems]
                if hasattr(graph, "index_problems"):  # node.op / inputs edited behind its back
                    problems += graph.index_problems()
                if problems:
                    raise PassError(name, "left an invalid graph: " + "; ".join(problems[:10]))
        ctx.current_pass = None
        return ctx.report


def run_passes(graph_def, passes: Iterable[str], options=None, fetches=(), preserve=(),
               devices=(), validate: bool = False):
    """Convenience: GraphDef in, (GraphDef, Report) out."""
    graph = Graph(graph_def)
    ctx = PassContext(options, fetches, preserve, devices)
    PassManager(passes, validate=validate).run(graph, ctx)
    return graph.to_graph_def(), ctx.report


__all__ = ["Pass", "PassContext", "PassManager", "register_pass", "PASS_REGISTRY", "run_passes",
           "GraphError", "NpuAmpError"]
