"""The HTML precision map on real-size training graphs, in headless Chromium.

Graphs (built, rewritten by our pipeline, never run):
  * TF-Slim ``resnet_v1_50`` + momentum (TF1 training MetaGraph, ~6.2k nodes);
  * the BERT-base-like encoder of benchmarks/precision.py (12 layers, hidden
    768) + Adam (~9-10k nodes).

Printed per graph: nodes, page size, Python time to write the page, and in
headless Chromium (DevTools protocol, 1200x800 window, fresh page per run):
load-to-interactive (``performance.now()`` when the page has drawn, laid out
and bound its handlers; median of ``--repeat`` runs), boxes drawn, and the time
a search for a deep node takes to open its scopes and centre it.  Goal:
interactive in < 2 s.  Times are printed, never asserted.

    python benchmarks/report_html.py [--graphs resnet50,bert] [--repeat 3] [--png docs/precision_map_resnet50.png]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import tensorflow as tf  # noqa: E402

from chromium_cdp import Chromium  # noqa: E402  (tests/chromium_cdp.py)

v1 = tf.compat.v1


def slim_resnet50_training():
    from real_models import import_slim

    slim = import_slim()
    from tf_slim.nets import resnet_v1

    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [8, 224, 224, 3], name="images")
        y = v1.placeholder(tf.int32, [8], name="labels")
        with slim.arg_scope(resnet_v1.resnet_arg_scope()):
            logits, _ = resnet_v1.resnet_v1_50(x, 1000, is_training=True)
        loss = v1.losses.sparse_softmax_cross_entropy(y, tf.squeeze(logits, [1, 2]))
        train = v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train")
        v1.add_to_collection("train_op", train)
        v1.train.Saver()
        v1.global_variables_initializer()
    return g, "resnet_v1_50/block3/unit_4/bottleneck_v1/conv2/Conv2D"


def bert_training():
    from precision import bert_training_graph

    g, fetches = bert_training_graph()
    with g.as_default():
        v1.add_to_collection("train_op", g.get_operation_by_name(fetches[1]))
        v1.train.Saver()
        v1.global_variables_initializer()
    return g, "layer_7/intermediate/MatMul"


def bench(name, graph, probe, repeat, png=None):
    from npu_amp_tf import cli

    d = tempfile.mkdtemp(prefix="npu_amp_html_")
    slug = name.split(" (")[0].replace(" + ", "_").replace(" ", "_").replace("(", "").replace(")", "")
    meta = os.path.join(d, f"{slug}.meta")
    with graph.as_default():
        v1.train.export_meta_graph(meta, graph=graph)
    n = len(graph.as_graph_def().node)
    page = os.path.join(d, "map.html")
    t0 = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(d)  # the page's title names the model file, not the temporary directory
    try:
        rc = cli.main(["report", os.path.basename(meta), "--html", page, "--limit", "0"])
    finally:
        os.chdir(cwd)
    t_write = time.perf_counter() - t0
    assert rc == 0
    ready, search, drawn = [], [], None
    for _ in range(repeat):
        with Chromium(width=1200, height=800) as c:
            ready.append(c.open("file://" + page))
            errors = c.errors()
            drawn = c.eval("document.getElementById('stat').textContent")
            t = c.eval(f"(function(){{var t=performance.now();npuAmpSearch({probe!r});return performance.now()-t;}})()")
            search.append(t)
            if png and not os.path.exists(png):
                c.eval("(function(){var q=document.getElementById('q');q.value='';npuAmpSearch('');"
                       "document.getElementById('fit').click();})()")
                c.screenshot(png)
    print(f"{name}: {n} nodes, page {os.path.getsize(page) / 1e6:.1f} MB, report+page written in {t_write:.1f} s "
          f"(incl. the rewrite)")
    print(f"  load-to-interactive (median of {repeat}): {statistics.median(ready):.0f} ms "
          f"[{', '.join(f'{r:.0f}' for r in ready)}]  goal < 2000 ms: "
          f"{'met' if statistics.median(ready) < 2000 else 'MISSED'}")
    print(f"  {drawn}; search '{probe}' opens its scopes and centres it in {statistics.median(search):.0f} ms; "
          f"console errors: {len(errors)}")
    return statistics.median(ready)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", default="resnet50,bert")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--png", help="save the ResNet-50 map's first screen here")
    args = ap.parse_args(argv)
    print(f"TensorFlow {tf.__version__}")
    for name in args.graphs.split(","):
        if name == "resnet50":
            g, probe = slim_resnet50_training()
            bench("TF-Slim ResNet-50 + Momentum (training)", g, probe, args.repeat, args.png)
        elif name == "bert":
            g, probe = bert_training()
            bench("BERT-base-like (12 layers) + Adam (training)", g, probe, args.repeat)
        else:
            ap.error(f"--graphs: unknown graph '{name}'; accepted: resnet50, bert")


if __name__ == "__main__":
    main()
