"""The precision pass alone, on the graph it gets inside grappler: thread CPU,
per part, cProfile, and interleaved A/B of a True/False switch.

Issue 17 (helper 17t), the precision pass's twin of ``fusion_pass.py``: the
plugin runs once through grappler (``precision.py``'s graphs and config:
``OptimizeGraph``, plugin alone, ``precision_mode=allow_mix_precision``), the
graph and pass context the precision pass received (after fusion) are kept,
and ``PrecisionPass.run`` runs again on a fresh ``Graph`` built from those
bytes with a C++ index of them, the shape source and the native painting
entry point the callback uses: thread CPU (``time.thread_time``) of
``PrecisionPass.run`` only, the collector paused as in the pipeline,
minimum over rounds.  (The fresh index gives
every node a signature class, where inside grappler the nodes fusion made
or edited have none: the replay's output is compared with the pass's output
inside grappler and the comparison printed.)

    python benchmarks/precision_pass.py --graphs bert,resnet50 --rounds 7
    python benchmarks/precision_pass.py --graphs resnet50 --parts
    python benchmarks/precision_pass.py --graphs bert --profile 20
    python benchmarks/precision_pass.py --graphs bert --ab graph_passes.precision.amp.PrecisionPass.bulk_casts

``--parts``: thread CPU of the pass's steps (min over rounds, each step's
own minimum).  ``--ab PATH``: the switch at ``PATH`` True vs False,
interleaved, and whether the two give byte-identical graphs, stats, report
decisions, warnings and the deferred summary.  ``--precision MODE`` /
``--low bf16``: other modes (replayed with the captured options replaced).
Times are printed, never asserted.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import io
import os
import pstats
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16"] = "0"

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import tensorflow as tf  # noqa: E402

import fusion_pass as _fpb  # noqa: E402  (graphs, capture, switch paths)
from graph_passes.graph import Graph  # noqa: E402
from graph_passes.precision import amp as _amp  # noqa: E402
from graph_passes.precision import native as _native  # noqa: E402


class Captured(_fpb.Captured):
    """What the precision pass received inside grappler (bytes, options,
    fetches, preserved nodes, devices) and what it left there."""

    def make(self, options=None):
        from npu_amp_tf import pipeline

        graph, ctx = super().make(options)
        ctx.native_paint = pipeline.native_paint_entry()
        return graph, ctx


def capture(name, graph, fetches) -> Captured:
    return _fpb.capture(name, graph, fetches, pass_cls=_amp.PrecisionPass, label="precision", cls=Captured)


def run_once(cap, options=None):
    graph, ctx = cap.make(options)
    with _fpb.collector_paused():
        c0 = time.thread_time()
        stats = _amp.PrecisionPass().run(graph, ctx)
        t = time.thread_time() - c0
    return t, graph, ctx, stats


def outcome(graph, ctx, stats):
    """What must not change: graph bytes, stats, decisions, warnings and the
    deferred summary (computed here, after the timing)."""
    ctx.report.summary  # noqa: B018  (runs the deferred figures)
    st = dict(stats)
    return (graph.serialize(), repr(sorted(st.items(), key=str)), repr(ctx.report.decisions),
            repr(ctx.report.warnings), repr(sorted(ctx.report.raw_summary.items(), key=str)))


PARTS = [
    (_native, "paint"), (_native, "_apply"), (_native, "_apply_bulk"), (_native, "_flags_batched"),
    (_amp.PrecisionPass, "_adapt_casts"), (_amp.PrecisionPass, "_convert_consts"),
    (_amp.PrecisionPass, "_fix_edges"), (_amp.PrecisionPass, "_delay_widening_casts"),
    (_amp.PrecisionPass, "_finish"), (_amp, "_usable_classes"), (_amp._Snapshot, "__init__"),
    (Graph, "topo_order"), (Graph, "topo_positions"),
]


def parts(cap, rounds, options=None):
    best = collections.defaultdict(lambda: float("inf"))
    saved = []
    acc = collections.defaultdict(float)

    def timed(key, fn):
        def wrapper(*a, **k):
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.thread_time() - c0
        return wrapper

    for owner, attr in PARTS + [(_amp.PrecisionPass, "_bulk_casts")]:
        fn = owner.__dict__.get(attr)
        if fn is None:
            continue
        saved.append((owner, attr, fn))
        setattr(owner, attr, timed(attr, fn))
    try:
        for _ in range(rounds):
            acc.clear()
            t, *_ = run_once(cap, options)
            best["whole pass"] = min(best["whole pass"], t)
            for k, v in acc.items():
                best[k] = min(best[k], v)
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    for k, v in best.items():
        print(f"    {k:28} {v * 1e3:7.1f} ms")


def profile(cap, n, options=None):
    pr = cProfile.Profile()
    for _ in range(n):
        graph, ctx = cap.make(options)
        with _fpb.collector_paused():
            pr.enable()
            _amp.PrecisionPass().run(graph, ctx)
            pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
    print(s.getvalue())


def ab(cap, path, rounds, options=None):
    switches = [_fpb._resolve(p) for p in path.split("+")]
    saved = [getattr(o, a) for o, a in switches]
    times = {True: [], False: []}
    outs = {}
    try:
        for r in range(rounds):
            for val in ((True, False) if r % 2 else (False, True)):
                for o, a in switches:
                    setattr(o, a, val)
                t, graph, ctx, stats = run_once(cap, options)
                times[val].append(t)
                out = outcome(graph, ctx, stats)
                if outs.setdefault(val, out) != out:
                    outs[val] = None
    finally:
        for (o, a), v in zip(switches, saved):
            setattr(o, a, v)
    same = outs[True] is not None and outs[True] == outs[False]
    differ = ""
    if not same and outs[True] is not None and outs[False] is not None:
        names = ("graph", "stats", "decisions", "warnings", "summary")
        differ = " (" + ", ".join(p for p, a, b in zip(names, outs[True], outs[False]) if a != b) + ")"
    on, off = min(times[True]), min(times[False])
    print(f"  {path}: True {on * 1e3:.1f} ms vs False {off * 1e3:.1f} ms (min of {rounds}, interleaved): "
          f"{(off - on) * 1e3:+.1f} ms for True; graphs, stats and report "
          f"{'identical' if same else 'DIFFER' + differ}")
    return {"switch": path, "on_s": on, "off_s": off, "identical": same}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graphs", default="bert,resnet50")
    ap.add_argument("--bert-layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--precision", default=None, help="replay with this precision_mode")
    ap.add_argument("--ab", action="append", default=[], metavar="SWITCH")
    args = ap.parse_args(argv)
    print(f"TensorFlow {tf.__version__}; load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs")
    results = []
    for name in args.graphs.split(","):
        cap = capture(name, *_fpb.build(name, args.bert_layers))
        options = None
        if args.precision:
            from npu_amp_tf.options import Options

            options = Options.from_kwargs(**dict(cap.options.rewrite_params(), precision_mode=args.precision))
        times = [run_once(cap, options)[0] for _ in range(args.rounds)]
        label = f"BERT-like {args.bert_layers} layers" if name == "bert" else "Keras ResNet50"
        cb = f"{cap.callback_cpu_s * 1e3:.1f} ms" if cap.callback_cpu_s is not None else "n/a"
        print(f"\n== {label} training graph, precision pass input {cap.nodes} nodes")
        print(f"  precision pass thread CPU: min {min(times) * 1e3:.1f} ms of {args.rounds} runs "
              f"(inside grappler, the capturing run: {cb})")
        if options is None:
            same = run_once(cap)[1].serialize() == cap.output
            print(f"  replayed output {'identical to' if same else 'DIFFERS from'} the pass's output inside grappler")
        if args.parts:
            parts(cap, args.rounds, options)
        if args.profile:
            profile(cap, args.profile, options)
        res = {"graph": name, "nodes": cap.nodes, "precision_s": min(times)}
        res["ab"] = [ab(cap, p, args.rounds, options) for p in args.ab]
        results.append(res)
    return results


if __name__ == "__main__":
    main()
