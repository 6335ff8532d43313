"""Which oneDNN-only fused forms run, on this TF, against the unfused ops?  (issue 18)

Cases (``kind:dtype:activation:is_training``), each in its own subprocess (a form
may abort TF), 2x8x8x16 conv / 8x32 matmul:

  conv_add  _FusedConv2D[BiasAdd,Add(,act)] (BF16: _MklNativeFusedConv2D), num_args=2
  mm        _FusedMatMul[BiasAdd,Add(,act)]
  bn        FusedBatchNormV3 + Relu -> _FusedBatchNormEx(activation_mode=Relu)
  conv_bn   _FusedConv2D[FusedBatchNorm,Relu] (inference)

Prints ok / the error, the relative max error vs the unfused graph and the fused
ops TF executed.  Backs ``_ONEDNN_SIDE_ADD`` / ``_ONEDNN_BN_ACTIVATIONS`` in
graph_passes/fusion/builtin.py.  Set TF_ENABLE_ONEDNN_OPTS=0 for TF's Eigen kernels.
Run: ``python benchmarks/onednn_forms.py``.
"""
import json
import os
import subprocess
import sys

CASES = ["conv_add:float32:Relu:0", "conv_add:bfloat16:Relu:0", "conv_add:float32::0", "conv_add:bfloat16::0",
         "conv_add:bfloat16:Relu6:0", "conv_add:bfloat16:Elu:0", "conv_add:bfloat16:LeakyRelu:0",
         "conv_add:float32:LeakyRelu:0", "mm:float32::0", "mm:bfloat16::0", "mm:float32:Relu:0",
         "bn:float32:Relu:1", "bn:bfloat16:Relu:1", "bn:float32:Relu:0", "bn:bfloat16:Relu:0",
         "conv_bn:float32:Relu:0"]


def main():
    import tensorflow as tf
    print(f"TF {tf.__version__}; TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(default)')}")
    for c in CASES:
        p = subprocess.run([sys.executable, __file__, c], capture_output=True, text=True, timeout=600)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{c:32s} ABORTED rc={p.returncode}")
            continue
        r = json.loads(line[7:])
        print(f"{c:32s} " + (f"ok  relerr {r['relerr']:.2e}  {','.join(r['ops'])}" if r["ok"] else
                               f"FAIL {r['err'][:160]}"))


if __name__ == "__main__" and len(sys.argv) == 1:
    main()
    sys.exit(0)

# ---------------------------------------------------------------- child
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
tf1 = tf.compat.v1
case = sys.argv[1]
kind, dtn, act, training = case.split(":")
dt = getattr(tf, dtn)
rng = np.random.RandomState(0)
g = tf.Graph()
with g.as_default():
    x = tf1.placeholder(tf.float32, [2, 8, 8, 16] if kind != "mm" else [8, 32], name="x")
    xc = tf.identity(tf.cast(x, dt), name="xc")
    if kind in ("conv_add", "conv_bn"):
        w = tf.cast(tf.constant(rng.normal(0, .2, [3, 3, 16, 16]).astype(np.float32)), dt)
        core = tf.nn.conv2d(xc, w, 1, "SAME", name="core")
    elif kind == "mm":
        w = tf.cast(tf.constant(rng.normal(0, .2, [32, 32]).astype(np.float32)), dt)
        core = tf.matmul(xc, w, name="core")
    if kind in ("conv_add", "mm"):
        b = tf.cast(tf.constant(np.linspace(-1, 1, 16 if kind != "mm" else 32).astype(np.float32)), dt)
        ba = tf.nn.bias_add(core, b, name="ba")
        side = tf.identity(xc * 0.5, name="side")
        y = tf.add(ba, side, name="add")
    else:
        pre = core if kind == "conv_bn" else xc
        C = 16
        sc = tf.constant(np.linspace(.5, 1.5, C).astype(np.float32)); of = tf.constant(np.linspace(-.3, .3, C).astype(np.float32))
        mn = tf.constant(np.zeros(C, np.float32)) if training == "1" else tf.constant(np.linspace(-.1, .1, C).astype(np.float32))
        vr = tf.constant(np.ones(C, np.float32)) if training == "1" else tf.constant(np.linspace(.5, 2, C).astype(np.float32))
        bn = tf1.raw_ops.FusedBatchNormV3(x=pre, scale=sc, offset=of, mean=mn, variance=vr, epsilon=1e-3,
                                          is_training=training == "1", name="bn")
        y = tf.identity(bn[0], name="add")
        extra = [tf.identity(bn[1], name="bm"), tf.identity(bn[2], name="bv")]
    if act:
        y = getattr(tf.nn, {"Relu": "relu", "Relu6": "relu6", "Elu": "elu", "LeakyRelu": "leaky_relu"}[act])(g.get_tensor_by_name("add:0"), name="act")
    out = tf.identity(tf.cast(y, tf.float32), name="out")
gd = g.as_graph_def()
ref_gd = gd
gd2 = type(gd)(); gd2.CopyFrom(gd)
by = {n.name: n for n in gd2.node}
last = by["act"] if act else by["add"]
T = attr_value_pb2.AttrValue(type=dt.as_datatype_enum)
if kind in ("conv_add", "mm"):
    ops = ["BiasAdd", "Add"] + ([act] if act else [])
    c = by["core"]
    last.op = "_FusedConv2D" if kind == "conv_add" else "_FusedMatMul"
    if dtn == "bfloat16" and kind == "conv_add":
        last.op = "_MklNativeFusedConv2D"; last.attr["_kernel"].s = b"MklNameChangeOp"
    del last.input[:]
    last.input.extend([c.input[0], c.input[1], by["ba"].input[1], "side"])
    last.attr.clear()
    for k, v in c.attr.items():
        if k in ("T", "strides", "padding", "data_format", "dilations", "explicit_paddings", "transpose_a", "transpose_b", "use_cudnn_on_gpu"):
            last.attr[k].CopyFrom(v)
    last.attr["num_args"].i = 2
    if last.op.startswith("_Mkl"): last.attr["_kernel"].s = b"MklNameChangeOp"
    if kind == "conv_add":
        last.attr["TArgs"].list.type.extend([dt.as_datatype_enum] * 2)
    last.attr["fused_ops"].list.s.extend(o.encode() for o in ops)
    last.attr["epsilon"].f = 1e-4
    if act == "LeakyRelu": last.attr["leakyrelu_alpha"].f = 0.2
    if act:  # add node removed
        gd2.node.remove(by["add"])
    # rename: output is the last node
else:
    bnn = by["bn"]
    if kind == "bn":
        bnn.op = "_FusedBatchNormEx"
        bnn.attr["activation_mode"].s = act.encode()
        bnn.attr["num_side_inputs"].i = 0
        # relu -> identity
        by["act"].op = "Identity"
    else:  # conv_bn: _FusedConv2D [FusedBatchNorm, Relu] (inference)
        last.op = "_FusedConv2D"
        if dtn == "bfloat16": last.op = "_MklNativeFusedConv2D"; last.attr["_kernel"].s = b"MklNameChangeOp"
        c = by["core"]
        del last.input[:]
        last.input.extend([c.input[0], c.input[1]] + list(bnn.input[1:5]))
        last.attr.clear()
        for k, v in c.attr.items():
            if k in ("T", "strides", "padding", "data_format", "dilations", "explicit_paddings", "use_cudnn_on_gpu"):
                last.attr[k].CopyFrom(v)
        last.attr["num_args"].i = 4
        if last.op.startswith("_Mkl"): last.attr["_kernel"].s = b"MklNameChangeOp"
        last.attr["TArgs"].list.type.extend([dt.as_datatype_enum] * 4)
        last.attr["fused_ops"].list.s.extend([b"FusedBatchNorm"] + ([act.encode()] if act else []))
        last.attr["epsilon"].f = 1e-3
        by["add"].input[0] = "core"  # keep bn alive? drop bm/bv
        for n in ("bm", "bv"): gd2.node.remove(by[n])
        by["add"].op = "Identity"
def run(gdef, fetch):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gdef, name="")
    cfg = tf1.ConfigProto(); cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf1.Session(graph=g, config=cfg) as s:
        md = tf1.RunMetadata()
        v = s.run(fetch, {"x:0": rng2.uniform(-1, 1, [2, 8, 8, 16] if kind != "mm" else [8, 32]).astype(np.float32)},
                  options=tf1.RunOptions(output_partition_graphs=True), run_metadata=md)
        ops = sorted({n.op for pg in md.partition_graphs for n in pg.node if "Fused" in n.op or "Mkl" in n.op})
        return v, ops
rng2 = np.random.RandomState(5)
ref, _ = run(ref_gd, ["out:0"] + (["bm:0"] if kind == "bn" else []))
rng2 = np.random.RandomState(5)
try:
    got, ops = run(gd2, ["out:0"] + (["bm:0"] if kind == "bn" else []))
    err = float(np.max(np.abs(got[0] - ref[0])) / (np.max(np.abs(ref[0])) + 1e-9))
    print("RESULT", json.dumps({"case": case, "ok": True, "relerr": err, "ops": ops}))
except Exception as e:
    print("RESULT", json.dumps({"case": case, "ok": False, "err": " | ".join(l for l in str(e).splitlines() if l.strip())[:400]}))
