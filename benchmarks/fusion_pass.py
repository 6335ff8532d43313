"""The fusion pass alone, on the graph it gets inside grappler: thread CPU,
per rule and per sweep, and interleaved A/B of a module-level switch.

Issue 17 (helper 17o).  ``benchmarks/precision.py`` times the whole callback;
the fusion pass's own figure there is one run's ``cpu_s`` in the report.  This
script runs the plugin once through grappler (``precision.py``'s graphs and
config: ``OptimizeGraph``, plugin alone, ``precision_mode=allow_mix_precision``),
keeps the graph and the pass context the fusion pass received (after
``unfuse``), and then runs ``FusionPass`` again and again on a fresh
``Graph`` built from those bytes with the same C++ index and shape source the
callback uses: thread CPU (``time.thread_time``) of ``FusionPass.run`` only,
with Python's cyclic collector paused as the pipeline runs every pass,
minimum over rounds (a shared machine only ever adds time).

    python benchmarks/fusion_pass.py --graphs bert,resnet50 --rounds 7
    python benchmarks/fusion_pass.py --graphs bert --breakdown
    python benchmarks/fusion_pass.py --graphs bert --ab graph_passes.fusion.fusion_pass.FusionPass.skip_untouched

``--breakdown``: per rule, thread CPU of its runs (``apply_rule``: find the
matches, build, commit) and of the checks that let a later sweep skip it
(``_untouched``), with the run counts; per sweep.  ``--ab PATH``: the switch at
``PATH`` (a module attribute or a class attribute, dotted; ``A+B`` flips
several switches together) True vs False, interleaved, and whether the two
give byte-identical graphs, stats and report entries (which of them differ,
when they do).  Times are printed, never asserted.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16"] = "0"

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import tensorflow as tf  # noqa: E402
from tensorflow.core.framework import graph_pb2  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

import precision as _bench  # noqa: E402  (its graphs and grappler config)
from graph_passes import manager as _manager  # noqa: E402
from graph_passes import shapes as _shapes  # noqa: E402
from graph_passes.fusion import fusion_pass as _fp  # noqa: E402
from graph_passes.graph import Graph  # noqa: E402


class Captured:
    """What the fusion pass received inside grappler: the graph's bytes and
    the context's options, fetches, preserved nodes and devices; and the
    pass's thread CPU in that run (the report's ``cpu_s``)."""

    def __init__(self, name, data, ctx):
        self.name = name
        self.data = data
        self.options = ctx.options
        self.fetches = set(ctx.fetches)
        self.preserve = set(ctx.preserve)
        self.devices = tuple(ctx.devices)
        #: (issue 17) the layer-norm fusions made before the parse, which the pass reports as its own
        self.prefused = getattr(ctx, "prefused", None)
        self.callback_cpu_s = None
        self.nodes = 0
        #: the graph the fusion pass left inside grappler (a replay must give the same bytes)
        self.output = None

    def make(self, options=None):
        """A fresh (Graph, PassContext) as the callback builds them: the C++
        index and the shape source of the same bytes (``options``: instead of
        the captured ones)."""
        from npu_amp_tf import bridge

        gd = graph_pb2.GraphDef()
        gd.ParseFromString(self.data)
        graph = Graph(gd, index=bridge.graph_index(gd, self.data))
        graph.source_bytes = self.data  # (as the pipeline sets it: the C++ region search's mirror)
        src = bridge.graph_shape_source(gd)
        if src is not None:
            _shapes.attach(graph, src)
        ctx = _manager.PassContext(options or self.options, self.fetches, self.preserve, self.devices)
        ctx.prefused = self.prefused
        return graph, ctx


def build(name, bert_layers=12):
    if name == "resnet50":
        return _bench.resnet50_training_graph()
    if name == "bert":
        return _bench.bert_training_graph(layers=bert_layers)
    raise SystemExit(f"--graphs: unknown graph '{name}'; accepted: resnet50, bert")


def capture(name, graph, fetches, pass_cls=None, label="fusion", cls=Captured) -> Captured:
    """Run the plugin once through grappler and keep the input of
    ``pass_cls`` (default the fusion pass; ``label``: its name in the report)
    as a ``cls``."""
    from npu_amp_tf import bridge

    pass_cls = pass_cls or _fp.FusionPass
    mg = _bench.metagraph(graph, fetches)
    box = {}
    orig = pass_cls.run

    def run(self, g, ctx):
        first = "cap" not in box
        if first:
            box["cap"] = cls(name, g.serialize(), ctx)
        stats = orig(self, g, ctx)
        if first:
            box["cap"].output = g.serialize()
        return stats

    pass_cls.run = run
    try:
        bridge.register()
        bridge.clear_reports()
        tf_optimizer.OptimizeGraph(_bench.grappler_config("ours"), mg, graph_id=b"bench")
    finally:
        pass_cls.run = orig
    cap = box.get("cap")
    if cap is None:
        raise SystemExit(f"{name}: the {label} pass did not run inside grappler")
    recs = [r for r in bridge.last_reports() if r["status"] == "rewritten"]
    if recs and recs[-1].get("report"):
        cap.callback_cpu_s = next((p.get("cpu_s") for p in recs[-1]["report"]["passes"]
                                   if p["name"] == label), None)
    cap.nodes = len(graph_pb2.GraphDef.FromString(cap.data).node)
    return cap


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic collector paused, as the pipeline runs every pass
    (``npu_amp_tf.pipeline._optimize``): a replay timed with it on would
    count collections of the benchmark's own objects (its Keras model) that
    the callback never pays."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_once(cap: Captured):
    """(thread CPU s of FusionPass.run, graph, ctx, stats) on a fresh graph."""
    graph, ctx = cap.make()
    with collector_paused():
        c0 = time.thread_time()
        stats = _fp.FusionPass().run(graph, ctx)
        t = time.thread_time() - c0
    return t, graph, ctx, stats


def outcome(graph, ctx, stats) -> tuple:
    """What must not change: the graph's bytes, the stats, the report's entries."""
    return (graph.serialize(), repr(sorted(stats.items(), key=str)), repr(ctx.report.decisions),
            repr(ctx.report.warnings))


def breakdown(cap: Captured, rounds: int):
    """Per rule and per sweep thread CPU, from the fastest of ``rounds`` runs."""
    from graph_passes.fusion.core import RULES

    order = list(RULES)
    best = None
    for _ in range(rounds):
        acc = collections.defaultdict(float)  # (rule, column) -> s
        cnt = collections.Counter()
        per_sweep = collections.defaultdict(float)  # sweep -> rule runs + checks
        state = {"last": len(order), "sweep": 0, "prev": None}
        oa, ou = _fp.apply_rule, _fp.FusionPass._untouched

        def sweep_of(kind, rule):
            # rules run in registry order: one not after the previous one starts a
            # sweep (a rule's skip check and the run that follows it share one)
            i = order.index(rule.name)
            if i < state["last"] or (i == state["last"] and state["prev"] == ("run", rule.name)):
                state["sweep"] += 1
            state["last"], state["prev"] = i, (kind, rule.name)
            return state["sweep"]

        def timed(kind, fn):
            def wrapper(*a, **k):
                rule = a[2] if kind == "check" else a[1]
                sw = sweep_of(kind, rule)
                c0 = time.thread_time()
                try:
                    return fn(*a, **k)
                finally:
                    dt = time.thread_time() - c0
                    col = "run 1" if kind == "run" and sw == 1 else ("run 2+" if kind == "run" else "check")
                    acc[rule.name, col] += dt
                    cnt[rule.name, kind] += 1
                    per_sweep[sw] += dt
            return wrapper

        _fp.apply_rule, _fp.FusionPass._untouched = timed("run", oa), timed("check", ou)
        try:
            graph, ctx = cap.make()
            with collector_paused():
                c0 = time.thread_time()
                stats = _fp.FusionPass().run(graph, ctx)
                total = time.thread_time() - c0
        finally:
            _fp.apply_rule, _fp.FusionPass._untouched = oa, ou
        if best is None or total < best[0]:
            best = (total, dict(acc), cnt, stats, [per_sweep[k] for k in sorted(per_sweep)])
    total, acc, cnt, stats, per_sweep = best
    print(f"  fastest of {rounds} (timers on): {total * 1e3:.1f} ms; rule runs and skip checks per sweep: "
          + ", ".join(f"{i + 1}: {s * 1e3:.1f}" for i, s in enumerate(per_sweep)) + " ms")
    print(f"  fused {stats.get('fused')}; skipped matches {stats.get('skipped')}")
    rules = sorted({r for r, _ in acc}, key=lambda r: -sum(v for (q, _), v in acc.items() if q == r))
    print(f"  {'rule (#: registry order)':32} {'sweep 1 run':>11} {'later runs':>10} {'later checks':>12} "
          f"{'runs':>4} {'checks':>6}  ms")
    for r in rules:
        row = [acc.get((r, c), 0.0) for c in ("run 1", "run 2+", "check")]
        if sum(row) < 0.0003:
            continue
        print(f"  {r + ' #' + str(order.index(r) + 1):32} {row[0] * 1e3:11.1f} {row[1] * 1e3:10.1f} "
              f"{row[2] * 1e3:12.1f} {cnt[r, 'run']:4d} {cnt[r, 'check']:6d}")
    shown = sum(acc.values())
    print(f"  rule runs + checks {shown * 1e3:.1f} ms, the pass outside them {(total - shown) * 1e3:.1f} ms")


def _resolve(path: str):
    """(owner object, attribute) of a dotted switch path: a module attribute
    (``pkg.mod.FLAG``) or a class attribute (``pkg.mod.Class.flag``)."""
    parts = path.split(".")
    for k in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for p in parts[k:-1]:
            obj = getattr(obj, p)
        if not hasattr(obj, parts[-1]):
            raise SystemExit(f"--ab: '{path}': no attribute '{parts[-1]}'")
        return obj, parts[-1]
    raise SystemExit(f"--ab: '{path}': no such module")


def ab(cap: Captured, path: str, rounds: int):
    """Interleaved rounds of the switch True / False: min thread CPU and identity."""
    switches = [_resolve(p) for p in path.split("+")]  # "a+b": both switches together
    saved = [getattr(owner, attr) for owner, attr in switches]
    times = {True: [], False: []}
    outs = {}
    try:
        for r in range(rounds):
            for val in ((True, False) if r % 2 else (False, True)):
                for owner, attr in switches:
                    setattr(owner, attr, val)
                t, graph, ctx, stats = run_once(cap)
                times[val].append(t)
                out = outcome(graph, ctx, stats)
                if outs.setdefault(val, out) != out:
                    outs[val] = None  # not even deterministic
    finally:
        for (owner, attr), v in zip(switches, saved):
            setattr(owner, attr, v)
    same = outs[True] is not None and outs[True] == outs[False]
    on, off = min(times[True]), min(times[False])
    differ = ""
    if not same:
        if outs[True] is None or outs[False] is None:
            differ = " (an arm is not deterministic)"
        else:
            parts = ("graph", "stats", "decisions", "warnings")
            differ = " (" + ", ".join(p for p, a, b in zip(parts, outs[True], outs[False]) if a != b) + ")"
    print(f"  {path}: True {on * 1e3:.1f} ms vs False {off * 1e3:.1f} ms (min of {rounds}, interleaved): "
          f"{(off - on) * 1e3:+.1f} ms for True; graphs, stats and report "
          f"{'identical' if same else 'DIFFER' + differ}")
    return {"switch": path, "on_s": on, "off_s": off, "identical": same, "differ": differ}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graphs", default="bert,resnet50")
    ap.add_argument("--bert-layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--breakdown", action="store_true", help="per rule and per sweep thread CPU")
    ap.add_argument("--ab", action="append", default=[], metavar="SWITCH",
                    help="dotted path of a True/False switch to A/B (may be repeated; "
                         "'PATH+PATH' flips several together)")
    args = ap.parse_args(argv)
    print(f"TensorFlow {tf.__version__}; load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs")
    results = []
    for name in args.graphs.split(","):
        cap = capture(name, *build(name, args.bert_layers))
        times = [run_once(cap)[0] for _ in range(args.rounds)]
        label = f"BERT-like {args.bert_layers} layers" if name == "bert" else "Keras ResNet50"
        cb = f"{cap.callback_cpu_s * 1e3:.1f} ms" if cap.callback_cpu_s is not None else "n/a"
        print(f"\n== {label} training graph, fusion pass input {cap.nodes} nodes")
        print(f"  fusion pass thread CPU: min {min(times) * 1e3:.1f} ms of {args.rounds} runs "
              f"(inside grappler, the capturing run: {cb})")
        same = run_once(cap)[1].serialize() == cap.output
        print(f"  replayed output {'identical to' if same else 'DIFFERS from'} the pass's output inside grappler")
        res = {"graph": name, "nodes": cap.nodes, "fusion_s": min(times), "replay_identical": same}
        if args.breakdown:
            breakdown(cap, args.rounds)
        res["ab"] = [ab(cap, p, args.rounds) for p in args.ab]
        results.append(res)
    return results


if __name__ == "__main__":
    main()
