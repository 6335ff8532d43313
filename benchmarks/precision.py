"""Our pipeline vs TF's own grappler ``auto_mixed_precision_cpu``, side by
side in ONE process on the same training graphs, both run *by grappler*.

Graphs (built, never run):
  * ``tf.keras.applications.ResNet50(weights=None)`` + momentum optimizer (TF1 graph);
  * a BERT-base-like encoder (12 layers, hidden 768, 12 heads) + Adam (raw ops);
  * scaling: the BERT-like graph at ~12.5k and ~50k nodes (4x nodes: goal <= 4.5x time).

Timing (process CPU time, minimum of interleaved repeats: wall time on a
shared 2-core machine mostly measures the neighbours; ``tf_optimizer.OptimizeGraph`` on a
MetaGraph, one meta-optimizer iteration unless said otherwise; also grappler's
own timer around each optimizer, from meta_optimizer's log: wall time, but
without the item building that the CPU-time differences must subtract):
  * grappler's AMP pass alone = (only auto_mixed_precision_cpu on) - (every optimizer off);
  * ours end to end = (only the NpuAmpOptimizer plugin on) - (every optimizer off):
    C++ serialise -> Python parse -> unfuse -> fusion -> precision -> cleanup
    -> serialise -> C++ parse; the report's shape-based figures (FLOP share,
    activation bytes: grappler's C++ GraphProperties) are computed
    when the report is read, after the timed run, unless a pass needed shapes;
    ours per pass from the report of that run;
  * grappler's whole meta-optimizer (default optimizers, 2 iterations) with and
    without the plugin: the start-up cost a user sees.  Remapper is off in every
    run: TF 2.15 + oneDNN has aborted inside it on BERT-style raw-op graphs.
  * paired: the median over rounds of each round's ours / AMP ratio (by the log; by process
    CPU less that round's "nothing on" run): every mode runs back to back in a round, so a slow
    spell of the host weighs on both sides of a ratio.

``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16=0``: in CPU mode grappler
otherwise *emulates* FP16 (ops stay FP32 between casts), 0% of FLOPs in FP16.
Quality rows: Cast nodes added, low-precision share of matrix/conv FLOPs and
activation MiB from static shapes.  Times are printed, never asserted.

    python benchmarks/precision.py [--graphs resnet50,bert,scale] [--repeat 3]
    python benchmarks/precision.py --graphs bert --prefused --repeat 9   (issue 17: the bound of a
        layer-norm fusion done before the callback's parse)

``--prefused``: grappler's AMP pass on the graph, against ours on the graph our fusion
pass leaves inside grappler (every layer norm and its gradient region already fused;
``fusion_pass.capture``), interleaved; the two outputs of ours (on the graph and on
the pre-fused graph) are compared node by node.  When they are identical, ours on the
pre-fused graph is exactly our pipeline less the layer-norm rule's Python work: the
bound a C++ layer-norm fusion ahead of the Python parse would reach, before its own cost.
    python benchmarks/precision.py --graphs resnet50,bert --stage-ab --repeat 7   (issue 17h A/B)
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

# grappler's own per-optimizer times (meta_optimizer's VLOG(1), captured from
# stderr around each OptimizeGraph call): INFO logs must be on for them
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TF_CPP_VMODULE", "meta_optimizer=1")
os.environ["TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16"] = "0"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.framework import graph_pb2  # noqa: E402
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import npu_amp_tf  # noqa: E402
from graph_passes import registry  # noqa: E402
from graph_passes.graph import Graph, parse_tensor  # noqa: E402
from graph_passes.precision import stats  # noqa: E402
from real_models import bert_training_graph  # noqa: E402,F401  (report_html.py / memory.py import it from here)

v1 = tf.compat.v1
TF_VERSION = tuple(int(x) for x in tf.__version__.split(".")[:2])


def keras2():
    if TF_VERSION < (2, 16):
        return tf.keras
    import tf_keras
    return tf_keras


# ------------------------------------------------------------------ graphs
def resnet50_training_graph(batch=8):
    k = keras2()
    g = tf.Graph()
    with g.as_default():
        k.backend.set_learning_phase(1) if hasattr(k.backend, "set_learning_phase") else None
        x = v1.placeholder(tf.float32, [batch, 224, 224, 3], name="images")
        y = v1.placeholder(tf.int32, [batch], name="labels")
        model = k.applications.ResNet50(weights=None, input_tensor=x, classes=1000)
        logits = model.output.op.inputs[0] if model.output.op.type == "Softmax" else model.output
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        opt = v1.train.MomentumOptimizer(0.1, 0.9)
        with tf.control_dependencies(model.updates if hasattr(model, "updates") else []):
            train = opt.minimize(loss, var_list=model.trainable_weights, name="train")
    return g, ["loss", train.name.split(":")[0]]


# ---------------------------------------------------------------- grappler
_OFF_FIELDS = ("layout_optimizer", "constant_folding", "shape_optimization", "remapping",
               "common_subgraph_elimination", "arithmetic_optimization", "dependency_optimization",
               "loop_optimization", "function_optimization", "debug_stripper",
               "scoped_allocator_optimization", "pin_to_host_optimization", "implementation_selector",
               "auto_mixed_precision", "auto_mixed_precision_mkl", "auto_mixed_precision_onednn_bfloat16",
               "auto_mixed_precision_cpu")


def grappler_config(mode: str):
    """mode: 'off' (nothing), 'amp' (grappler AMP alone), 'ours' (plugin alone),
    'meta' (default optimizers, remapper off), 'meta+ours'."""
    cfg = config_pb2.ConfigProto()
    ro = cfg.graph_options.rewrite_options
    off = rewriter_config_pb2.RewriterConfig.OFF
    ro.min_graph_nodes = -1
    if mode in ("meta", "meta+ours"):
        ro.remapping = off
    else:
        for f in _OFF_FIELDS:
            setattr(ro, f, off)
        ro.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
        ro.disable_model_pruning = True
        ro.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
        if mode == "amp":
            ro.auto_mixed_precision_cpu = rewriter_config_pb2.RewriterConfig.ON
    if mode in ("ours", "meta+ours"):
        co = ro.custom_optimizers.add()
        co.name = "NpuAmpOptimizer"
        co.parameter_map["precision_mode"].s = b"allow_mix_precision"
    return cfg


def metagraph(graph, fetches):
    with graph.as_default():
        mg = v1.train.export_meta_graph(graph_def=graph.as_graph_def(), clear_devices=True,
                                        collection_list=[])
    for f in fetches:
        mg.collection_def["train_op"].node_list.value.append(f)
    return mg


_LOGGED = re.compile(r"meta_optimizer\.cc:\d+\] ([^:{]+?)(?:\{.*\})?: Graph size after: .*?time = ([\d.]+)ms")
#: the optimizer whose own logged time each mode measures
_LOGGED_NAME = {"amp": "auto_mixed_precision_cpu", "ours": "NpuAmpOptimizer"}


def _optimize_logged(cfg, mg):
    """OptimizeGraph, and {optimizer: wall ms} from meta_optimizer's own log
    (its timer around each optimizer; empty when TF logs nothing)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            out = tf_optimizer.OptimizeGraph(cfg, mg, graph_id=b"bench")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    logged = {}
    for name, ms in _LOGGED.findall(text):
        logged[name.strip()] = logged.get(name.strip(), 0.0) + float(ms)
    return out, logged


def timed_run(mode, mg):
    """One OptimizeGraph of ``mg`` in ``mode`` with nothing memoised: (its
    output, process CPU s, the mode's own optimizer's time by grappler's log
    in s or None, and for 'ours' the plugin's last "rewritten" record or None)."""
    from npu_amp_tf import bridge

    bridge.clear_reports()  # no memo: every run does the full work
    t0 = time.process_time()
    out, log_ms = _optimize_logged(grappler_config(mode), mg)
    cpu = time.process_time() - t0
    got = log_ms.get(_LOGGED_NAME[mode]) if mode in _LOGGED_NAME else None
    recs = [r for r in bridge.last_reports() if r["status"] == "rewritten"] if mode == "ours" else []
    return out, cpu, None if got is None else got / 1e3, recs[-1] if recs else None


def time_modes(mg, modes, repeat, rounds=None):
    """Interleaved OptimizeGraph runs; returns ({mode: min s}, {mode: output},
    our record, {mode: min logged s of the mode's own optimizer}).
    ``rounds``: a dict filled with the per-round lists (``"cpu"``: {mode:
    [process CPU s]}, ``"log"``: {mode: [logged s]}, None where a round's
    log lacked the line), for the paired figures (:func:`paired`)."""
    times = {m: [] for m in modes}
    logged = {m: [] for m in _LOGGED_NAME if m in modes}
    outs, rep = {}, None
    cb_cpu = []  # the callback's thread CPU per run (record "cpu_s")
    for _ in range(repeat):
        for m in modes:
            outs[m], cpu, log_s, rec = timed_run(m, mg)
            times[m].append(cpu)
            if m in logged:
                logged[m].append(log_s)
            if m == "ours":
                rep = rec
                if rep is not None and rep.get("cpu_s") is not None:
                    cb_cpu.append(rep["cpu_s"])
    if rep is not None and cb_cpu:
        # (the first run of this graph in this process: for the first graph of
        # the process, what a user's first start-up pays, caches cold)
        rep = dict(rep, cpu_min_s=min(cb_cpu), cpu_first_s=cb_cpu[0])
    if rounds is not None:
        rounds["cpu"], rounds["log"] = times, logged
    # the minimum: on a shared machine the noise only ever adds time
    return ({m: min(v) for m, v in times.items()}, outs, rep,
            {m: min(x for x in v if x is not None) for m, v in logged.items() if any(x is not None for x in v)})


def paired(rounds):
    """(median per-round ours / AMP ratio by grappler's log, the same by
    process CPU less that round's 'nothing on' run), each None when no round
    gives one.  Each round runs every mode back to back, so a slow spell of
    the host weighs on both sides of a round's ratio, where the minima of
    each side may come from different rounds."""
    log, cpu = rounds.get("log", {}), rounds.get("cpu", {})
    by_log = _round_ratios(log.get("ours", ()), log.get("amp", ()))
    by_cpu = []
    for off, a, o in zip(cpu.get("off", ()), cpu.get("amp", ()), cpu.get("ours", ())):
        if a - off > 0 and o - off > 0:
            by_cpu.append((o - off) / (a - off))
    return _median(by_log), _median(by_cpu), len(by_log), len(by_cpu)


def _round_ratios(num, den) -> list:
    """Each round's ``num / den`` (rounds where either is missing, None, or ``den`` is 0 left out)."""
    return [o / a for o, a in zip(num, den) if a is not None and o is not None and a > 0]


def _median(xs):
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------ metrics
def _orig_shapes(gd):
    from graph_passes import shapes as shp

    return shp.infer_shapes(gd)


class _CastAwareShapes:
    """Shapes of the original graph looked up by name through Casts (and other
    single-input nodes) a rewrite inserted."""

    _dependent = False  # stats.activation_bytes caches the input-dependent nodes here

    def __init__(self, orig, out_graph):
        self.orig, self.g = orig, out_graph

    def node_shapes(self, name):
        for _ in range(8):
            s = self.orig.get(name)
            if s is not None:
                return s
            node = self.g.nodes.get(name)
            if node is None or not node.input:
                return None
            name = parse_tensor(node.input[0])[0]
        return None

    def get(self, ref):
        src, port, _ = parse_tensor(ref)
        s = self.node_shapes(src)
        return s[port] if s is not None and port < len(s) else None


def activation_mib(out_gd, orig):
    g = Graph(out_gd, copy=False)
    return stats.activation_bytes(g, _CastAwareShapes(orig, g)) / 2 ** 20


def flop_share(out_gd, orig):
    g = Graph(out_gd, copy=False)
    shapes = _CastAwareShapes(orig, g)
    lp = total = unknown = 0
    for n in g.nodes.values():
        if n.op not in stats.MATRIX_OPS:
            continue
        f = stats.matmul_flops(n, shapes)
        if f is None:
            unknown += 1
            continue
        total += f
        dt = n.attr["Ta"].type if "Ta" in n.attr else n.attr["T"].type
        if dt in registry.LOW_TYPES:
            lp += f
    return (lp / total if total else float("nan")), total, unknown


def count(gd, op):
    return sum(1 for n in gd.node if n.op == op)


def _ms(x):
    return f"{x * 1e3:.0f} ms"


def bench(name, graph, fetches, repeat, quality=True, meta=True):
    gd = graph.as_graph_def()
    mg = metagraph(graph, fetches)
    modes = ["off", "amp", "ours"] + (["meta", "meta+ours"] if meta else [])
    print(f"\n== {name}: {len(gd.node)} nodes", flush=True)
    rounds = {}
    t, outs, rec, logged = time_modes(mg, modes, repeat, rounds)
    t_amp, t_ours = t["amp"] - t["off"], t["ours"] - t["off"]
    # (callback_s: the callback's thread CPU, minimum over the repeats: what the
    # scaling check compares; its wall time counts the neighbours on a shared machine)
    res = {"graph": name, "nodes": len(gd.node), "amp_s": t_amp, "ours_s": t_ours, "off_s": t["off"],
           "callback_s": (rec or {}).get("cpu_min_s")}
    if t_amp > 0 and t_ours > 0:
        print(f"  end to end: ours {_ms(t_ours)} vs grappler's AMP pass alone {_ms(t_amp)}: "
              f"{_ratio(t_ours, t_amp)}x  (goal <= 1.0x: {'met' if t_ours <= t_amp else 'MISSED'}); "
              f"OptimizeGraph with nothing on: {_ms(t['off'])}  (process CPU, differences of minima)")
    else:
        # the 'nothing on' baseline (item building, ~350-450 ms) moved by more than a pass
        print(f"  end to end by process CPU: not measurable in this run (differences of minima: ours "
              f"{_ms(t_ours)}, grappler's AMP {_ms(t_amp)}; the 'nothing on' baseline, {_ms(t['off'])}, "
              f"moved by more than a pass): read grappler's own log below")
    if "amp" in logged and "ours" in logged:
        la, lo = logged["amp"], logged["ours"]
        res.update(amp_logged_s=la, ours_logged_s=lo)
        print(f"  grappler's own log (meta-optimizer's timer around each optimizer, wall, min of "
              f"{repeat}): ours {_ms(lo)} vs auto_mixed_precision_cpu {_ms(la)}: {_ratio(lo, la)}x  "
              f"(goal <= 1.0x: {'met' if lo <= la else 'MISSED'})")
    r_log, r_cpu, n_log, n_cpu = paired(rounds)
    if r_log is not None or r_cpu is not None:
        res.update(paired_log_ratio=r_log, paired_cpu_ratio=r_cpu)
        by_log = f"by grappler's log {r_log:.2f}x ({n_log} rounds)" if r_log is not None else "by the log: none"
        by_cpu = (f"by process CPU {r_cpu:.2f}x ({n_cpu} of {repeat} rounds with both above 'nothing on')"
                  if r_cpu is not None else "by process CPU: no round with both above 'nothing on'")
        print(f"  paired (median over rounds of each round's ours / AMP): {by_log}; {by_cpu}")
    if rec is not None and rec.get("report"):
        rep = rec["report"]
        parts = [f"{p['name']} {_ms(p['time_s'])}" + (f" ({_ms(p['cpu_s'])} CPU)" if "cpu_s" in p else "")
                 for p in rep["passes"]]
        summ = rep["summary"]
        shp = summ.get("shape_inference_s")
        where = ("inside the pipeline" if summ.get("shapes_inferred_in_pipeline")
                 else "when the report was read, after the run (not in the times above)")
        print("  ours per pass: " + ", ".join(parts) +
              (f" (grappler shape inference {_ms(shp)}, {where})" if shp is not None else "") +
              f"; pipeline {_ms(summ.get('time_s', 0))} (output serialised inside it), bridge "
              f"parse {_ms(rec.get('bridge_s') or 0)}, whole callback {_ms(rec.get('time_s') or 0)} "
              f"wall, {_ms(rec.get('cpu_s') or 0)} CPU (min of {repeat}: {_ms(rec.get('cpu_min_s') or 0)}; "
              f"first run of this graph in this process: {_ms(rec.get('cpu_first_s') or 0)})")
        stages = summ.get("stages_cpu_s")
        if stages:
            print("  ours per stage (thread CPU of the timed run): "
                  + ", ".join(f"{k} {_ms(v)}" for k, v in stages.items()))
            res["stages_cpu"] = stages
        res["passes"] = {p["name"]: p["time_s"] for p in rep["passes"]}
        res["shapes_s"] = shp
    if meta:
        extra = t["meta+ours"] - t["meta"]
        print(f"  grappler meta-optimizer (defaults, remapper off): without plugin {_ms(t['meta'])}, "
              f"with plugin {_ms(t['meta+ours'])} (+{_ms(extra)}, "
              f"{_ratio(t['meta+ours'], t['meta'])}x)")
        res["meta"] = (t["meta"], t["meta+ours"])
    if quality:
        orig = _orig_shapes(gd)
        ours, gr = outs["ours"], outs["amp"]
        c0 = count(gd, "Cast")
        c_ours, c_gr = count(ours, "Cast") - c0, count(gr, "Cast") - c0
        s_ours, flops, unk = flop_share(ours, orig)
        s_gr, _, _ = flop_share(gr, orig)
        a0, a_ours, a_gr = (activation_mib(x, orig) for x in (gd, ours, gr))
        rows = [
            ("Cast nodes added", f"{c_ours}", f"{c_gr}", _ratio(c_ours, c_gr)),
            (f"activation MiB (FP32: {a0:.0f})", f"{a_ours:.0f}", f"{a_gr:.0f}", _ratio(a_ours, a_gr)),
            ("low-precision FLOP share", f"{s_ours:.2%}", f"{s_gr:.2%}", _ratio(s_ours, s_gr)),
        ]
        if "amp" in logged and "ours" in logged:
            lo, la = logged["ours"], logged["amp"]
            rows.append(("pass time, grappler's log (ms)", f"{lo * 1e3:.0f}", f"{la * 1e3:.0f}", _ratio(lo, la)))
        if t_amp > 0 and t_ours > 0:
            rows.append(("pass time, process CPU (ms)", f"{t_ours * 1e3:.0f}", f"{t_amp * 1e3:.0f}",
                         _ratio(t_ours, t_amp)))
        w = max(len(r[0]) for r in rows)
        print(f"  {'':{w}} | {'npu-amp-tf':>11} | {'grappler':>11} | ours/grappler")
        for r in rows:
            print(f"  {r[0]:{w}} | {r[1]:>11} | {r[2]:>11} | {r[3]}")
        print(f"  matrix/conv GFLOPs per step: {flops / 1e9:.1f} ({unk} matrix ops without static shape)")
    return res


def ab_stage_paths(name, graph, fetches, repeat):
    """Issue 17h: the stages outside the passes with their fast paths on and
    off (the OpDef guard's reader edges, ``opdef_check.FAST_READERS``; the
    output handed to C++ as a patch, ``Graph.patch_output``), interleaved in
    this process: plugin-alone OptimizeGraph minus nothing-on, process CPU,
    minimum of ``repeat``; and the whole callback's CPU from its record."""
    from graph_passes import opdef_check
    from npu_amp_tf import bridge

    mg = metagraph(graph, fetches)
    cfgs = {m: grappler_config(m) for m in ("off", "ours")}
    runs = {"off": [], "on": [], "ref": []}
    cb = {"on": [], "ref": []}
    outs = {}
    try:
        for _ in range(repeat):
            for mode in (("off", "on", "ref") if _ % 2 else ("off", "ref", "on")):
                opdef_check.FAST_READERS = Graph.patch_output = mode != "ref"
                bridge.clear_reports()
                t0 = time.process_time()
                out = tf_optimizer.OptimizeGraph(cfgs["off" if mode == "off" else "ours"], mg,
                                                 graph_id=b"bench")
                runs[mode].append(time.process_time() - t0)
                if mode != "off":
                    outs[mode] = out.SerializeToString(deterministic=True)
                    recs = [r for r in bridge.last_reports() if r["status"] == "rewritten"]
                    cb[mode].append(recs[-1]["cpu_s"] if recs else float("nan"))
    finally:
        opdef_check.FAST_READERS = Graph.patch_output = True
    off = min(runs["off"])
    on, ref = min(runs["on"]) - off, min(runs["ref"]) - off
    print(f"\n== {name}: 17h stage paths, {repeat} interleaved rounds (process CPU, minus nothing-on "
          f"{_ms(off)})")
    print(f"  ours end to end: reference {_ms(ref)} -> fast {_ms(on)} ({_ms(ref - on)} less); "
          f"whole callback CPU {_ms(min(cb['ref']))} -> {_ms(min(cb['on']))}; outputs "
          f"{'identical' if outs['on'] == outs['ref'] else 'DIFFER'}")
    return {"graph": name, "ref_s": ref, "fast_s": on}


def prefused_input(graph, fetches):
    """(MetaGraph of the graph our fusion pass leaves inside grappler, the
    number of its layer-norm ops): ``fusion_pass.capture``'s output bytes,
    imported into a fresh graph (the fused ops are the plugin's, registered)
    with the same train-op fetches."""
    import fusion_pass as fpb  # (benchmarks/: on sys.path as this script's directory)

    cap = fpb.capture("prefused", graph, fetches)
    gd = graph_pb2.GraphDef.FromString(cap.output)
    fused = tf.Graph()
    with fused.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    norms = sum(n.op in ("LayerNorm", "RMSNorm") for n in gd.node)
    return metagraph(fused, [f if isinstance(f, str) else f.name for f in fetches]), norms, len(gd.node)


def same_nodes(a, b) -> list:
    """The names of the nodes that differ between GraphDefs ``a`` and ``b``
    (by deterministic bytes; node order aside)."""
    ka = {n.name: n.SerializeToString(deterministic=True) for n in a.node}
    kb = {n.name: n.SerializeToString(deterministic=True) for n in b.node}
    return sorted(k for k in ka.keys() | kb.keys() if ka.get(k) != kb.get(k))


def prefused_bound(name, graph, fetches, repeat):
    """Issue 17: grappler's AMP pass on ``graph`` vs ours on the graph our
    fusion pass leaves (see the module docstring, ``--prefused``), rounds
    interleaved: AMP, ours, nothing on (each graph), ours on the pre-fused."""
    mg = metagraph(graph, fetches)
    mg_pre, norms, n_pre = prefused_input(graph, fetches)
    print(f"\n== {name}: {len(graph.as_graph_def().node)} nodes; pre-fused by our fusion pass: {n_pre} "
          f"nodes, {norms} norm ops", flush=True)
    runs = [("amp", mg, "amp"), ("off", mg, "off"), ("ours", mg, "ours"), ("pre", mg_pre, "ours"),
            ("pre_off", mg_pre, "off")]
    cpu = {k: [] for k, _, _ in runs}
    log = {k: [] for k in ("amp", "ours", "pre")}
    cb = {"ours": [], "pre": []}
    outs = {}
    for _ in range(repeat):
        for key, m, mode in runs:
            outs[key], t, log_s, rec = timed_run(mode, m)
            cpu[key].append(t)
            if key in log:
                log[key].append(log_s)
            if key in cb and rec is not None and rec.get("cpu_s") is not None:
                cb[key].append(rec["cpu_s"])
    differ = same_nodes(outs["ours"], outs["pre"])
    res = {"graph": name, "norms": norms, "identical": not differ,
           "callback_s": min(cb["ours"], default=None), "prefused_callback_s": min(cb["pre"], default=None)}
    if differ:
        print(f"  ours on the pre-fused graph gives another output ({len(differ)} nodes differ, e.g. "
              f"{differ[:3]}): not a bound of this pipeline")
    else:
        print("  ours on the pre-fused graph: the same output graph, node for node")

    r_ours, r_pre = (_median(_round_ratios(log[k], log["amp"])) for k in ("ours", "pre"))
    if r_ours is not None and r_pre is not None:
        res.update(paired_log_ratio=r_ours, prefused_paired_log_ratio=r_pre)
        print(f"  grappler's log, paired (median of each round's ratio to its AMP pass): ours "
              f"{r_ours:.2f}x, ours on the pre-fused graph {r_pre:.2f}x (goal <= 1.0x); minima: AMP "
              f"{_ms(min(x for x in log['amp'] if x is not None))}, ours "
              f"{_ms(min(x for x in log['ours'] if x is not None))}, pre-fused "
              f"{_ms(min(x for x in log['pre'] if x is not None))}")
    else:
        print("  grappler's log: no line read (TF_CPP_MIN_LOG_LEVEL must let INFO through)")
    t_amp = min(cpu["amp"]) - min(cpu["off"])
    t_ours = min(cpu["ours"]) - min(cpu["off"])
    t_pre = min(cpu["pre"]) - min(cpu["pre_off"])
    res.update(amp_s=t_amp, ours_s=t_ours, prefused_s=t_pre)
    print(f"  process CPU, differences of minima: AMP {_ms(t_amp)}, ours {_ms(t_ours)}, ours on the pre-fused "
          f"graph {_ms(t_pre)}; the callback's thread CPU, min of {repeat}: ours "
          f"{_ms(res['callback_s'] or 0)}, pre-fused {_ms(res['prefused_callback_s'] or 0)}")
    return res


def _ratio(a, b):
    return f"{a / b:.2f}" if b else "n/a"


def _named_graph(name, bert_layers):
    """(label, graph, fetches) of ``--graphs`` entry ``name`` for ``--stage-ab`` and
    ``--prefused``, or None for a name other than resnet50 / bert."""
    if name == "resnet50":
        return ("ResNet50 + Momentum (training)", *resnet50_training_graph())
    if name == "bert":
        return (f"BERT-base-like ({bert_layers} layers) + Adam", *bert_training_graph(layers=bert_layers))
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graphs", default="resnet50,bert,scale")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bert-layers", type=int, default=12)
    ap.add_argument("--stage-ab", action="store_true",
                    help="only the issue-17h A/B of the stages outside the passes (fast vs reference)")
    ap.add_argument("--prefused", action="store_true",
                    help="only grappler's AMP pass vs ours on the graph our fusion pass leaves (issue 17: "
                         "the bound of a layer-norm fusion done before the callback's parse)")
    args = ap.parse_args(argv)
    from npu_amp_tf import bridge

    bridge.register()
    print(f"TensorFlow {tf.__version__}; TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16="
          f"{os.environ['TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16']}; load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs")
    results = []
    if args.stage_ab:
        for name in args.graphs.split(","):
            named = _named_graph(name, args.bert_layers)
            if named is not None:
                results.append(ab_stage_paths(*named, args.repeat))
        return results
    if args.prefused:
        for name in args.graphs.split(","):
            named = _named_graph(name, args.bert_layers)
            if named is None:
                ap.error(f"--prefused --graphs: unknown graph '{name}'; accepted: resnet50, bert")
            results.append(prefused_bound(*named, args.repeat))
        return results
    for name in args.graphs.split(","):
        if name == "resnet50":
            g, fetches = resnet50_training_graph()
            results.append(bench("ResNet50 + Momentum (training)", g, fetches, args.repeat))
        elif name == "bert":
            g, fetches = bert_training_graph(layers=args.bert_layers)
            results.append(bench(f"BERT-base-like ({args.bert_layers} layers) + Adam (training)",
                                 g, fetches, args.repeat))
        elif name == "scale":
            small = bench("BERT-like, 16 layers (scaling, small)", *bert_training_graph(layers=16),
                          args.repeat, quality=False, meta=False)
            # (as many repeats as the small graph: one sample of the big graph on a
            # shared machine once read as 7.0x for 4.02x nodes; issue 17k)
            big = bench("BERT-like, 66 layers (scaling, ~50k nodes)", *bert_training_graph(layers=66),
                        args.repeat, quality=False, meta=False)
            rn, rt = big["nodes"] / small["nodes"], big["ours_s"] / small["ours_s"]
            rc = (big["callback_s"] / small["callback_s"]) if small.get("callback_s") else float("nan")
            ga = big["amp_s"] / small["amp_s"] if small["amp_s"] > 0 else float("nan")
            goal = 4.5 * rn / 4
            go = big["off_s"] / small["off_s"] if small["off_s"] else float("nan")
            print(f"\n== scaling: {rn:.2f}x nodes -> ours {rt:.2f}x time end to end, {rc:.2f}x "
                  f"inside the callback (thread CPU) (goal <= {goal:.2f}x: "
                  f"{'met' if rt <= goal else 'MISSED'} / {'met' if rc <= goal else 'MISSED'}); "
                  f"grappler AMP {ga:.2f}x; OptimizeGraph with nothing on (subtracted from both) "
                  f"{go:.2f}x")
            results += [small, big]
        else:
            ap.error(f"--graphs: unknown graph '{name}'; accepted: resnet50, bert, scale")
    return results


if __name__ == "__main__":
    main()
