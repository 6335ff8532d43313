"""Function calls inlined offline the way a Session inlines them.

In a Session (and under ``enable()``) grappler's function optimizer inlines
and lowers every ``PartitionedCall`` / ``StatefulPartitionedCall`` before the
pipeline sees the graph.  A graph rewritten offline has not been through that:
a TF2 SavedModel puts every Keras layer in its own function, and rewriting the
bodies one by one (signatures kept) puts two casts at every layer boundary and
hides the converted ops inside functions.  This module is the one place that
says how the offline entry points (``rewrite_graph``, ``npu-amp rewrite``,
``npu-amp report``) inline first::

    main graph                                main graph (what a Session sees)
      x = Placeholder                           x = Placeholder
      out = StatefulPartitionedCall(x, v)  ->    .../conv/Conv2D, .../bn/FusedBatchNormV3, ...
             f=__inference_serve_12              out = IdentityN(...)   <- same name, same outputs

The rule:

* grappler's own function optimizer runs, every other grappler pass off
  (no constant folding, no remapper: the pipeline decides the rest);
* the graph's own inputs and outputs (``fetches``, ``preserve``, and every
  call whose outputs nothing reads; with neither given, every node nothing
  reads) keep their names, dtypes and output counts, so the graph's
  signature is unchanged;
* a call grappler does not inline (``_noinline``, a function it cannot
  instantiate) stays a call, and its function keeps its signature; the
  pipeline then rewrites its body on its own, as before.

``inline_calls`` returns the graph with the library pruned to what the graph
still calls (what a Session runs).  A TF2 SavedModel is also loaded through
its function library (``tf.saved_model.load`` runs the signature function
named in the object graph, not the main graph), so :func:`inline_bodies`
inlines the calls inside named functions as well, keeping their signatures,
and :func:`merge_library` puts back the functions the object graph still
refers to.
"""
from __future__ import annotations

from tensorflow.core.framework import graph_pb2

from .errors import NpuAmpError

CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


class InlineError(NpuAmpError, ValueError):
    """Grappler's function optimizer refused the graph."""


def _node_of(ref: str) -> str:
    return ref.lstrip("^").split(":")[0]


def has_calls(graph_def) -> bool:
    return any(n.op in CALL_OPS for n in graph_def.node)


def _grappler_function_optimizer(graph_def, keep):
    """Grappler's function optimizer alone on ``graph_def``; ``keep``: node
    names that must survive by name (grappler's entry point through ``_tf``)."""
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2

    from . import _tf

    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    meta.collection_def["train_op"].node_list.value.extend(sorted(keep))
    cfg = config_pb2.ConfigProto()
    ro = cfg.graph_options.rewrite_options
    ro.optimizers.extend(["function"])  # only the function optimizer
    ro.min_graph_nodes = -1
    ro.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    try:
        return _tf.optimize_graph(cfg, meta, graph_id=b"npu_amp_inline")
    except Exception as exc:  # noqa: BLE001 - grappler raises many kinds
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InlineError(f"cannot inline the graph's function calls: {first}") from None


def _unread(graph_def, ops=None) -> set[str]:
    """Nodes (of ``ops``, or any) that no node reads: the graph's own outputs."""
    read = {_node_of(i) for n in graph_def.node for i in n.input[:]}
    return {n.name for n in graph_def.node if (ops is None or n.op in ops) and n.name not in read}


def inline_calls(graph_def, fetches=(), preserve=()):
    """``graph_def`` with its function calls inlined and lowered as a Session
    does (see the module docstring).  ``fetches`` and ``preserve`` name nodes
    (or ``node:k`` tensors) that keep their names.  Returns a new GraphDef
    whose library holds only the functions still called; a graph without
    calls is returned as it is."""
    if isinstance(graph_def, (bytes, bytearray)):
        gd = graph_pb2.GraphDef()
        gd.ParseFromString(bytes(graph_def))
        graph_def = gd
    if not has_calls(graph_def):
        return graph_def
    names = {n.name for n in graph_def.node}
    keep = {_node_of(t) for t in list(fetches) + list(preserve)} & names
    # the graph's outputs: fetched, or (nothing fetched) read by no node
    keep |= _unread(graph_def, CALL_OPS) if keep else _unread(graph_def)
    out = _grappler_function_optimizer(graph_def, keep)
    if _calls(out) == _calls(graph_def):
        return graph_def  # nothing inlinable: the graph as it was (not re-sorted)
    return _drop_dangling_colocation(out)


def _drop_dangling_colocation(graph_def):
    from graph_passes.graph import drop_dangling_colocation

    drop_dangling_colocation(graph_def.node)
    return graph_def


def _calls(graph_def):
    return {(n.name, n.op, n.attr["f"].func.name) for n in graph_def.node if n.op in CALL_OPS}


def inline_bodies(graph_def, fnames):
    """Inline the calls inside each library function in ``fnames`` (a TF2
    SavedModel's signature functions), keeping its signature: the same
    arguments and results, only the body changes.  Functions grappler added
    (specialisations of calls it could not inline) join the library.
    Returns a new GraphDef; the main graph is untouched."""
    from graph_passes.errors import GraphError
    from graph_passes.functions import FunctionGraph, function_graph
    from graph_passes.graph import Graph

    graph = Graph(graph_def)
    for fname in fnames:
        try:
            fg = function_graph(graph, fname)
        except GraphError:
            continue  # polymorphic or unreadable: left as it is
        body = fg.to_graph_def()
        if not has_calls(body):
            continue
        body.library.CopyFrom(graph.library)
        keep = {n.name for n in body.node if n.op in ("_Arg", "_Retval")}
        keep |= set(fg.fdef.control_ret.values()) & {n.name for n in body.node}
        new = _grappler_function_optimizer(body, keep)
        if _calls(new) == _calls(body):
            continue
        for f in new.library.function:
            if f.signature.name not in graph.functions:
                graph.library.function.add().CopyFrom(f)
                graph.functions[f.signature.name] = graph.library.function[-1]
        del new.library.function[:]
        _drop_dangling_colocation(new)
        try:
            graph.set_function(FunctionGraph.with_body(fg.fdef, graph.functions, new))
        except GraphError:
            continue
    return graph.to_graph_def()


def merge_library(graph_def, library):
    """``graph_def`` with every function of ``library`` it lacks added back
    (unreached functions are harmless; a SavedModel's object graph names them)."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    have = {f.signature.name for f in out.library.function}
    for f in library.function:
        if f.signature.name not in have:
            out.library.function.add().CopyFrom(f)
    have_g = {g.function_name for g in out.library.gradient}
    for g in library.gradient:
        if g.function_name not in have_g:
            out.library.gradient.add().CopyFrom(g)
    return out


def called_functions(graph_def, nodes) -> list[str]:
    """Library functions called by the named call nodes of the main graph."""
    want = {_node_of(n) for n in nodes}
    return sorted({n.attr["f"].func.name for n in graph_def.node
                   if n.name in want and n.op in CALL_OPS and n.attr["f"].func.name})
