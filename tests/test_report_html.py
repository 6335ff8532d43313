"""The HTML precision map (``npu-amp report --html``) in real headless Chromium,
on model code nobody here wrote: a TF-Slim ResNet-50 training MetaGraph, a
two-conv ``tf.compat.v1.layers`` training graph and a Keras MobileNetV2
SavedModel (its layers live in function bodies).

Each case: the page loads without console errors; the first screenshot shows
the FP16 colour inside the boxes of conv/matmul layers in the initial
viewport; typing a node name into the search box brings that node into view;
load-to-interactive time is printed (goals are checked in
benchmarks/report_html.py, never asserted here).
"""
import sys

import pytest
import tensorflow as tf

from chromium_cdp import Chromium, count_color, find_chromium, png_pixels
from conftest import keras2

v1 = tf.compat.v1
FP16 = (0xf2, 0x8e, 0x2b)   # report.COLORS["float16"]
W, H = 1200, 800



def report_html(capsys, model, out):
    from npu_amp_tf import cli

    rc = cli.main(["report", str(model), "--html", str(out), "--limit", "0"])
    text = capsys.readouterr().out
    assert rc == 0, text
    page = out.read_text()
    assert "https://" not in page and "<script src" not in page  # one self-contained offline file
    return text


@pytest.fixture(scope="module")
def browser():
    if find_chromium() is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    with Chromium(width=W, height=H) as c:
        yield c


def open_page(browser, path, capsys, label):
    browser.events.clear()
    ready_ms = browser.open(path.as_uri())
    stat = browser.eval("document.getElementById('stat').textContent")
    with capsys.disabled():
        print(f"\n[precision map] {label}: load-to-interactive {ready_ms:.0f} ms ({stat})")
    assert browser.errors() == []
    return ready_ms


def fp16_in_box(browser, tmp_path, names):
    """Screenshot; for each name, the FP16 pixels inside its drawn box (or the
    box of the scope it is folded into), which must lie in the viewport."""
    px = png_pixels(browser.screenshot(tmp_path / "shot.png"))
    assert px[:2] == (W, H)
    out = {}
    for name in names:
        box = browser.eval(f"npuAmpBox({name!r})")
        assert box is not None, name
        view = browser.eval("(function(){var r=document.getElementById('view').getBoundingClientRect();"
                            "return [r.left,r.top,r.right,r.bottom];})()")
        # the box lies (at least partly) in the initial viewport
        assert box["x"] < view[2] and box["x"] + box["w"] > view[0], (name, box, view)
        assert box["y"] < view[3] and box["y"] + box["h"] > view[1], (name, box, view)
        clip = (max(box["x"], view[0]), max(box["y"], view[1]),
                min(box["x"] + box["w"], view[2]), min(box["y"] + box["h"], view[3]))
        out[name] = (count_color(px, FP16, clip), box)
    return px, out


def search_brings_into_view(browser, name):
    browser.eval("(function(){var q=document.getElementById('q');q.value='';q.focus();})()")
    browser.type_text(name)
    browser.press("Enter", vk=13)
    hit = browser.eval("""(function(){var e=document.querySelector('#vp .hit');if(!e)return null;
        var r=e.getBoundingClientRect(),v=document.getElementById('view').getBoundingClientRect(),
        i=+e.getAttribute('data-i'),NG=DATA.G.length;
        return {name:i<NG?DATA.G[i][0]:DATA.N[i-NG][0],cls:i<NG?null:DATA.classes[DATA.N[i-NG][2]],
                x:r.left+r.width/2,y:r.top+r.height/2,w:r.width,v:[v.left,v.top,v.right,v.bottom]};})()""")
    assert hit is not None, name
    assert hit["name"] == name
    assert hit["v"][0] <= hit["x"] <= hit["v"][2] and hit["v"][1] <= hit["y"] <= hit["v"][3], hit
    assert hit["w"] > 40  # readable, not a speck
    return hit


def drawn_leaves(browser):
    return browser.eval("""Array.from(document.querySelectorAll('#vp .it')).map(function(e){
        var i=+e.getAttribute('data-i'),NG=DATA.G.length;return i<NG?null:DATA.N[i-NG];}).filter(Boolean)""")


# --------------------------------------------------------------------------
# two-conv tf.compat.v1.layers training graph
# --------------------------------------------------------------------------
def v1_layers():
    """``tf.compat.v1.layers`` (conv2d, dense): on TF >= 2.16 tf.compat.v1.layers
    refuses under Keras 3, so take the same legacy modules from tf_keras."""
    try:
        return v1.layers.conv2d, v1.layers.dense
    except AttributeError:
        from real_models import import_slim

        import_slim()  # aliases tf_keras's legacy_tf_layers
        return (sys.modules["tf_keras.legacy_tf_layers.convolutional"].conv2d,
                sys.modules["tf_keras.legacy_tf_layers.core"].dense)


def test_two_conv_training_graph(tmp_path, capsys, browser):
    conv2d, dense = v1_layers()
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [4, 16, 16, 3], name="images")
        y = v1.placeholder(tf.int32, [4], name="labels")
        h = conv2d(x, 8, 3, activation=tf.nn.relu, name="conv1")
        h = conv2d(h, 16, 3, activation=tf.nn.relu, name="conv2")
        logits = dense(tf.reduce_mean(h, [1, 2]), 10, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        v1.add_to_collection("train_op", train)
        v1.train.Saver()
        v1.global_variables_initializer()
        v1.train.export_meta_graph(str(tmp_path / "m.meta"), graph=g)
    report_html(capsys, tmp_path / "m.meta", tmp_path / "m.html")
    open_page(browser, tmp_path / "m.html", capsys, "two-conv tf.layers training graph")
    leaves = drawn_leaves(browser)
    ops = {n[1] for n in leaves}
    names = [n[0] for n in leaves]
    # the model, not the plumbing: convs forward and backward and the update are drawn,
    # initialisers, VarIsInitialized checks and the saver are not
    assert {"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "MatMul"} <= ops, ops
    assert any(op.startswith(("ApplyGradientDescent", "ResourceApplyGradientDescent")) for op in ops), ops
    assert not ops & {"VarIsInitializedOp", "IsVariableInitialized", "SaveV2", "RestoreV2"}, ops
    assert not [n for n in names if n.startswith(("save/", "init")) or "/Initializer/" in n], names
    # the layer ops (the fusion pass may have folded MatMul+BiasAdd into logits/BiasAdd)
    layer_ops = browser.eval("""DATA.N.filter(function(n){return !n[6]&&/^(conv[12]|logits)\\/[^\\/]+$/.test(n[0])
        &&['Conv2D','MatMul','_FusedConv2D','_FusedMatMul'].indexOf(n[1])>=0;}).map(function(n){return n[0];})""")
    assert sorted(n.split("/")[0] for n in layer_ops) == ["conv1", "conv2", "logits"], layer_ops
    px, boxes = fp16_in_box(browser, tmp_path, layer_ops + ["gradients/conv2/Conv2D_grad/Conv2DBackpropFilter"])
    for name, (n16, box) in boxes.items():
        assert box["name"] == name  # small graph: every layer op is drawn as its own box
        assert n16 > 0.25 * box["w"] * box["h"], (name, n16, box)  # FP16-coloured (labels cover some)
    # casts are marks on edges, with their bytes
    marks = browser.eval("Array.from(document.querySelectorAll('#vp .cm text')).map(function(t){return t.textContent;})")
    assert any(m.startswith("fp32→fp16 ") and m.endswith(("B", "KiB")) for m in marks), marks
    assert not [n for n in names if n.endswith(("CastToFp16", "CastToFp32"))]
    hit = search_brings_into_view(browser, "gradients/conv1/Conv2D_grad/Conv2DBackpropFilter")
    assert hit["cls"] == "float16"
    # an inserted Cast has no box: its name finds the node its edge feeds
    cast, fed = browser.eval("(function(){var c=DATA.C.filter(function(c){return !DATA.E[c[1]][6];})[0];"
                             "return [c[0],DATA.E[c[1]][8]];})()")
    assert browser.eval(f"npuAmpSearch({cast!r}).item") == fed
    # the toggle brings the plumbing back
    assert browser.eval("npuAmpBox('save/SaveV2')") is None
    assert browser.eval("npuAmpBox('init')") is None
    browser.click(*browser.eval("(function(){var r=document.getElementById('plumb').getBoundingClientRect();"
                                "return [r.left+r.width/2,r.top+r.height/2];})()"))
    assert browser.eval("document.getElementById('plumb').checked") is True
    assert browser.eval("npuAmpBox('init')")["name"] == "init"
    assert browser.eval("npuAmpBox('save/SaveV2')")["name"].startswith("save")
    assert browser.errors() == []


# --------------------------------------------------------------------------
# TF-Slim ResNet-50 training MetaGraph (~6k nodes)
# --------------------------------------------------------------------------
def test_slim_resnet50_training_metagraph(tmp_path, capsys, browser):
    from real_models import import_slim

    slim = import_slim()
    from tf_slim.nets import resnet_v1

    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [2, 64, 64, 3], name="images")
        y = v1.placeholder(tf.int32, [2], name="labels")
        with slim.arg_scope(resnet_v1.resnet_arg_scope()):
            logits, _ = resnet_v1.resnet_v1_50(x, 10, is_training=True)
        loss = v1.losses.sparse_softmax_cross_entropy(y, tf.squeeze(logits, [1, 2]))
        train = v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train")
        v1.add_to_collection("train_op", train)
        v1.train.Saver()
        v1.global_variables_initializer()
        v1.train.export_meta_graph(str(tmp_path / "r50.meta"), graph=g)
        n_nodes = len(g.as_graph_def().node)
    assert n_nodes > 5000  # the size the old page refused
    report_html(capsys, tmp_path / "r50.meta", tmp_path / "r50.html")
    open_page(browser, tmp_path / "r50.html", capsys, f"TF-Slim ResNet-50 training ({n_nodes} nodes)")
    assert browser.eval("document.querySelectorAll('#vp .it').length") < 400  # opens collapsed
    convs = ["resnet_v1_50/conv1", "resnet_v1_50/block1/unit_1/bottleneck_v1/conv1",
             "resnet_v1_50/block1/unit_2/bottleneck_v1/conv2"]
    px, boxes = fp16_in_box(browser, tmp_path, convs)
    for name, (n16, box) in boxes.items():
        assert n16 > 0.3 * box["w"] * box["h"], (name, n16, box)
    # forward and gradients side by side: the backward box starts beside the forward one
    fwd, bwd = browser.eval("npuAmpBox('resnet_v1_50')"), browser.eval("npuAmpBox('gradients')")
    assert bwd["x"] >= fwd["x"] + fwd["w"] and bwd["y"] < fwd["y"] + fwd["h"] / 2, (fwd, bwd)
    # a click on a closed scope opens it in place
    closed = browser.eval("""(function(){var v=document.getElementById('view').getBoundingClientRect(),NG=DATA.G.length;
        var els=Array.from(document.querySelectorAll('#vp .it')).filter(function(e){var i=+e.getAttribute('data-i');
          var r=e.getBoundingClientRect();return i<NG&&e.textContent.charAt(0)==='\u25B8'&&r.width>20&&r.height>8&&
          r.left>v.left&&r.right<v.right&&r.top>v.top&&r.bottom<v.bottom;});
        if(!els.length)return null;var r=els[0].getBoundingClientRect(),i=+els[0].getAttribute('data-i');
        return {name:DATA.G[i][0],x:r.left+r.width/2,y:r.top+r.height/2,n:document.querySelectorAll('#vp .it').length};})()""")
    assert closed is not None
    browser.click(closed["x"], closed["y"])
    assert browser.eval("document.querySelectorAll('#vp .it').length") > closed["n"]
    info = browser.eval("document.getElementById('info').textContent")
    assert info.startswith(closed["name"]) and "ops by precision" in info, info
    hit = search_brings_into_view(browser, "resnet_v1_50/block3/unit_4/bottleneck_v1/conv2/Conv2D")
    assert hit["cls"] == "float16"
    # the per-layer table links to the graph
    n_rows = browser.eval("document.querySelectorAll('#tbl tr.r').length")
    assert n_rows == 53 + 1  # 53 convs + the logits conv
    browser.eval("(function(){var r=Array.from(document.querySelectorAll('#tbl tr.r')).filter(function(t){"
                 "return t.firstChild.title==='resnet_v1_50/block4/unit_3/bottleneck_v1/conv3';})[0];r.click();})()")
    box = browser.eval("npuAmpBox('resnet_v1_50/block4/unit_3/bottleneck_v1/conv3')")
    assert box["name"] == "resnet_v1_50/block4/unit_3/bottleneck_v1/conv3"
    assert 0 <= box["x"] + box["w"] / 2 <= W and 0 <= box["y"] + box["h"] / 2 <= H
    assert browser.errors() == []


# --------------------------------------------------------------------------
# Keras MobileNetV2 SavedModel: every layer is inside a function body
# --------------------------------------------------------------------------
def test_keras_mobilenet_v2_saved_model(tmp_path, capsys, browser):
    k = keras2()
    if k is None:
        pytest.skip("Keras 2 (tf_keras) not installed")
    model = k.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10)
    # the serving function of the Keras model, saved without Keras's per-layer
    # restore functions (tracing those costs ~30 s; the graph served is the same:
    # a signature wrapper calling a function whose body holds every layer)
    serve = tf.function(lambda x: {"probs": model(x, training=False)}).get_concrete_function(
        tf.TensorSpec([None, 32, 32, 3], tf.float32, name="x"))
    module = tf.Module()
    module.variables_ = list(model.variables)
    tf.saved_model.save(module, str(tmp_path / "mnv2"), signatures=serve)
    text = report_html(capsys, tmp_path / "mnv2", tmp_path / "mnv2.html")
    page = (tmp_path / "mnv2.html").read_text()
    assert "FP16 (0)" not in page, text
    open_page(browser, tmp_path / "mnv2.html", capsys, "Keras MobileNetV2 SavedModel")
    names = browser.eval("DATA.N.filter(function(n){return n[1]==='Conv2D'&&!n[6];}).map(function(n){return n[0];})")
    # the layer functions are drawn where they are called, FP16 inside
    expand = [n for n in names if n.endswith("block_1_expand/Conv2D")]
    assert len(expand) == 1 and expand[0].startswith("StatefulPartitionedCall/"), expand
    # the deepest scope around the conv drawn big enough to sample (the report
    # inlines the layer functions first, as a session does, so the model is one
    # tall graph opened fitted to its width)
    parts = expand[0].split("/")
    scopes = ["/".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
    sizes = {s: browser.eval(f"npuAmpBox({s!r})") for s in scopes}
    layer = next(s for s in scopes if sizes[s] and sizes[s]["w"] >= 20 and sizes[s]["h"] >= 8)
    px, boxes = fp16_in_box(browser, tmp_path, [layer])
    n16, box = boxes[layer]
    assert n16 > 0.3 * box["w"] * box["h"], (layer, n16, box)
    assert count_color(px, FP16) > 2000
    hit = search_brings_into_view(browser, expand[0])
    assert hit["cls"] == "float16"
    assert browser.errors() == []


# --------------------------------------------------------------------------
# While / If bodies are drawn where they are called (no browser needed)
# --------------------------------------------------------------------------
def test_while_and_if_bodies_drawn_where_called():
    import npu_amp_tf
    from npu_amp_tf.tools import report as rep

    @tf.function
    def f(x, p):
        w = tf.ones([8, 8])
        _, y = tf.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, tf.matmul(x, w)), [tf.constant(0), x])
        z = tf.cond(p, lambda: tf.matmul(y, w), lambda: y * 2.0)
        return tf.identity(z, name="out")

    gd = f.get_concrete_function(tf.TensorSpec([4, 8], name="x"),
                                 tf.TensorSpec([], tf.bool, name="p")).graph.as_graph_def()
    whiles = [n.name for n in gd.node if n.op in ("While", "StatelessWhile")]
    ifs = [n.name for n in gd.node if n.op in ("If", "StatelessIf")]
    assert len(whiles) == 1 and len(ifs) == 1
    out, report = npu_amp_tf.rewrite_graph(gd, fetches=["out"])
    view = rep.build_view(report, out, fetches=["out"])
    ng = len(view["G"])
    leaves = {n[0]: n for n in view["N"]}
    cls = {name: view["classes"][n[2]] for name, n in leaves.items()}
    hidden = {name for name, n in leaves.items() if n[6]}
    body_mm = [n for n in leaves if n.startswith(whiles[0] + "/body/") and leaves[n][1] == "MatMul"]
    then_mm = [n for n in leaves if n.startswith(ifs[0] + "/then_branch/") and leaves[n][1] == "MatMul"]
    assert len(body_mm) == 1 and len(then_mm) == 1, sorted(leaves)
    assert cls[body_mm[0]] == cls[then_mm[0]] == "float16"  # MatMul is white: FP16 inside the bodies
    # the loop's condition and the other branch run too: drawn, not hidden as plumbing
    assert [n for n in leaves if n.startswith(whiles[0] + "/cond/") and leaves[n][1] == "Less"][0] not in hidden
    assert [n for n in leaves if n.startswith(ifs[0] + "/else_branch/") and leaves[n][1] == "Mul"][0] not in hidden
    assert not body_mm[0] in hidden and whiles[0] not in leaves  # the call is its body, not a box
    # the While's data input x flows into the body's argument, the If's result out of its branches
    names = [n[0] for n in view["N"]]
    edges = {(names[e[7] - ng], names[e[8] - ng]) for e in view["E"]}
    assert any(s == "x" and d.startswith(whiles[0] + "/body/") for s, d in edges), edges
    assert any(s.startswith(ifs[0] + "/then_branch/") and not d.startswith(ifs[0] + "/then_branch/")
               for s, d in edges), edges
