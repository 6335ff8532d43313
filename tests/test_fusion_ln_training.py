"""Issue 14: LayerNorm / RMSNorm fuse in TRAINING graphs, forward and backward.

The forward becomes ``LayerNorm`` / ``RMSNorm``; the gradient subgraph TF's
autodiff built for it (found by ``graph_passes/fusion/grad_region.py``)
becomes ONE ``LayerNormGrad`` / ``RMSNormGrad``.  Checked on real graphs:

* offline (``run_passes`` on a TF1 graph, run with grappler off): every form
  (Keras 2 LayerNormalization, moments + batch_normalization, raw
  rsqrt / div-sqrt / reduce_variance, T5 and LLaMA RMSNorm);
* the session path (grappler runs its own passes first, then the plugin) and
  Keras ``fit`` under ``enable()`` (Keras 2 on TF 2.15, Keras 3 on TF 2.21),
  in ONE subprocess per lane (tests/_ln_training_worker.py), also the BERT-like
  training graph of benchmarks/fusion.py, FP16 and BF16 modes;
* refusals leave the graph unchanged with a reason.

Tolerances (normwise relative, ||a - b|| / ||b||):

* FP32: 1e-5.  FP32's unit roundoff is 6e-8; the fused kernels sum the D = 16
  (BERT-like: 32) elements of a row in another order than TF's reductions and
  the backward chain has ~20 ops, so ~D * u = 1e-6 per row; measured <= 3e-6
  (BERT-like, 2 layers).  A zero or missing gradient term is off by ~1.
* FP16 / BF16 modes (u = 2**-11 / 2**-8): the matmuls run in the low dtype;
  the norms accumulate in FP32 fused or not (the planner keeps them FP32: they
  are on the black list), so fused and unfused differ by FP32 noise, which can
  only flip the rounding of low-dtype values downstream by one ulp (2u): bound
  4u.  Against plain FP32 TF, the fused graph must be no worse than the unfused
  graph in the same mode (1.5x its error + u).  With the norms taken off the
  black list (mixlist), the planner gives them FP16/BF16 I/O (FP32 inside): the
  same bound against plain FP32 TF.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from _fusion_util import op_counts, rewrite, tf, tf1

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _ln_training_worker as worker  # noqa: E402

TF_MINOR = tuple(int(p) for p in tf.__version__.split(".")[:2])
U = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
INNER = ("Rsqrt", "RsqrtGrad", "SquaredDifference", "FusedBatchNormV3", "FusedBatchNormGradV3",
         "Sqrt", "SqrtGrad")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _keras2_available():
    if TF_MINOR < (2, 16):
        return True
    try:
        import tf_keras  # noqa: F401
        return True
    except ImportError:
        return False


# ------------------------------------------------------------------ offline
OFFLINE_FORMS = {"keras": ("LayerNorm", "LayerNormGrad"), "moments": ("LayerNorm", "LayerNormGrad"),
                 "raw": ("LayerNorm", "LayerNormGrad"), "div": ("LayerNorm", "LayerNormGrad"),
                 "rms": ("RMSNorm", "RMSNormGrad"), "llama": ("RMSNorm", "RMSNormGrad")}


def _run(g_def, fetch_names, feeds, train_name, weight_names):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(g_def, name="")
    cfg = tf1.ConfigProto()
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf1.Session(graph=g, config=cfg) as s:
        s.run("init")
        vals = s.run(fetch_names, feeds)
        s.run(train_name, feeds)
        after = s.run(weight_names)
    return vals, after


@pytest.mark.parametrize("form", sorted(OFFLINE_FORMS))
def test_offline_forward_and_backward_fused(form):
    if form == "keras" and not _keras2_available():
        pytest.skip(f"Keras 2 (tf_keras) is not installed for TensorFlow {tf.__version__}")
    g, feeds, grads, weights, train, loss = worker._build(form)
    with g.as_default():
        tf1.global_variables_initializer()  # named "init"
    gd = g.as_graph_def()
    names = sorted(grads)
    fetch = [grads[k].name for k in names] + [loss.name]
    new, rep = rewrite(gd, [t.split(":")[0] for t in fetch] + [train.name])
    c = op_counts(new)
    fwd, bwd = OFFLINE_FORMS[form]
    assert c[fwd] == 1 and c[bwd] == 1, rep.pass_stats("fusion")
    assert not any(c[op] for op in INNER), {op: c[op] for op in INNER if c[op]}
    assert c["Mean"] == 0  # the loss is a sum: every Mean was the norm's
    feed = {t.name: v for t, v in feeds.items()}
    wnames = [weights[k].name for k in sorted(weights)]
    a, a_after = _run(gd, fetch, feed, train.name, wnames)
    b, b_after = _run(new, fetch, feed, train.name, wnames)
    for k, x, y in zip(names + ["loss"], a, b):
        assert np.linalg.norm(x) > 1e-2, k  # a zero gradient would pass a relative check vacuously
        assert _rel(y, x) <= 1e-5, (k, _rel(y, x))
    for k, x, y in zip(sorted(weights), a_after, b_after):
        assert _rel(y, x) <= 1e-5, (k, _rel(y, x))


def test_offline_report_names_the_fusion_and_is_idempotent():
    g, feeds, grads, weights, train, loss = worker._build("moments")
    new, rep = rewrite(g.as_graph_def(), ["train", loss.op.name])
    assert rep.pass_stats("fusion")["fused"].get("layer_norm_moments") == 1
    fused = [d for d in rep.decisions.values() if d.get("fusion") == "layer_norm_moments"]
    assert len(fused) == 1 and all(n.startswith("gradients/") for n in fused[0]["fused_gradient_nodes"])
    again, rep2 = rewrite(new, ["train", loss.op.name])  # grappler calls the plugin repeatedly
    assert not rep2.pass_stats("fusion")["fused"].get("layer_norm_moments")
    assert sorted((n.name, n.op, tuple(n.input)) for n in again.node) == \
        sorted((n.name, n.op, tuple(n.input)) for n in new.node)
    grad_nodes = [n for n in new.node if n.op == "LayerNormGrad"]
    assert len(grad_nodes) == 1
    ln = grad_nodes[0]
    # LayerNormGrad(dy, x, gamma, mean, inv_std): the statistics are the fused forward's outputs
    fwd_name = ln.input[3].split(":")[0]
    assert ln.input[3] == f"{fwd_name}:1" and ln.input[4] == f"{fwd_name}:2"
    assert {n.op for n in new.node if n.name == fwd_name} == {"LayerNorm"}


# ------------------------------------------------------------------ refusals
def _two_backward_passes():
    g, feeds, grads, weights, train, loss = worker._build("moments")
    with g.as_default():
        x = g.get_tensor_by_name("x:0")
        second = tf.gradients(loss * 2.0, x, name="second")[0]
        tf.identity(second, name="second_dx")
    return g.as_graph_def(), loss


def test_two_backward_passes_refused_unchanged():
    """One LayerNormGrad cannot serve two incoming gradients: refused with a reason."""
    gd, loss = _two_backward_passes()
    new, rep = rewrite(gd, ["train", loss.op.name, "second_dx"])
    c = op_counts(new)
    assert c["LayerNorm"] == 0 and c["LayerNormGrad"] == 0 and c["Rsqrt"] == 1
    reasons = [d.get("fusion_reason", "") for d in rep.decisions.values() if d.get("fusion_skipped")]
    assert any("not fused" in r for r in reasons), reasons


def test_inner_tensor_read_by_forward_code_refused():
    def f():
        x = tf1.placeholder(tf.float32, [4, 8], name="x")
        w = tf1.get_variable("w", initializer=np.eye(8, dtype=np.float32))
        h = tf.matmul(x, w)
        mean, var = tf.nn.moments(h, [-1], keepdims=True)
        y = tf.nn.batch_normalization(h, mean, var, None, None, 1e-5)
        loss = tf.reduce_sum(tf.square(y) + tf.reduce_sum(mean), name="loss")  # mean read by forward code
        tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    g = tf.Graph()
    with g.as_default():
        f()
    new, rep = rewrite(g.as_graph_def(), ["train", "loss"])
    assert op_counts(new)["LayerNorm"] == 0


# ------------------------------------------------------------------ session path / enable()
def _cases():
    cases = []
    forms = ["moments", "raw", "rms", "bert"] + (["keras"] if _keras2_available() else [])
    for form in forms:
        cases += [f"{form}:plain:0", f"{form}:must_keep_origin_dtype:2"]
    for form in ("moments", "rms"):
        for mode in ("allow_mix_precision", "allow_mix_precision_bf16"):
            cases += [f"{form}:{mode}:0", f"{form}:{mode}:2", f"{form}:{mode}+lngray:2"]
    if _keras2_available():  # BF16 I/O of the fused norms (BF16_GRAY) vs their old FP32 I/O (user black)
        cases += ["keras:allow_mix_precision_bf16:0", "keras:allow_mix_precision_bf16:2",
                  "keras:allow_mix_precision_bf16+lnblack:2"]
    cases += ["fit:plain:0", "fit:must_keep_origin_dtype:2", "fitmha:plain:0", "fitmha:must_keep_origin_dtype:2"]
    return cases


@pytest.fixture(scope="module")
def results():
    cases = _cases()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_ln_training_worker.py"), ",".join(cases)],
                          capture_output=True, text=True, env=env, timeout=1500)
    out = {}
    last = None
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            last = line.split()[1]
        elif line.startswith("RESULT "):
            r = json.loads(line[7:])
            out[r["case"]] = r
    out["_rc"] = proc.returncode
    out["_last"] = last
    out["_stderr"] = proc.stderr[-2000:]
    return out


def _get(results, case):
    if case not in results:
        pytest.fail(f"worker died in case {results['_last']} (rc {results['_rc']}): {results['_stderr']}")
    return results[case]


FUSED = {"moments": ("LayerNorm", 1), "raw": ("LayerNorm", 1), "keras": ("LayerNorm", 1), "bert": ("LayerNorm", 4),
         "rms": ("RMSNorm", 1)}


def _compared(ref, got):
    """The gradients worth comparing: all but those that are zero in exact
    arithmetic (BERT's key biases: softmax is shift-invariant, ~1e-13)."""
    top = max(np.linalg.norm(v) for v in ref.values())
    keys = [k for k in ref if np.linalg.norm(ref[k]) > 1e-6 * top]
    assert len(keys) >= 0.9 * len(ref)
    return keys


@pytest.mark.parametrize("form", sorted(FUSED))
def test_session_path_fp32(results, form):
    if form == "keras" and not _keras2_available():
        pytest.skip(f"Keras 2 (tf_keras) is not installed for TensorFlow {tf.__version__}")
    plain = _get(results, f"{form}:plain:0")
    fused = _get(results, f"{form}:must_keep_origin_dtype:2")
    op, n = FUSED[form]
    assert fused["counts"][op] == n and fused["counts"][op + "Grad"] == n, fused["counts"]
    assert plain["counts"][op] == 0
    assert not any(fused["counts"][k] for k in INNER if k in fused["counts"]), fused["counts"]
    assert not any(fused["counts"][k] for k in fused["counts"] if "FusedBatchNorm" in k)
    assert fused["norm_dtypes"] == ["DT_FLOAT"]
    for k in _compared(plain["grads"], fused["grads"]):
        assert _rel(fused["grads"][k], plain["grads"][k]) <= 1e-5, (k, _rel(fused["grads"][k], plain["grads"][k]))
    for k in plain["after"]:
        assert _rel(fused["after"][k], plain["after"][k]) <= 1e-5, k


@pytest.mark.parametrize("form", ["moments", "rms"])
@pytest.mark.parametrize("mode,kind", [("allow_mix_precision", "fp16"), ("allow_mix_precision_bf16", "bf16")])
def test_session_path_low_precision(results, form, mode, kind):
    plain = _get(results, f"{form}:plain:0")
    unfused = _get(results, f"{form}:{mode}:0")
    fused = _get(results, f"{form}:{mode}:2")
    gray = _get(results, f"{form}:{mode}+lngray:2")
    op, n = FUSED[form]
    for r in (fused, gray):
        assert r["counts"][op] == n and r["counts"][op + "Grad"] == n, r["counts"]
        assert not any(r["counts"][k] for k in INNER if k in r["counts"])
    # the planner's decision: black-listed in FP16 mode -> FP32 I/O; gray in BF16 mode
    # (lists.BF16_GRAY) and off the black list -> the producers' low dtype
    assert fused["norm_dtypes"] == (["DT_FLOAT"] if kind == "fp16" else ["DT_BFLOAT16"])
    assert gray["norm_dtypes"] == ["DT_HALF" if kind == "fp16" else "DT_BFLOAT16"]
    u = U[kind]
    for k in _compared(plain["grads"], fused["grads"]):
        p, uf, f, gr = (r["grads"][k] for r in (plain, unfused, fused, gray))
        assert _rel(f, uf) <= 4 * u, (k, _rel(f, uf))
        base = _rel(uf, p)
        assert _rel(f, p) <= 1.5 * base + u, (k, _rel(f, p), base)
        assert _rel(gr, p) <= 1.5 * base + u, (k, _rel(gr, p), base)


def test_keras_bf16_fused_norms_run_bf16(results):
    """BF16 mode on a Keras 2 LayerNormalization training graph: LayerNorm and
    LayerNormGrad are gray in BF16 (``lists.BF16_GRAY``), so in the executed graph
    they run with bfloat16 I/O after the BF16 matmuls, with fewer activation-sized
    Casts than with them on the black list (the behaviour before: the user's
    black entry) and fewer elements converted, and
    the gradients and weights after one SGD step stay as close to plain FP32 TF.

    Tolerance: the two BF16 graphs differ only in the rounding of the norm's
    I/O to BF16 (x is a BF16 matmul's output in both; gamma, beta, y, dy, dx,
    dgamma, dbeta are rounded once more, each by at most half an ulp = u/2,
    u = 2**-8), and a gradient crosses at most ~4 such roundings on its way
    (gamma -> y -> ... dy -> dx / dgamma): 4u on top of the black variant's error."""
    if not _keras2_available():
        pytest.skip(f"Keras 2 (tf_keras) is not installed for TensorFlow {tf.__version__}")
    plain = _get(results, "keras:plain:0")
    unfused = _get(results, "keras:allow_mix_precision_bf16:0")
    fused = _get(results, "keras:allow_mix_precision_bf16:2")
    black = _get(results, "keras:allow_mix_precision_bf16+lnblack:2")
    for r in (fused, black):
        assert r["counts"]["LayerNorm"] == 1 and r["counts"]["LayerNormGrad"] == 1, r["counts"]
    assert fused["norm_dtypes"] == ["DT_BFLOAT16"]
    assert black["norm_dtypes"] == ["DT_FLOAT"]
    # fewer activation-sized Casts (x into the norm, y out of it, dy, dx: [B*S, D] = 192
    # elements here) and fewer elements converted per step; the parameter-sized ones
    # ([D]: gamma, beta in; dgamma, dbeta out to the FP32 variables) are new, so the
    # *number* of Cast nodes alone does not fall on this one-norm graph
    big = {k: [n for n in r["cast_sizes"] if n > worker.D] for k, r in (("fused", fused), ("black", black))}
    assert len(big["fused"]) < len(big["black"]), big
    assert sum(fused["cast_sizes"]) < sum(black["cast_sizes"]), (fused["cast_sizes"], black["cast_sizes"])
    u = U["bf16"]
    for k in _compared(plain["grads"], fused["grads"]):
        p, f, bl, uf = (r["grads"][k] for r in (plain, fused, black, unfused))
        assert np.linalg.norm(f) > 0
        assert _rel(f, p) <= _rel(bl, p) + 4 * u, (k, _rel(f, p), _rel(bl, p), _rel(uf, p))
    for k in plain["after"]:
        p, f, bl = (r["after"][k] for r in (plain, fused, black))
        assert _rel(f, p) <= _rel(bl, p) + 4 * u, (k, _rel(f, p), _rel(bl, p))


def test_keras_fit_under_enable(results):
    """Keras Dense -> LayerNormalization -> Dense, ``fit`` one batch under
    ``enable()`` (Keras 2 on TF 2.15, Keras 3 on TF 2.21): the executed
    function graphs hold one LayerNorm and one LayerNormGrad and the weights
    move as without the plugin."""
    plain = _get(results, "fit:plain:0")
    fused = _get(results, "fit:must_keep_origin_dtype:2")
    assert fused["counts"]["LayerNorm"] == 1 and fused["counts"]["LayerNormGrad"] == 1, fused["counts"]
    assert plain["counts"]["LayerNorm"] == 0
    assert fused["counts"]["Rsqrt"] == 0 and fused["counts"]["RsqrtGrad"] == 0
    assert not any(fused["counts"][k] for k in fused["counts"] if "FusedBatchNorm" in k)
    assert len(plain["delta"]) == 6  # kernels, biases, gamma, beta
    for a, b in zip(fused["delta"], plain["delta"]):
        assert np.linalg.norm(b) > 1e-4  # every weight moved
        assert _rel(a, b) <= 1e-5


def test_keras_transformer_block_fit_under_enable(results):
    """A post-LN transformer block (MultiHeadAttention, GELU FFN, 2 LayerNormalization)
    under ``fit``: both norms fuse forward and backward; every weight moves as
    without the plugin (the attention-output bias's gradient, gamma-shaped and
    computed from dx, must not be taken for dgamma: it has another scope)."""
    plain = _get(results, "fitmha:plain:0")
    fused = _get(results, "fitmha:must_keep_origin_dtype:2")
    assert fused["counts"]["LayerNorm"] == 2 and fused["counts"]["LayerNormGrad"] == 2, fused["counts"]
    assert fused["counts"]["Rsqrt"] == 0 and fused["counts"]["RsqrtGrad"] == 0
    top = max(np.linalg.norm(b) for b in plain["delta"])
    moved = [(a, b) for a, b in zip(fused["delta"], plain["delta"]) if np.linalg.norm(b) > 1e-6 * top]
    assert len(moved) >= len(plain["delta"]) - 1  # the key bias's gradient is zero in exact arithmetic
    for a, b in moved:
        assert _rel(a, b) <= 1e-5
