"""Issue 17r: the grappler bridge's C++ steps around the Python callback, A/B.

Runs our plugin alone through grappler (``benchmarks/precision.py``'s graphs and
config) with the bridge's fast paths off (the reference: ``bridge.INDEX_FROM_BYTES``,
``bridge.MOVE_ITEM_NODES``, ``pipeline.OWN_PARSE`` False) and on, interleaved in
one process, and prints per mode the minimum thread CPU of each C++ step
(``bridge.step_times()``), of the callback's record and its stages, and
grappler's own logged wall time for the optimizer; it checks that grappler's
outputs (bytes) and the reports (timings stripped) are identical.  Times are
printed, never asserted.

    python benchmarks/bridge_steps.py [--graphs resnet50,bert] [--repeat 7] [--group 17r|17u]

``--group 17u`` (issue 17u) toggles instead ``bridge.FAST_INDEX``,
``bridge.PRECHECK_FROM_INDEX``, ``bridge.SHARED_FINGERPRINT``,
``Graph.numpy_adopt`` and ``Graph.fast_patch`` (17r's switches stay on);
``--group paint`` (issue 17, stop 38) ``bridge.BASE_PAINT_STRINGS`` (the
precision pass's painting strings with the unchanged nodes' inputs read from
the item in C++); ``--group serialize`` (stop 42) the bridge's own writer of
the item's bytes (``bridge.set_serialize_fast``).
"""
import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TF_CPP_VMODULE", "meta_optimizer=1")
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_here, ".."), _here, os.path.join(_here, "..", "tests")]

import precision as P  # noqa: E402

from graph_passes.graph import Graph  # noqa: E402
from npu_amp_tf import bridge, pipeline  # noqa: E402

class _SerializeSwitch:
    """``--group serialize`` (issue 17, stop 42): the C++ bridge's own writer
    of the item's bytes (``bridge.set_serialize_fast``) vs the generated
    code's deterministic serialization."""

    def __setattr__(self, name, value):
        bridge.set_serialize_fast(value)


MODES = {"ref": False, "fast": True}
GROUPS = {"17r": ((bridge, "INDEX_FROM_BYTES"), (bridge, "MOVE_ITEM_NODES"), (pipeline, "OWN_PARSE")),
          "17u": ((bridge, "FAST_INDEX"), (bridge, "PRECHECK_FROM_INDEX"),
                  (bridge, "SHARED_FINGERPRINT"), (Graph, "numpy_adopt"), (Graph, "fast_patch")),
          "paint": ((bridge, "BASE_PAINT_STRINGS"),),
          "serialize": ((_SerializeSwitch(), "fast"),)}
_group = GROUPS["17r"]


def _set(on):
    for obj, name in _group:
        setattr(obj, name, on)


def _strip(o):
    if isinstance(o, dict):
        return {k: _strip(v) for k, v in o.items()
                if not (k.endswith("_s") or k in ("shapes_inferred_in_pipeline", "precision_paint"))}
    if isinstance(o, list):
        return [_strip(v) for v in o]
    return o


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", default="resnet50,bert")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--group", choices=sorted(GROUPS), default="17r")
    a = ap.parse_args(argv)
    global _group
    _group = GROUPS[a.group]
    for gname in a.graphs.split(","):
        g, f = P.resnet50_training_graph() if gname == "resnet50" else P.bert_training_graph()
        mg, cfg = P.metagraph(g, f), P.grappler_config("ours")
        rows = {m: [] for m in MODES}
        digests = {m: set() for m in MODES}
        for r in range(a.repeat):
            for m in (list(MODES) if r % 2 else list(MODES)[::-1]):
                _set(MODES[m])
                bridge.clear_reports()
                out, logged = P._optimize_logged(cfg, mg)
                rec = [x for x in bridge.last_reports() if x["status"] == "rewritten"][-1]
                rows[m].append((bridge.step_times(), rec["cpu_s"],
                                rec["report"]["summary"].get("stages_cpu_s", {}),
                                logged.get("NpuAmpOptimizer", float("nan"))))
                digests[m].add(hashlib.sha1(out.SerializeToString(deterministic=True)).hexdigest()
                               + hashlib.sha1(json.dumps(_strip(rec["report"]), sort_keys=True,
                                                         default=str).encode()).hexdigest())
        _set(True)
        same = digests["ref"] == digests["fast"] and len(digests["ref"]) == 1
        print(f"== {gname}: {rec['nodes']} nodes, load {os.getloadavg()[0]:.2f}, {a.repeat} rounds; "
              f"outputs and reports {'identical' if same else 'DIFFER'}")
        for m, rr in rows.items():
            steps = {k: round(min(x[0][k] for x in rr) * 1e3, 1) for k in rr[0][0]}
            outside = min(x[0]["total"] - x[0]["callback"] for x in rr) * 1e3
            stages = {k: round(min(x[2].get(k, 0) for x in rr) * 1e3, 1) for k in rr[0][2]}
            print(f"  {m:4s} C++ steps (thread CPU min, ms): {steps}")
            cb, logged = min(x[1] for x in rr) * 1e3, min(x[3] for x in rr)
            print(f"  {m:4s} Optimize() minus callback {outside:.1f} ms; callback record "
                  f"{cb:.1f} ms; grappler's log (wall) {logged:.1f} ms")
            print(f"  {m:4s} stages: {stages}")


if __name__ == "__main__":
    main()
