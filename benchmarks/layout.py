"""Layout pass benchmark: pass time on the ResNet-50 training graph and the
TransData count before and after symmetry elimination / breadth fusion.
Prints a table; never asserts a time.

    .venv/bin/python benchmarks/layout.py [--hw 32] [--batch 2] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import graph_passes.layout  # noqa: E402,F401  (registers "layout")
from graph_passes.manager import run_passes  # noqa: E402

import layout_graphs as lg  # noqa: E402


def measure(name, gd, repeat):
    opts = SimpleNamespace(format_mode="NC1HWC0", variable_format_optimize=False)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out, rep = run_passes(gd, ["layout"], opts)
        times.append(time.perf_counter() - t0)
    s = rep.summary
    after = s["transdata_activation"] + s["transdata_filter"] + s["transdata_per_channel"]
    return {"graph": name, "nodes": len(gd.node), "pass_s": min(times),
            "naive": s["transdata_before_elimination"], "after": after,
            "act": s["transdata_activation"], "filter": s["transdata_filter"],
            "chan": s["transdata_per_channel"], "lowering": s["transdata_lowering"],
            "waste": s.get("padding_waste_flops", 0), "padded": s.get("padded_flops", 0)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hw", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    rows = [measure("resnet50 training", lg.resnet50_training(a.hw, a.batch), a.repeat),
            measure("resnet50 inference", lg.resnet50_inference(a.hw, 1)[0], a.repeat)]
    hdr = ("graph", "nodes", "pass s", "TD naive", "TD after", "ratio", "act", "filter", "per-chan",
           "lowering", "pad waste GFLOP", "waste %")
    print("  ".join(f"{h:>15}" if i else f"{h:<20}" for i, h in enumerate(hdr)))
    for r in rows:
        vals = (r["graph"], r["nodes"], f"{r['pass_s']:.3f}", r["naive"], r["after"],
                f"{r['naive'] / max(r['after'], 1):.1f}x", r["act"], r["filter"], r["chan"], r["lowering"],
                f"{r['waste'] / 1e9:.3f}", f"{100 * r['waste'] / max(r['padded'], 1):.1f}")
        print("  ".join(f"{str(v):>15}" if i else f"{str(v):<20}" for i, v in enumerate(vals)))
    print(f"(input {a.hw}x{a.hw}, training batch {a.batch}; 'lowering' TransData only exist for the CPU "
          "emulation and are not counted in 'after')")


if __name__ == "__main__":
    main()
