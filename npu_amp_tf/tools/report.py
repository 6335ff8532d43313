"""The precision map: a per-op table, totals, warnings, and an HTML page.

:func:`format_report` prints, for every node with a precision decision, its
op type, dtype, list, reason and FLOPs; then the totals (low-precision FLOP
share, Cast and TransData counts, estimated activation memory) and the
warnings.

:func:`write_html` writes one self-contained page (inline SVG, CSS and a few
lines of JS; no network access) that draws the rewritten graph with each
node coloured by its precision, a legend, the totals and the warnings.
Hovering a node shows its decision; the search box highlights nodes; the
mouse wheel zooms.
"""
from __future__ import annotations

import html
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


def layout(graph_def):
    """Layered layout: rank = longest path from a source (sources pulled down
    next to their first consumer), order within a rank by the barycentre of
    the predecessors.  Returns ({name: (rank, slot)}, edges)."""
    from graph_passes.graph import Graph, parse_tensor

    g = Graph(graph_def)
    order = g.topo_order()
    preds = {n: [] for n in order}
    edges = []
    for n in order:
        for inp in g.nodes[n].input:
            src, _, ctrl = parse_tensor(inp)
            if src in g.nodes and src in preds:
                preds[n].append(src)
                edges.append((src, n, ctrl))
    rank = {}
    for n in order:
        rank[n] = 1 + max((rank[p] for p in preds[n] if p in rank), default=-1)
    succ = {n: [] for n in order}
    for s, d, _ in edges:
        succ[s].append(d)
    for n in order:
        if not preds[n] and succ[n]:
            rank[n] = max(0, min(rank[c] for c in succ[n]) - 1)
    layers: dict[int, list[str]] = {}
    for n in order:
        layers.setdefault(rank[n], []).append(n)
    pos = {}
    for r in sorted(layers):
        items = layers[r]
        if r > 0:
            def bary(n):
                ps = [pos[p][1] for p in preds[n] if p in pos]
                return sum(ps) / len(ps) if ps else float("inf")
            items.sort(key=bary)
        for i, n in enumerate(items):
            pos[n] = (r, i)
    return pos, edges, g


def write_html(report, graph_def, path: str, title: str = "npu-amp precision map", max_nodes: int = 5000):
    """Write the self-contained HTML page to ``path``."""
    if graph_def is None:
        raise ToolError("the HTML page needs the graph: pass a model, not only a report JSON")
    if len(graph_def.node) > max_nodes:
        raise ToolError(f"graph has {len(graph_def.node)} nodes; the HTML view draws at most {max_nodes}")
    pos, edges, g = layout(graph_def)
    W, H, GX, GY = 150, 26, 20, 46
    widest = max([p[1] for p in pos.values()] + [0]) + 1
    ranks = max([p[0] for p in pos.values()] + [0]) + 1
    # centre each layer
    per_rank: dict[int, int] = {}
    for r, i in pos.values():
        per_rank[r] = max(per_rank.get(r, 0), i + 1)
    width = widest * (W + GX) + GX
    height = ranks * (H + GY) + GY

    def xy(n):
        r, i = pos[n]
        off = (widest - per_rank[r]) * (W + GX) / 2
        return GX + off + i * (W + GX), GY / 2 + r * (H + GY)

    parts = []
    for s, d, ctrl in edges:
        x1, y1 = xy(s)
        x2, y2 = xy(d)
        x1 += W / 2
        y1 += H
        x2 += W / 2
        my = (y1 + y2) / 2
        dash = ' stroke-dasharray="4 3"' if ctrl else ""
        parts.append(f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{my:.1f} {x2:.1f},{my:.1f} {x2:.1f},{y2:.1f}" '
                     f'class="e"{dash}/>')
    counts = {k: 0 for k in COLORS}
    nodes_js = {}
    for name in pos:
        node = g.nodes[name]
        dec = report.decisions.get(name)
        cls = _node_class(node, dec)
        counts[cls] += 1
        x, y = xy(name)
        label = name if len(name) <= 22 else "…" + name[-21:]
        info = {"op": node.op, "class": cls}
        if dec:
            info.update({k: dec.get(k) for k in ("dtype", "list", "reason", "flops") if dec.get(k) is not None})
        nodes_js[name] = info
        parts.append(
            f'<g class="n" data-n="{html.escape(name, quote=True)}" transform="translate({x:.1f},{y:.1f})">'
            f'<rect width="{W}" height="{H}" rx="5" fill="{COLORS[cls]}"/>'
            f'<text x="{W / 2}" y="11" class="op">{html.escape(node.op)}</text>'
            f'<text x="{W / 2}" y="22" class="nm">{html.escape(label)}</text></g>')
    legend = "".join(
        f'<span class="lg"><i style="background:{COLORS[k]}"></i>{html.escape(v)} ({counts[k]})</span>'
        for k, v in LEGEND)
    tot = "".join(f"<li>{html.escape(line.strip())}</li>" for line in totals_lines(report)[1:])
    warns = "".join(f"<li>{html.escape(str(w.get('message')))}"
                    f"{(' <code>' + html.escape(str(w.get('node'))) + '</code>') if w.get('node') else ''}</li>"
                    for w in report.warnings) or "<li>none</li>"
    data = json.dumps(nodes_js, default=str).replace("</", "<\\/")
    page = _TEMPLATE.format(
        title=html.escape(title), legend=legend, totals=tot, warnings=warns,
        nwarn=len(report.warnings), width=f"{width:.0f}", height=f"{height:.0f}",
        svg="\n".join(parts), data=data)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
    return counts


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body{{font:13px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}}
header{{padding:10px 16px;background:#fff;border-bottom:1px solid #ddd}}
h1{{font-size:17px;margin:0 0 6px}}
.lg{{display:inline-block;margin-right:14px}}.lg i{{display:inline-block;width:12px;height:12px;border-radius:3px;margin-right:4px;vertical-align:-1px}}
.cols{{display:flex;gap:24px}} ul{{margin:4px 0;padding-left:18px}}
#wrap{{overflow:auto;height:calc(100vh - 190px);background:#fff}}
svg .e{{fill:none;stroke:#999;stroke-width:1.1}}
svg .n text{{font:10px monospace;text-anchor:middle;fill:#111;pointer-events:none}}
svg .n text.op{{font-weight:bold}} svg .n:hover rect{{stroke:#000;stroke-width:2}}
svg .n.hit rect{{stroke:#d00;stroke-width:3}}
#tip{{position:fixed;display:none;background:#222;color:#fff;padding:6px 8px;border-radius:4px;max-width:420px;font:12px monospace;white-space:pre-wrap}}
input{{font:13px sans-serif;padding:2px 6px}}
</style></head><body>
<header><h1>{title}</h1>
<div>{legend}</div>
<div class="cols"><div><b>Totals</b><ul>{totals}</ul></div>
<div><b>Warnings ({nwarn})</b><ul>{warnings}</ul></div></div>
<div>find node: <input id="q" placeholder="name or op"> <span id="cnt"></span> &nbsp; wheel = zoom</div>
</header>
<div id="wrap"><svg id="g" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}">
{svg}
</svg></div><div id="tip"></div>
<script>
var NODES={data};
(function(){{
var tip=document.getElementById('tip'),svg=document.getElementById('g'),z=1,W={width},H={height};
svg.addEventListener('mousemove',function(ev){{var g=ev.target.closest('.n');if(!g){{tip.style.display='none';return;}}
var n=g.getAttribute('data-n'),d=NODES[n]||{{}},s=n+'\\nop: '+d.op+'\\nprecision: '+d['class'];
['dtype','list','reason','flops'].forEach(function(k){{if(d[k]!==undefined)s+='\\n'+k+': '+d[k];}});
tip.textContent=s;tip.style.display='block';tip.style.left=(ev.clientX+12)+'px';tip.style.top=(ev.clientY+12)+'px';}});
svg.addEventListener('mouseleave',function(){{tip.style.display='none';}});
document.getElementById('wrap').addEventListener('wheel',function(ev){{if(!ev.ctrlKey&&!ev.altKey&&Math.abs(ev.deltaY)<1)return;
ev.preventDefault();z*=ev.deltaY<0?1.15:1/1.15;z=Math.max(0.05,Math.min(z,4));svg.setAttribute('width',W*z);svg.setAttribute('height',H*z);}},{{passive:false}});
document.getElementById('q').addEventListener('input',function(ev){{var q=ev.target.value.toLowerCase(),c=0,first=null;
document.querySelectorAll('.n').forEach(function(g){{var n=g.getAttribute('data-n'),hit=q&&(n.toLowerCase().indexOf(q)>=0||(NODES[n].op||'').toLowerCase()===q);
g.classList.toggle('hit',!!hit);if(hit){{c++;first=first||g;}}}});
document.getElementById('cnt').textContent=q?c+' match(es)':'';if(first)first.scrollIntoView({{block:'center',inline:'center'}});}});
}})();
</script></body></html>
"""
