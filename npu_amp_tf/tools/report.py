"""The precision map: a per-op table, totals, warnings, and an HTML page.

:func:`format_report` prints, for every node with a precision decision, its
op type, dtype, list, reason and FLOPs; then the totals (low-precision FLOP
share, Cast and TransData counts, estimated activation memory) and the
warnings.

:func:`write_html` writes one self-contained page (no network access) that
draws the model, not the plumbing (:func:`build_view` decides what is drawn):
the nodes on the paths computing the outputs, function bodies where they are
called, name scopes as collapsible boxes coloured by the dtype mix of their
FLOPs, casts as marks on edges, and a per-layer table.  The layout is dagre
(MIT), shipped in ``npu_amp_tf/_assets`` and inlined into the page together
with ``_assets/precision_map.html`` (the page's CSS and script).
"""
from __future__ import annotations

import html
import os
import re
import json

from .model_io import ToolError

COLORS = {
    "float16": "#f28e2b",   # orange
    "bfloat16": "#b07aa1",  # purple
    "float32": "#4e79a7",   # blue
    "cast": "#e15759",      # red
    "transdata": "#edc948",  # yellow
    "other": "#bab0ac",     # grey (non-float or undecided)
}
LEGEND = (("float16", "FP16"), ("bfloat16", "BF16"), ("float32", "FP32"),
          ("cast", "inserted Cast"), ("transdata", "TransData"), ("other", "non-float / no decision"))

_DTYPE_NAMES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                "bf16": "bfloat16", "DT_HALF": "float16", "DT_FLOAT": "float32",
                "DT_BFLOAT16": "bfloat16"}


def _dtype_name(d) -> str | None:
    if d is None:
        return None
    if isinstance(d, int):
        from graph_passes import registry
        return registry.dtype_name(d)
    d = str(d)
    return _DTYPE_NAMES.get(d, d)


def load_report(path: str):
    """Read a report JSON written by ``npu-amp rewrite`` / ``report_path``."""
    from graph_passes.report import Report

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ToolError(f"report file '{path}' does not exist") from None
    except (OSError, ValueError) as exc:
        raise ToolError(f"report file '{path}' is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "decisions" not in data:
        raise ToolError(f"'{path}' is not an npu-amp report (no 'decisions' key)")
    return Report.from_json(data)


def flops_by_node(graph_def) -> dict:
    """Matrix/conv FLOPs per node from static shapes (the precision pass's
    own counting rules); {} when shapes cannot be inferred."""
    try:
        from graph_passes.graph import Graph
        from graph_passes.precision import stats
    except ImportError:
        return {}
    g = Graph(graph_def)
    try:
        shapes = stats.ShapeTable(g)
    except Exception:  # noqa: BLE001 - shapes are a nicety here
        return {}
    out = {}
    for name, node in g.nodes.items():
        if node.op in stats.MATRIX_OPS:
            try:
                f = stats.matmul_flops(node, shapes)
            except Exception:  # noqa: BLE001
                f = None
            if f is not None:
                out[name] = f
    return out


def rows(report, graph_def=None) -> list[dict]:
    """One row per decided node: node, op, dtype, list, reason, flops."""
    ops = {n.name: n.op for n in graph_def.node} if graph_def is not None else {}
    flops = flops_by_node(graph_def) if graph_def is not None else {}
    out = []
    for node, dec in report.decisions.items():
        out.append({
            "node": node,
            "op": dec.get("op") or ops.get(node, ""),
            "dtype": _dtype_name(dec.get("dtype")) or "",
            "list": dec.get("list") or "",
            "reason": dec.get("reason") or "",
            "flops": dec.get("flops", flops.get(node)),
        })
    return out


def totals(report) -> dict:
    s = dict(report.summary)
    # function bodies (TF2 SavedModels, tf.function) are summed under functions_*
    if s.get("functions_matrix_flops"):
        lp = (s.get("lp_flops") or 0) + s.get("functions_lp_flops", 0)
        mx = (s.get("matrix_flops") or 0) + s["functions_matrix_flops"]
        s["lp_flop_share"] = lp / mx if mx else None
        for k in ("low_precision_nodes", "float_nodes", "casts_inserted",
                  "activation_bytes_before", "activation_bytes_after"):
            if f"functions_{k}" in s:
                s[k] = (s.get(k) or 0) + s[f"functions_{k}"]
    get = s.get
    out = {
        "lp_flop_share": get("lp_flop_share"),
        "low_precision_nodes": get("low_precision_nodes", get("lp_nodes")),
        "float_nodes": get("float_nodes"),
        "casts_inserted": get("casts_inserted"),
        "casts": get("casts"),
        "transdata": get("transdata"),
        "activation_bytes_before": get("activation_bytes_before"),
        "activation_bytes_after": get("activation_bytes_after"),
        "nodes": get("nodes"),
    }
    return out


def _fmt_bytes(b):
    if b is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024.0
    return str(b)


def _fmt_flops(f):
    if f is None or f == "":
        return "-"
    f = float(f)
    for unit, k in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if f >= k:
            return f"{f / k:.2f}{unit}"
    return f"{int(f)}"


def totals_lines(report) -> list[str]:
    t = totals(report)
    share = t["lp_flop_share"]
    lines = ["totals:"]
    lines.append("  low-precision FLOP share:   " + (f"{share * 100:.1f}% (matrix/conv FLOPs; aim > 70%)"
                                                     if isinstance(share, (int, float)) else "n/a"))
    if t["low_precision_nodes"] is not None:
        lines.append(f"  low-precision nodes:        {t['low_precision_nodes']} of {t['float_nodes']} float nodes")
    lines.append(f"  casts inserted:             {_n(t['casts_inserted'])} (Cast nodes in graph: {_n(t['casts'])})")
    lines.append(f"  TransData:                  {_n(t['transdata'])}")
    lines.append(f"  activation memory (est.):   {_fmt_bytes(t['activation_bytes_before'])} -> "
                 f"{_fmt_bytes(t['activation_bytes_after'])}")
    return lines


def _n(v):
    return "n/a" if v is None else str(v)


def format_report(report, graph_def=None, limit: int | None = None, only_lists=None) -> str:
    """The table (optionally only rows whose list is in ``only_lists``),
    the totals and the warnings."""
    rs = rows(report, graph_def)
    if only_lists:
        rs = [r for r in rs if r["list"] in only_lists]
    rs.sort(key=lambda r: (r["dtype"] != "float16" and r["dtype"] != "bfloat16", r["node"]))
    head = ("node", "op", "dtype", "list", "flops", "reason")
    body = [[r["node"], r["op"], r["dtype"], r["list"], _fmt_flops(r["flops"]), r["reason"]]
            for r in (rs if limit is None else rs[:limit])]
    widths = [min(max([len(h)] + [len(b[i]) for b in body]), 56) for i, h in enumerate(head[:-1])]
    lines = ["precision map:", "  " + "  ".join(h.ljust(w) for h, w in zip(head[:-1], widths)) + "  reason"]
    for b in body:
        cells = [(c if len(c) <= w else "…" + c[-(w - 1):]).ljust(w) for c, w in zip(b[:-1], widths)]
        lines.append("  " + "  ".join(cells) + "  " + b[-1])
    if limit is not None and len(rs) > limit:
        lines.append(f"  ... {len(rs) - limit} more (use --all)")
    if not rs:
        lines.append("  (no precision decisions recorded)")
    lines += totals_lines(report)
    lines.append(f"warnings ({len(report.warnings)}):")
    for w in report.warnings:
        where = f" [{w.get('node')}]" if w.get("node") else ""
        lines.append(f"  - {w.get('message')}{where}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------
def _node_class(node, dec) -> str:
    if node.op == "TransData":
        return "transdata"
    if node.op == "Cast" and ("/CastTo" in node.name or dec is None):
        return "cast"
    d = _dtype_name(dec.get("dtype")) if dec else None
    if d in ("float16", "bfloat16", "float32"):
        return d
    from graph_passes import registry

    dts = registry.output_dtypes(node) or []
    names = {registry.dtype_name(x) for x in dts}
    for cand in ("float16", "bfloat16"):
        if cand in names:
            return cand
    if "float32" in names and dec is not None:
        return "float32"
    return "float32" if "float32" in names else "other"


# Ops whose nodes are bookkeeping around the model: hidden behind the page's
# "plumbing" toggle together with everything that only feeds them.
_PLUMBING_OPS = frozenset({
    "VarIsInitializedOp", "IsVariableInitialized", "SaveV2", "Save", "SaveSlices", "RestoreV2",
    "Restore", "RestoreSlice", "MergeV2Checkpoints", "ShardedFilename", "StringJoin",
    "MergeSummary", "ScalarSummary", "HistogramSummary", "ImageSummary", "AudioSummary",
    "AudioSummaryV2", "TensorSummary", "TensorSummaryV2", "WriteScalarSummary",
    "WriteHistogramSummary", "WriteImageSummary", "WriteSummary", "FlushSummaryWriter",
    "SummaryWriter", "CreateSummaryFileWriter", "CloseSummaryWriter",
})
_STORAGE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable", "TemporaryVariable"})
_PLUMBING_PREFIXES = ("save/", "save_", "init", "report_uninitialized", "saver_filename",
                      "summaries/", "Merge/MergeSummary")
# ops that call library functions: attr names holding the functions; inputs
# of If/Case start with the branch selector
_SELECTOR_OPS = frozenset({"If", "StatelessIf", "Case", "StatelessCase"})
_CALL_MAX_DEPTH = 8
_CLASSES = ("float16", "bfloat16", "float32", "cast", "transdata", "other")
_GRAD_RE = re.compile(r"^(gradients(_\d+)?|gradient_tape)$")
_SERIES_RE = re.compile(r"_\d+$")
_SERIES_MIN = 5


def _func_attrs(node, library):
    """[(attr name, function name)] of the functions ``node`` runs."""
    if node.op in library:
        return [("", node.op)]
    out = []
    for key in sorted(node.attr):
        v = node.attr[key]
        if v.HasField("func") and v.func.name in library:
            out.append((key, v.func.name))
        elif v.HasField("list") and v.list.func:
            out += [(f"{key}_{i}", f.name) for i, f in enumerate(v.list.func[:]) if f.name in library]
    return out


class _Ctx:
    """One graph to draw: the main graph or one inlined function body."""

    def __init__(self, graph, prefix, fname, shapes, call=None, act=None):
        self.graph, self.prefix, self.fname, self.shapes = graph, prefix, fname, shapes
        self.call = call  # full name of the calling node (None: the main graph)
        self.act = act
        if act is not None:
            return
        self.act = {}
        try:
            from graph_passes.precision import stats
            stats.activation_bytes(graph, shapes, per_node=self.act)
        except Exception:  # noqa: BLE001 - bytes are a nicety
            pass


def build_view(report, graph_def, fetches=(), signature=None, meta_graph=None):
    """The data the HTML page draws: leaves (ops), name-scope groups with
    their dtype mix, edges (Casts folded into marks on the edges they sit
    on), the per-layer table.  Function bodies are drawn where they are
    called (nodes ``<call>/<body node>``).  Nodes off the paths that compute
    the fetches (initialisers, saver, summaries, ``VarIsInitialized``) are
    flagged ``hidden``; the page shows them behind a toggle."""
    from graph_passes.errors import GraphError
    from graph_passes.functions import function_graph
    from graph_passes.graph import Graph, parse_tensor
    from graph_passes.precision import stats

    main = Graph(graph_def)
    library = main.functions
    fshapes = {}
    leaves = {}       # full name -> dict
    order = []
    out_map = {}      # (call full, port) -> [full names of _Retval nodes]
    in_map = {}       # (call full, data input index) -> [full names of _Arg nodes]
    inlined = set()
    ctxs = []

    def fctx(fname, prefix, call):
        if fname not in fshapes:
            try:
                fg = function_graph(main, fname)
            except GraphError:  # a body we cannot read is drawn as its call
                fshapes[fname] = None
                return None
            first = _Ctx(fg, prefix, fname, stats.ShapeTable(fg), call=call)
            fshapes[fname] = (fg, first.shapes, first.act)
            return first
        got = fshapes[fname]
        return None if got is None else _Ctx(got[0], prefix, fname, got[1], call=call, act=got[2])

    def add(ctx, depth, stack):
        ctxs.append(ctx)
        for name, node in ctx.graph.nodes.items():
            full = ctx.prefix + name
            calls = _func_attrs(node, library) if depth < _CALL_MAX_DEPTH else []
            calls = [(a, f) for a, f in calls if f not in stack]
            bodies = []
            for attr, fname in calls:
                sub = fctx(fname, f"{full}/{attr}/" if len(calls) > 1 else f"{full}/", full)
                if sub is not None:
                    bodies.append((attr, fname, sub))
            if bodies:
                inlined.add(full)
                off = 1 if node.op in _SELECTOR_OPS else 0
                n_data = sum(1 for i in node.input[:] if not i.startswith("^"))
                for attr, fname, sub in bodies:
                    add(sub, depth + 1, stack | {fname})
                    for bn, bnode in sub.graph.nodes.items():
                        idx = bnode.attr["index"].i if "index" in bnode.attr else 0
                        if bnode.op == "_Arg" and idx + off < n_data:
                            in_map.setdefault((full, idx + off), []).append(sub.prefix + bn)
                        elif bnode.op == "_Retval" and attr != "cond":
                            out_map.setdefault((full, idx), []).append(sub.prefix + bn)
                leaves[full] = {"call": [f for _, f, _ in bodies], "node": node}
                continue
            key = name if ctx.fname is None else f"{ctx.fname}/{name}"
            dec = report.decisions.get(key)
            flops = None
            if node.op in stats.MATRIX_OPS:
                try:
                    flops = stats.matmul_flops(node, ctx.shapes)
                except Exception:  # noqa: BLE001
                    flops = None
                if flops is None and dec and dec.get("flops"):
                    flops = dec["flops"]
            leaves[full] = {"node": node, "dec": dec, "cls": _node_class(node, dec), "flops": flops,
                            "bytes": ctx.act.get(name, 0), "ctx": ctx}
            order.append(full)

    add(_Ctx(main, "", None, stats.ShapeTable(main)), 0, frozenset())

    # ---- edges between drawn leaves (calls resolved to their bodies)
    def sources(full, port, ctrl):
        if full not in inlined:
            return [full] if full in leaves else []
        if ctrl:
            return [r for (c, _), rs in out_map.items() if c == full for r in rs]
        return out_map.get((full, port), [])

    raw = []  # (src, dst, ctrl)
    for ctx in ctxs:
        for name, node in ctx.graph.nodes.items():
            full = ctx.prefix + name
            k = 0
            for ref in node.input[:]:
                src, port, ctrl = parse_tensor(ref)
                srcs = sources(ctx.prefix + src, port, ctrl)
                if full in inlined:
                    dsts = [] if ctrl else in_map.get((full, k), [])
                else:
                    dsts = [full]
                if not ctrl:
                    k += 1
                for s in srcs:
                    for d in dsts:
                        raw.append((s, d, ctrl))

    # ---- which leaves are plumbing: off the paths computing the fetches
    names = [n for n in order]
    preds = {n: [] for n in names}
    succs = {n: [] for n in names}
    for s, d, _ in raw:
        preds[d].append(s)
        succs[s].append(d)
    top = [n for n in names if leaves[n]["ctx"].fname is None]
    seed = {n for n in top if leaves[n]["node"].op in _PLUMBING_OPS or n.startswith(_PLUMBING_PREFIXES)
            or leaves[n]["node"].op.endswith("Summary")}
    plumbing = set(seed)
    # a node is plumbing when everything that reads it is (initial values, Assigns of initialisers)
    readers = {n: set(succs[n]) for n in names}
    left = {n: len(r) for n, r in readers.items()}
    stack = list(plumbing)
    while stack:
        n = stack.pop()
        for p in set(preds[n]):
            if p in plumbing:
                continue
            left[p] -= 1
            if left[p] == 0:
                plumbing.add(p)
                stack.append(p)
    roots = set()
    for f in fetches or ():
        roots.update(sources(f, 0, True) if f in inlined else [f] if f in leaves else [])
    if meta_graph is not None and "train_op" in meta_graph.collection_def:
        for s in meta_graph.collection_def["train_op"].node_list.value:
            roots.add(s.split(":")[0].lstrip("^"))
    if not signature:
        roots.update(n for n in top if not succs[n] and n not in plumbing)
    roots = {r for r in roots if r in leaves and r not in plumbing}
    live = set()

    def reach(stack):  # add every node the stack's nodes depend on to live
        while stack:
            n = stack.pop()
            if n in live:
                continue
            live.add(n)
            stack.extend(preds[n])

    reach(list(roots))
    # a function body that runs also runs its side effects (variable updates, asserts)
    by_ctx = {}
    for n in names:
        by_ctx.setdefault(id(leaves[n]["ctx"]), []).append(n)
    while True:
        # ... and a call that runs runs all of its bodies (a While's cond, an If's other branch)
        running = {leaves[grp[0]]["ctx"].call for grp in by_ctx.values()
                   if leaves[grp[0]]["ctx"].fname is not None and any(x in live for x in grp)}
        more = [n for grp in by_ctx.values() if leaves[grp[0]]["ctx"].fname is not None
                and leaves[grp[0]]["ctx"].call in running for n in grp if not succs[n] and n not in live]
        if not more:
            break
        reach(more)
    if not live:  # nothing recognisable as an output: show everything but the plumbing
        live = set(names) - plumbing
    # variable storage (the handles the reads and updates use) is bookkeeping
    # where it sits apart from its layer: a SavedModel whose layer functions were
    # inlined keeps its handles in scopes of their own, one box per variable
    # spread across the top of the page.  Handles inside a layer's scope stay.
    storage = {n for n in live if leaves[n]["node"].op in _STORAGE_OPS}
    if storage:
        scopes = set()
        for n in live - storage:
            parts = n.split("/")
            scopes.update("/".join(parts[:i]) for i in range(1, len(parts)))
        live -= {n for n in storage if "/" not in n or n.rsplit("/", 1)[0] not in scopes}

    # ---- fold Casts into marks on edges
    def is_cast(n):
        node = leaves[n]["node"]
        return node.op == "Cast" and len([p for p in preds[n]]) == 1 and succs[n]

    casts = {n for n in names if is_cast(n)}
    edges = []
    seen = set()

    def cast_src(n, trail):
        while n in casts:
            trail.append(n)
            n = preds[n][0]
        return n

    for s, d, ctrl in raw:
        if d in casts:
            continue
        trail = []
        s0 = cast_src(s, trail)
        key = (s0, d, ctrl, tuple(trail))
        if key in seen:
            continue
        seen.add(key)
        edges.append((s0, d, ctrl, trail))

    # ---- groups by name scope
    gid = {"": 0}
    gpath = [""]
    gparent = [-1]
    gfn = [""]

    def group(path):
        i = gid.get(path)
        if i is not None:
            return i
        parent = group(path.rsplit("/", 1)[0] if "/" in path else "")
        i = len(gpath)
        gid[path] = i
        gpath.append(path)
        gparent.append(parent)
        gfn.append("")
        return i

    for full, leaf in leaves.items():
        if "call" in leaf:
            group(full)
            gfn[gid[full]] = ", ".join(leaf["call"]) + f" (called by {leaf['node'].op})"
    drawn = [n for n in names if n not in casts]
    scope = {n: n.rsplit("/", 1)[0] if "/" in n else "" for n in drawn}
    # variables a SavedModel's graph only hands to function calls: one box
    for n in drawn:
        readers = [c for c in succs[n] if c in live] if n in live else succs[n]
        if leaves[n]["ctx"].fname is None and leaves[n]["node"].op in ("VarHandleOp", "VariableV2") \
                and readers and all(leaves[c]["node"].op == "_Arg" for c in readers):
            scope[n] = "(captured variables)"
    # gradient sums TF names at the top of gradients/ (gradients/AddN_7) go to the
    # scope of what they sum, so the backward pass chains like the forward one
    for n in drawn:
        sc = scope[n]
        if not _GRAD_RE.match(sc.rsplit("/", 1)[-1]):
            continue
        srcs = [scope[p] for p in preds[n] if p in scope and p in live and scope[p].startswith(sc + "/")]
        if len(srcs) < 2:
            continue
        common = srcs[0].split("/")
        for other in srcs[1:]:
            parts = other.split("/")
            k = 0
            while k < min(len(common), len(parts)) and common[k] == parts[k]:
                k += 1
            common = common[:k]
        if len(common) > len(sc.split("/")):
            scope[n] = "/".join(common)
    # a function body's arguments and results: one box each
    by_fn = {}
    for n in drawn:
        ctx = leaves[n]["ctx"]
        if ctx.fname is not None and leaves[n]["node"].op in ("_Arg", "_Retval"):
            by_fn.setdefault((ctx.prefix, leaves[n]["node"].op), []).append(n)
    for (prefix, op), members in by_fn.items():
        if len(members) >= _SERIES_MIN:
            for n in members:
                scope[n] = prefix + ("(arguments)" if op == "_Arg" else "(results)")
    # a series of like leaves in one scope (AddN, AddN_1, ... ; a function's _Args) is one box
    series = {}
    for n in drawn:
        base = _SERIES_RE.sub("", n[len(scope[n]) + 1:] if scope[n] and n.startswith(scope[n] + "/") else n)
        series.setdefault((scope[n], base, leaves[n]["node"].op), []).append(n)
    for (sc, base, op), members in series.items():
        if len(members) >= _SERIES_MIN:
            for n in members:
                scope[n] = (sc + "/" if sc else "") + f"{base}[{len(members)}]"
    leaf_parent = {}
    for n in drawn:
        leaf_parent[n] = group(scope[n])
    ng = len(gpath)
    cls_ix = {c: i for i, c in enumerate(_CLASSES)}
    # per group: FLOPs by class, node count by class, visible leaves, all leaves
    gflops = [[0.0] * 3 for _ in range(ng)]
    gcount = [[0] * len(_CLASSES) for _ in range(ng)]
    gvis = [0] * ng
    gall = [0] * ng
    leaf_rows = []
    leaf_ix = {}
    decs = []
    for n in drawn:
        leaf = leaves[n]
        hidden = n not in live
        c = cls_ix[leaf["cls"]]
        f = leaf["flops"] or 0
        g = leaf_parent[n]
        while g >= 0:
            if not hidden:
                gvis[g] += 1
                gcount[g][c] += 1
                if f and c < 3:
                    gflops[g][c] += f
            gall[g] += 1
            g = gparent[g]
        d = -1
        if leaf["dec"]:
            d = len(decs)
            decs.append({k: v for k, v in leaf["dec"].items() if isinstance(v, (str, int, float, bool))})
        leaf_ix[n] = ng + len(leaf_rows)
        leaf_rows.append([n, leaf["node"].op, c, leaf_parent[n], f, leaf["bytes"], int(hidden), d])

    def chain(item):
        out = [item]
        g = leaf_rows[item - ng][3]
        while g >= 0:
            out.append(g)
            g = gparent[g]
        return out

    edge_rows = []
    cast_rows = []
    for s, d, ctrl, trail in edges:
        if s not in leaf_ix or d not in leaf_ix:
            continue
        a, b = chain(leaf_ix[s]), chain(leaf_ix[d])
        bset = {x: i for i, x in enumerate(b)}
        for i, x in enumerate(a):
            if x in bset and x < ng:
                lca, sa, da = x, a[i - 1], b[bset[x] - 1]
                break
        else:
            continue
        cb, label = 0, 0
        if trail:
            cb = leaves[trail[0]]["bytes"]
            node = leaves[trail[-1]]["node"]
            src_t = node.attr["SrcT"].type if "SrcT" in node.attr else 0
            dst_t = leaves[trail[0]]["node"].attr["DstT"].type if "DstT" in leaves[trail[0]]["node"].attr else 0
            label = f"{_short_dt(src_t)}→{_short_dt(dst_t)}"
            if not cb:
                cb = _cast_bytes(leaves[trail[0]])
            cast_rows.append([trail[0], len(edge_rows)])
        hidden = int(s not in live or d not in live)
        edge_rows.append([lca, sa, da, int(ctrl), cb, label, hidden, leaf_ix[s], leaf_ix[d]])

    layers = _layer_rows(leaf_rows, edge_rows, gpath, gparent, gid, ng)
    return {
        "classes": list(_CLASSES),
        "colors": [COLORS[c] for c in _CLASSES],
        "G": [[gpath[i], gparent[i], gfn[i], gflops[i], gcount[i], gvis[i], gall[i]] for i in range(ng)],
        "N": leaf_rows, "E": edge_rows, "D": decs, "C": cast_rows, "L": layers,
    }


def _short_dt(t):
    if not t:
        return "?"
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}.get(
        _dtype_name(int(t)), _dtype_name(int(t)))


def _cast_bytes(leaf):
    from graph_passes import registry
    from graph_passes.precision import stats

    node = leaf["node"]
    try:
        shape = leaf["ctx"].shapes.get(node.name)
    except Exception:  # noqa: BLE001
        shape = None
    if shape is None:
        return 0
    b = stats._BYTES.get(registry.base_dtype(node.attr["DstT"].type), 4)
    return b * stats._prod(shape)


def _layer_key(path):
    parts = [p for p in path.split("/") if p]
    while parts and _GRAD_RE.match(parts[0]):
        parts = parts[1:]
    grad = len(parts) != len([p for p in path.split("/") if p])
    if parts and parts[-1].endswith("_grad"):
        parts = parts[:-1]
    return "/".join(parts), grad


def _layer_rows(leaf_rows, edge_rows, gpath, gparent, gid, ng):
    """One row per layer (the scope of a matrix/conv op; gradient ops count
    for the forward layer they differentiate): layer, forward FLOPs, backward
    FLOPs, dtype, casts in/out (count, bytes), activation bytes, group item."""
    from graph_passes.precision import stats

    rows = {}
    for leaf in leaf_rows:
        name, op, c, parent, f, _, hidden, _ = leaf
        if hidden or op not in stats.MATRIX_OPS:
            continue
        key, grad = _layer_key(name.rsplit("/", 1)[0] if "/" in name else "")
        if not key:
            continue
        r = rows.setdefault(key, {"fwd": 0, "bwd": 0, "by": [0, 0, 0, 0, 0, 0], "ops": 0,
                                  "cin": 0, "cinb": 0, "cout": 0, "coutb": 0, "act": 0,
                                  "item": gid.get(key, parent)})
        r["bwd" if grad else "fwd"] += f or 0
        r["by"][c] += f or 1
        r["ops"] += 1
    if not rows:
        return []
    layer_of = {}

    def layer(g):
        if g in layer_of:
            return layer_of[g]
        p = gpath[g]
        out = p if p in rows else (layer(gparent[g]) if gparent[g] >= 0 else None)
        layer_of[g] = out
        return out

    for leaf in leaf_rows:
        if not leaf[6]:
            lay = layer(leaf[3])
            if lay:
                rows[lay]["act"] += leaf[5] or 0
    for e in edge_rows:
        if not e[5] or e[6]:
            continue
        ls, ld = layer(leaf_rows[e[7] - ng][3]), layer(leaf_rows[e[8] - ng][3])
        if ld:
            rows[ld]["cin"] += 1
            rows[ld]["cinb"] += e[4]
        elif ls:
            rows[ls]["cout"] += 1
            rows[ls]["coutb"] += e[4]
    out = []
    for key, r in rows.items():
        by = r["by"]
        tot = sum(by[:3]) or 1
        main = max(range(3), key=lambda i: by[i])
        dtype = _CLASSES[main] if by[main] == tot else \
            "mixed " + ", ".join(f"{_CLASSES[i]} {by[i] / tot:.0%}" for i in range(3) if by[i])
        out.append([key, r["fwd"], r["bwd"], dtype, r["cin"], r["cinb"], r["cout"], r["coutb"],
                    r["act"], r["item"]])
    out.sort(key=lambda r: -(r[1] + r[2]))
    return out


def _asset(name):
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_assets", name)
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        raise ToolError(f"the packaged asset '{path}' is missing; reinstall npu-amp-tf") from None


def write_html(report, graph_def, path: str, title: str = "npu-amp precision map", model=None,
               fetches=None):
    """Write the self-contained HTML page to ``path`` (any graph size: past a
    few hundred boxes the page opens with the name scopes collapsed).

    ``model`` (a :class:`model_io.Model`) or ``fetches`` name the outputs;
    only the nodes on the paths computing them are shown by default.
    Returns the number of drawn nodes per precision class."""
    if graph_def is None:
        raise ToolError("the HTML page needs the graph: pass a model, not only a report JSON")
    signature = meta_graph = None
    if model is not None:
        fetches = list(fetches or ()) + list(model.fetch_nodes)
        signature, meta_graph = model.signature, model.meta_graph
    view = build_view(report, graph_def, fetches=fetches or (), signature=signature, meta_graph=meta_graph)
    counts = {k: 0 for k in COLORS}
    for row in view["N"]:
        if not row[6]:
            counts[_CLASSES[row[2]]] += 1
    counts["cast"] += sum(1 for e in view["E"] if e[5] and not e[6])
    legend = "".join(
        f'<span class="lg"><i style="background:{COLORS[k]}"></i>{html.escape(v)} ({counts[k]})</span>'
        for k, v in LEGEND)
    tot = "".join(f"<li>{html.escape(line.strip())}</li>" for line in totals_lines(report)[1:])
    warns = "".join(f"<li>{html.escape(str(w.get('message')))}"
                    f"{(' <code>' + html.escape(str(w.get('node'))) + '</code>') if w.get('node') else ''}</li>"
                    for w in report.warnings) or "<li>none</li>"
    data = json.dumps(view, default=str, separators=(",", ":")).replace("</", "<\\/")
    dagre = _asset("dagre.min.js").replace("</script", "<\\/script")
    page = (_load_template().replace("%TITLE%", html.escape(title)).replace("%LEGEND%", legend)
            .replace("%TOTALS%", tot).replace("%WARNINGS%", warns)
            .replace("%NWARN%", str(len(report.warnings))))
    page = page.replace("%DAGRE%", dagre).replace("%DATA%", data)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
    return counts


_TEMPLATE_PATH = "precision_map.html"


def _load_template():
    return _asset(_TEMPLATE_PATH)

