"""Instructions executed (valgrind's callgrind): ours vs grappler's AMP pass,
a pass's replay, and A/B of a switch, free of this host's noise (issue 17).

Times on this 2-core VM swing by tens of percent between runs of the same
graph (the same warm callback has read 63 ms in one process and 104 ms in
the next), and the VM exposes no hardware counters (``perf stat -e
instructions`` counts nothing).  Callgrind counts the guest instructions a
program executes: the same for the same binary, input and environment,
whatever the neighbours do (seen here: counts of repeated runs within
0.1%).  Instructions are not time (Python's interpreter and grappler's C++
retire different numbers of instructions per cycle, and cache misses cost
nothing here): the figures complement ``precision.py``'s times, and they
resolve A/B differences far below the host's noise.

Counted, per graph (``precision.py``'s graphs and grappler configs):

* ``amp``: instructions inside ``tensorflow::grappler::AutoMixedPrecision::Optimize``
  (callgrind ``--toggle-collect``) in ``OptimizeGraph`` with only
  ``auto_mixed_precision_cpu`` on: grappler's AMP pass alone, what its log's
  timer measures;
* ``ours``: inside ``NpuAmpOptimizer::Optimize`` (the bridge: serialise, the
  Python pipeline, parse back) with only the plugin on;
* ``--ab SWITCH``: ``ours`` with the switch (a dotted True/False attribute,
  ``A+B`` flips several, as in ``fusion_pass.py``) True and False, and
  whether the two output graphs are byte-identical;
* ``--stages``: ``ours`` split at the pipeline's and the pass manager's own
  timers (``stages`` in ``pipeline._optimize_run``: graph, passes,
  serialize, opdef_check; each pass), a dump at every boundary;
* ``--replay fusion|precision``: the pass alone on the input it received
  inside grappler (``fusion_pass.py`` / ``precision_pass.py``'s replay,
  collector paused, between client requests; the fresh graph is built
  outside the count); with ``--ab``, per arm, and whether graphs, stats and
  report entries are identical.

The C++ index, which the bridge builds on a helper thread in production
(``bridge.INDEX_IN_BACKGROUND``), is built on the callback's thread in the
child, so that the counts hold all of the work (callgrind's
``--toggle-collect`` counts the thread inside ``Optimize``).

Every counted configuration runs once uncounted first (lazy imports, caches,
the op library); ``--cold`` empties the engine's memo caches (``functools.lru_cache``
of ``parse_tensor``, ``is_autodiff_name``...) before every run, counted or not, as in a
process's first callback.  The script re-runs itself under ``valgrind --tool=callgrind
--instr-atstart=no`` with ``PYTHONHASHSEED=0`` (string hashes, hence set
orders, fixed): instrumentation starts after TensorFlow is imported and the
graphs are built, through client requests a small C file compiled here
issues.  The same child runs natively first (one run per configuration):
valgrind's virtual CPU has no AVX-512, so TensorFlow would turn its oneDNN
path off under it, and the plugin's kernel checks read that state; the
callgrind child gets the native state pinned (``TF_ENABLE_ONEDNN_OPTS``) and
checks it, and the outputs counted are compared with the native ones (the
output graph's digest; for a replay, of graph, stats and report entries):
"identical to the native run's" is printed, or which differ.  Under
instrumentation everything runs ~50x slower: a BERT-12
``ours`` run takes ~40 s.  Needs ``valgrind``, its header
``valgrind/callgrind.h`` (Debian: ``valgrind``) and ``gcc``.  Counts are
printed, never asserted.

    python benchmarks/instructions.py --graphs resnet50,bert
    python benchmarks/instructions.py --graphs bert --stages --cold
    python benchmarks/instructions.py --graphs bert --replay fusion --ab graph_passes.fusion.grad_region.STOP_AT_DY
    python benchmarks/instructions.py --graphs bert --runs 1 --keep /tmp/cg
    python benchmarks/instructions.py --graphs bert --prefused     (ours on the graph our fusion pass
        leaves, as precision.py --prefused: the bound of a layer-norm fusion before the parse)
    callgrind_annotate --inclusive=yes /tmp/cg/cg.*.2          (the dump of the second counted run)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

#: the C++ functions whose instructions the end-to-end figures count
TOGGLES = {"amp": "tensorflow::grappler::AutoMixedPrecision::Optimize(*",
           "ours": "tensorflow::grappler::NpuAmpOptimizer::Optimize(*"}

MARKER_C = r"""
#include <valgrind/callgrind.h>
void npu_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void npu_cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void npu_cg_dump(const char *tag) { CALLGRIND_DUMP_STATS_AT(tag); }
void npu_cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""

_CHILD_ENV = "NPU_AMP_CG_MARKER"
#: the oneDNN state ("1" / "0") the native run had, which the callgrind child must have
_ONEDNN_ENV = "NPU_AMP_CG_ONEDNN"
_RESULT = "@@npu-cg "
_TRIGGER = "desc: Trigger: Client Request: "


class ToolMissing(SystemExit):
    pass


def build_marker(tmp: str) -> str:
    """Compile the client-request marker library into ``tmp``; its path."""
    for tool in ("valgrind", "gcc"):
        if shutil.which(tool) is None:
            raise ToolMissing(f"instructions.py: '{tool}' is not on PATH; it needs valgrind (Debian package "
                              f"'valgrind', with its header valgrind/callgrind.h) and gcc")
    src, lib = os.path.join(tmp, "marker.c"), os.path.join(tmp, "libnpu_cg_marker.so")
    with open(src, "w") as f:
        f.write(MARKER_C)
    res = subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, src], capture_output=True, text=True)
    if res.returncode != 0:
        raise ToolMissing("instructions.py: could not compile the callgrind marker (is valgrind/callgrind.h "
                          "installed? Debian package 'valgrind'):\n" + res.stderr.strip())
    return lib


def read_dumps(out_dir: str) -> dict:
    """{tag: instructions} from callgrind's dumps in ``out_dir`` (one file per
    ``CALLGRIND_DUMP_STATS_AT(tag)``: its ``desc: Trigger: Client Request:
    <tag>`` and ``summary:`` / ``totals:`` lines; the program-end dump has no tag)."""
    counts = {}
    for fn in sorted(os.listdir(out_dir)):
        if not fn.startswith("cg."):
            continue
        tag = total = None
        with open(os.path.join(out_dir, fn), errors="replace") as f:
            for line in f:
                if line.startswith(_TRIGGER):
                    tag = line[len(_TRIGGER):].strip()
                elif line.startswith(("summary:", "totals:")) and total is None:
                    total = int(line.split()[1])
                if tag is not None and total is not None:
                    break
        if tag is not None and total is not None:
            counts[tag] = total
    return counts


#: environment switches of debugging cross-checks, never on in production
#: (see graph_passes.fusion.grad_region.CHECK_NATIVE)
_CHECK_ENV = ("NPU_AMP_TF_CHECK_NATIVE_GRAD_REGION",)


def run_child(argv, tmp, lib, toggles=(), native=None) -> tuple[dict, list]:
    """This script under callgrind with ``argv``: ({tag: instructions}, [result dicts]).

    ``native``: the result dicts of the same child run natively (no
    valgrind; the client requests are no-ops there), or None for the native
    run itself.  Valgrind's CPU hides AVX-512, and TensorFlow turns its
    oneDNN path off on such a CPU unless ``TF_ENABLE_ONEDNN_OPTS`` says
    otherwise; the plugin's kernel checks read that state (registry's
    ``_BROKEN_WITH_ONEDNN``), so unpinned, the counted rewrite was not the
    native one (TF 2.21.0: one more ``bias`` fusion in ResNet50).  The
    callgrind child gets the native run's state pinned, and checks it."""
    out_dir = os.path.join(tmp, "dumps")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *argv]
    if native is not None:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={out_dir}/cg.%p", *(f"--toggle-collect={t}" for t in toggles), *cmd]
    env = dict(os.environ, PYTHONHASHSEED="0", TF_CPP_MIN_LOG_LEVEL="2")
    env[_CHILD_ENV] = lib
    # the production work only: the test suite's cross-check of every C++
    # gradient-region search against the Python one (tests/conftest.py) would
    # be counted too, and its Python search's work varies from run to run
    for var in _CHECK_ENV:
        env.pop(var, None)
    if native:
        state = "1" if native[0]["onednn"] else "0"
        env.update({"TF_ENABLE_ONEDNN_OPTS": state, _ONEDNN_ENV: state})
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    results = [json.loads(line[len(_RESULT):]) for line in res.stdout.splitlines() if line.startswith(_RESULT)]
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-15:])
        where = "natively" if native is None else "under callgrind"
        raise SystemExit(f"instructions.py: the run {where} failed (exit {res.returncode}):\n{tail}")
    return read_dumps(out_dir), results


def native_differences(native: list, counted: list) -> dict:
    """{graph: [labels whose output under callgrind is not the native run's]}
    (the digests of the output graphs, or of a replay's graph, stats and
    report entries)."""
    ref = {r["graph"]: r.get("digests", {}) for r in native}
    return {r["graph"]: sorted(k for k, d in r.get("digests", {}).items() if ref.get(r["graph"], {}).get(k) != d)
            for r in counted}


def _mi(n) -> str:
    return f"{n / 1e6:,.1f} M" if n is not None else "n/a"


def _spread(xs) -> str:
    return f"{(max(xs) - min(xs)) / min(xs) * 100:.2f}%" if len(xs) > 1 and min(xs) else "-"


# ------------------------------------------------------------------ the child (under callgrind)
class _StageTimer:
    """``time.thread_time`` for ``--stages``: the pipeline and the pass manager
    read it at every stage and pass boundary (``pipeline._optimize_run``'s
    ``stages``, ``PassManager.run``); during a counted ``ours`` run each read
    first dumps the instructions since the previous one, tagged with what the
    interval was, named from the reading line (``stages["graph"] = cpu() -
    c0``: "graph"; the manager's end of a pass: "pass fusion")."""

    def __init__(self, lib):
        import time

        self.lib, self.real, self.run, self.seq, self.in_pipeline = lib, time.thread_time, None, 0, False

    def start(self, run):
        """Count the boundaries of ``run`` ((graph, round)), or none (None)."""
        self.run, self.seq, self.in_pipeline = run, 0, False

    def __call__(self):
        if self.run is not None:
            import linecache
            import re

            frame = sys._getframe(1)  # noqa: SLF001
            fn = os.path.basename(frame.f_code.co_filename)
            text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            m = re.search(r'stages\["(\w+)"\]', text)
            if m is not None:
                label = m.group(1)
            elif fn == "manager.py":
                label = f"pass {frame.f_locals.get('name')}" if text.startswith("dt,") else "between passes"
            elif fn == "pipeline.py":
                label = "outside the stages" if self.in_pipeline else "callback entry (options, parse)"
                self.in_pipeline = True
            elif fn == "bridge.py" and "_cpu0" in text:
                label = "C++ bridge before the callback (serialise, index)"
            elif fn == "bridge.py" and frame.f_code.co_name == "_finish":
                label = "callback end (summary, report record)"
            else:
                label = f"{fn}:{frame.f_lineno}"
            graph, r = self.run
            self.lib.npu_cg_dump(f"{graph}|@{label}#{self.seq}|{r}".encode())
            self.seq += 1
        return self.real()


def _ours_label(args) -> str:
    """The label of ours' counted runs (before an A/B arm's "|on" / "|off")."""
    return "ours-prefused" if args.prefused else "ours"


def _child(args):
    import ctypes
    import hashlib
    import random

    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    import fusion_pass as fpb  # noqa: E402  (graphs, capture, replay, switches)
    import precision as pb  # noqa: E402
    from npu_amp_tf import bridge

    from graph_passes import _tf as tf_probe

    lib = ctypes.CDLL(os.environ[_CHILD_ENV])
    lib.npu_cg_dump.argtypes = [ctypes.c_char_p]
    onednn = tf_probe.onednn_enabled()
    want = os.environ.get(_ONEDNN_ENV)
    if want is not None and onednn != (want == "1"):
        raise SystemExit(f"instructions.py: TensorFlow's oneDNN path is {'on' if onednn else 'off'} under "
                         f"callgrind, {'on' if want == '1' else 'off'} natively (TF_ENABLE_ONEDNN_OPTS="
                         f"{os.environ.get('TF_ENABLE_ONEDNN_OPTS')!r} did not pin it): the counts would be "
                         f"of another rewrite")
    bridge.register()
    # every instruction of the callback's work on the thread callgrind counts
    # (--toggle-collect follows the thread inside Optimize): the C++ index,
    # built on a helper thread in production (bridge.INDEX_IN_BACKGROUND: a
    # wall-time overlap, the same work), is built on the callback's thread
    # here, unless --ab flips that switch itself; so are the early mirror of
    # the layer-norm run before the parse (bridge.EARLY_MIRROR: loaded by that
    # run), the second half of the item's bytes (written with the first) and
    # the second half of the OpDef pre-check's checks (checked with the first)
    bridge.INDEX_IN_BACKGROUND = False
    bridge.EARLY_MIRROR = False
    bridge.set_serialize_split(False)
    bridge.set_precheck_split(0)
    switches = [fpb._resolve(p) for p in args.ab.split("+")] if args.ab else []  # noqa: SLF001
    arms = [(True, "on"), (False, "off")] if switches else [(None, "")]

    def set_arm(val):
        if val is not None:
            for owner, attr in switches:
                setattr(owner, attr, val)

    def cold():
        """Empty the engine's memo caches (functools.lru_cache: parse_tensor,
        is_autodiff_name...), as in a process's first callback (``--cold``)."""
        if args.cold:
            for mod in [m for n, m in sys.modules.items() if n.split(".")[0] in ("graph_passes", "npu_amp_tf")]:
                for obj in list(vars(mod).values()):
                    if callable(getattr(obj, "cache_clear", None)):
                        obj.cache_clear()

    def emit(**kw):
        print(_RESULT + json.dumps(kw), flush=True)

    stage_timer = _StageTimer(lib)
    if args.stages:
        import time
        time.thread_time = stage_timer

    for name in args.graphs.split(","):
        # (the initializers' seeds are constants of the graph: fixed, so that
        # the native run and the callgrind run build the same graph)
        random.seed(0)
        np.random.seed(0)
        tf.random.set_seed(0)
        graph, fetches = fpb.build(name, args.bert_layers)
        if args.replay:
            if args.replay == "fusion":
                cap, cls = fpb.capture(name, graph, fetches), fpb._fp.FusionPass  # noqa: SLF001
                outcome = fpb.outcome
            else:
                import precision_pass as ppb
                cap, outcome = ppb.capture(name, graph, fetches), ppb.outcome
                cls = ppb._amp.PrecisionPass  # noqa: SLF001

            def once(val, tag=None):
                set_arm(val)
                g, ctx = cap.make()
                cold()
                with fpb.collector_paused():
                    if tag:
                        lib.npu_cg_toggle()
                    stats = cls().run(g, ctx)
                    if tag:
                        lib.npu_cg_toggle()
                        lib.npu_cg_dump(tag.encode())
                return outcome(g, ctx, stats)

            for val, _ in arms:
                once(val)  # uncounted
            lib.npu_cg_start()
            outs = {}
            for r in range(args.runs):
                for val, arm in arms:
                    out = once(val, f"{name}|{args.replay}{'|' + arm if arm else ''}|{r}")
                    outs.setdefault(arm, out)
            lib.npu_cg_stop()
            same = None
            if switches:
                a, b = outs["on"], outs["off"]
                same = [p for p, x, y in zip(("graph", "stats", "decisions", "warnings", "summary"), a, b) if x != y]
            digests = {f"{args.replay}{'|' + arm if arm else ''}": hashlib.sha256(repr(out).encode()).hexdigest()
                       for arm, out in outs.items()}
            emit(graph=name, nodes=cap.nodes, differ=same, digests=digests, onednn=onednn)
            continue
        mg = pb.metagraph(graph, fetches)
        # (--prefused: ours counted on the graph our fusion pass leaves, built
        # here uncounted; grappler's AMP pass on the graph itself)
        mg_ours = pb.prefused_input(graph, fetches)[0] if args.prefused else mg
        modes = [("amp", None, "amp")] + [("ours", val, _ours_label(args) + (f"|{arm}" if arm else ""))
                                         for val, arm in arms]

        def optimize(mode, val):
            set_arm(val)
            bridge.clear_reports()  # no memo: every run does the full work
            cold()
            out = pb.tf_optimizer.OptimizeGraph(pb.grappler_config(mode), mg_ours if mode == "ours" else mg,
                                                graph_id=b"bench")
            return hashlib.sha256(out.SerializeToString(deterministic=True)).hexdigest()

        for mode, val, _ in modes:
            optimize(mode, val)  # uncounted
        lib.npu_cg_start()
        digests = {}
        for r in range(args.runs):
            for mode, val, label in modes:
                stage_timer.start((name, r) if args.stages and mode == "ours" else None)
                try:
                    digests.setdefault(label, set()).add(optimize(mode, val))
                finally:
                    stage_timer.start(None)
                lib.npu_cg_dump(f"{name}|{label}|{r}".encode())
        lib.npu_cg_stop()
        emit(graph=name, nodes=len(mg.graph_def.node),
             differ=None if not switches else (digests["ours|on"] != digests["ours|off"]),
             digests={k: sorted(v)[0] if len(v) == 1 else "runs differ" for k, v in digests.items()},
             onednn=onednn)


# ------------------------------------------------------------------ the parent
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graphs", default="resnet50,bert")
    ap.add_argument("--bert-layers", type=int, default=12)
    ap.add_argument("--runs", type=int, default=2, help="counted runs per configuration")
    ap.add_argument("--replay", choices=("fusion", "precision"), default=None)
    ap.add_argument("--ab", default=None, metavar="SWITCH",
                    help="dotted path of a True/False switch ('A+B' flips several together)")
    ap.add_argument("--stages", action="store_true",
                    help="split ours by the pipeline's stages and passes (their own timers as boundaries)")
    ap.add_argument("--cold", action="store_true",
                    help="empty the engine's memo caches (lru_cache) before every run, as in a first callback")
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="copy callgrind's dumps (one per counted run, tagged) to DIR, for callgrind_annotate")
    ap.add_argument("--prefused", action="store_true",
                    help="count ours on the graph our fusion pass leaves (precision.py --prefused: the same "
                         "output), grappler's AMP pass on the graph itself")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for g in args.graphs.split(","):
        if g not in ("resnet50", "bert"):
            ap.error(f"--graphs: unknown graph '{g}'; accepted: resnet50, bert")
    if args.stages and (args.ab or args.replay):
        ap.error("--stages: splits the end-to-end 'ours' runs; not with --ab or --replay")
    if args.prefused and (args.ab or args.replay):
        ap.error("--prefused: counts the end-to-end runs of ours on the pre-fused graph; not with --ab or "
                 "--replay")
    if args.runs < 1:
        ap.error(f"--runs: {args.runs}; accepted: an integer >= 1")
    if args.child:
        return _child(args)
    passthrough = ["--graphs", args.graphs, "--bert-layers", str(args.bert_layers)]
    passthrough += ["--replay", args.replay] if args.replay else []
    passthrough += ["--ab", args.ab] if args.ab else []
    passthrough += ["--cold"] if args.cold else []
    passthrough += ["--stages"] if args.stages else []
    passthrough += ["--prefused"] if args.prefused else []
    with tempfile.TemporaryDirectory(prefix="npu_cg_") as tmp:
        lib = build_marker(tmp)
        toggles = () if args.replay else tuple(TOGGLES.values())
        _, native = run_child(passthrough + ["--runs", "1"], tmp, lib)
        counts, results = run_child(passthrough + ["--runs", str(args.runs)], tmp, lib, toggles, native=native)
        differ_native = native_differences(native, results)
        if args.keep:
            shutil.copytree(os.path.join(tmp, "dumps"), args.keep, dirs_exist_ok=True)
    onednn = "on" if native[0]["onednn"] else "off"
    print(f"Instructions executed (callgrind, PYTHONHASHSEED=0; {args.runs} counted run(s) per configuration, "
          f"after one uncounted; TensorFlow's oneDNN path {onednn}, as natively)")
    summary = []
    for res in results:
        name = res["graph"]
        per, stages, first = {}, {}, {}
        for tag, n in counts.items():
            g, *label, r = tag.split("|")
            if g != name:
                continue
            label = "|".join(label)
            if label.startswith("@"):  # --stages: one interval of an ours run
                stage, seq = label[1:].rsplit("#", 1)
                first[stage] = min(first.get(stage, 1 << 30), int(seq))
                by_run = stages.setdefault(stage, {})
                by_run[r] = by_run.get(r, 0) + n
                continue
            per.setdefault(label, []).append((r, n))
        stages = dict(sorted(stages.items(), key=lambda kv: first[kv[0]]))  # in the order a run meets them
        ours_key = _ours_label(args)
        if stages and ours_key in per:
            # the tail after the last stage timer is the "ours" dump: the run's total adds the intervals
            tail = dict(per[ours_key])
            stages["C++ assembly of the output"] = tail
            per[ours_key] = [(r, sum(v.get(r, 0) for v in stages.values())) for r in tail]
        per = {k: [n for _, n in v] for k, v in per.items()}
        print(f"\n== {name}: {res['nodes']} nodes")
        bad = differ_native.get(name)
        print("  outputs under callgrind: " + (f"DIFFER from the native run's for {', '.join(bad)}: these "
                                                 f"counts are of another rewrite" if bad else
                                                 "identical to the native run's"))
        for label, xs in per.items():
            print(f"  {label:<22} {_mi(min(xs)):>14}  (spread over runs {_spread(xs)})")
        if stages:
            total = min(per[ours_key])
            print("  ours by stage (the pipeline's and the pass manager's own timers as boundaries; min over runs):")
            for label, by_run in stages.items():
                n = min(by_run.values())
                print(f"    {label:<52} {_mi(n):>12}  {n / total * 100:5.1f}%")
        row = {"graph": name, "counts": {k: min(v) for k, v in per.items()}, "runs": per,
               "native_identical": not bad, "onednn": res["onednn"],
               "stages": {k: min(v.values()) for k, v in stages.items()}}
        c = row["counts"]
        if "amp" in c:
            for label in [k for k in c if k.startswith("ours")]:
                print(f"  {label} / amp: {c[label] / c['amp']:.2f}x  (goal <= 1.0x by time; "
                      f"instructions are not time)")
        if args.ab:
            on, off = (next(v for k, v in c.items() if k.endswith("|on")),
                       next(v for k, v in c.items() if k.endswith("|off")))
            differ = res.get("differ")
            same = "identical" if not differ else f"DIFFER ({differ})" if isinstance(differ, list) else "DIFFER"
            print(f"  {args.ab}: True {_mi(on)} vs False {_mi(off)}: {(on - off) / off * 100:+.2f}% for True; "
                  f"outputs {same}")
            row["identical"] = not differ
        summary.append(row)
    return summary


if __name__ == "__main__":
    main()
