"""Python wrappers and gradients for the fused custom ops (LayerNorm, FusedAttention).

Importing this module builds (once, cached) and loads the custom-op library,
so the fusion pass finds kernels for ``LayerNorm`` / ``FusedAttention`` and
graphs that contain them can run.

* :func:`layer_norm` -- ``LayerNorm(x, gamma, beta)`` over the trailing dims of
  ``x`` that ``gamma`` covers; fp32/fp16/bf16 in, fp32 statistics, output in
  the input dtype.  Differentiable: the registered gradient runs the C++
  ``LayerNormGrad`` kernel (dx, dgamma, dbeta).  The auxiliary outputs
  (mean, inv_std) are not differentiable.
* :func:`rms_norm` -- ``RMSNorm(x, gamma)``: ``x * rsqrt(mean(x^2) + eps) * gamma``
  over the trailing dims gamma covers (T5/LLaMA); fp32 accumulation, output in
  the input dtype.  Differentiable (C++ ``RMSNormGrad``).
* :func:`scale_mask_softmax` -- ``softmax(scores * scale + mask)`` over the last
  axis in one pass; what the attention fusion emits between TF's own matmuls.
  Differentiable: the registered gradient runs the C++ ``ScaleMaskSoftmaxGrad``
  (``scale * (dp - sum(dp * p)) * p``, fp32 arithmetic) for the scores and, when
  the mask needs a gradient, once more with scale 1 for the mask (summed over
  its broadcast dims).
* :func:`fused_attention` -- ``softmax(q . k^T * scale + mask) . v`` (fp32,
  inference only: no gradient is registered, asking for one raises).
"""
from __future__ import annotations

import tensorflow as tf

from . import _loader
from .errors import NpuAmpError

_lib = _loader.load()


def layer_norm(x, gamma, beta, epsilon: float = 1e-3, name=None):
    """Layer normalisation of ``x`` over its trailing dims covered by ``gamma``."""
    if epsilon < 0:
        raise NpuAmpError(f"layer_norm: epsilon={epsilon!r}; accepted: a float >= 0")
    y, _, _ = _lib.layer_norm(x, gamma, beta, epsilon=float(epsilon), name=name)
    return y


def rms_norm(x, gamma, epsilon: float = 1e-6, name=None):
    """RMS normalisation of ``x`` over its trailing dims covered by ``gamma``."""
    if epsilon < 0:
        raise NpuAmpError(f"rms_norm: epsilon={epsilon!r}; accepted: a float >= 0")
    y, _ = _lib.rms_norm(x, gamma, epsilon=float(epsilon), name=name)
    return y


def scale_mask_softmax(scores, mask=None, scale: float = 1.0, name=None):
    """``softmax(scores * scale + mask)`` over the last axis in one pass (fp32
    arithmetic; float32/float16/bfloat16).  Differentiable w.r.t. scores and mask."""
    masks = [] if mask is None else [mask]
    return _lib.scale_mask_softmax(scores, masks, scale=float(scale), name=name)


def fused_attention(q, k, v, mask=None, scale: float = 1.0, adj_k: bool = True, name=None):
    """``softmax(q @ k^T * scale + mask) @ v`` with q [..., S, D], k [..., T, D]
    (or [..., D, T] with ``adj_k=False``), v [..., T, Dv]."""
    masks = [] if mask is None else [mask]
    return _lib.fused_attention(q, k, v, masks, scale=float(scale), adj_k=bool(adj_k), name=name)


@tf.RegisterGradient("LayerNorm")
def _layer_norm_grad(op, dy, _dmean, _dinv):
    x, gamma, _ = op.inputs
    dx, dgamma, dbeta = _lib.layer_norm_grad(dy, x, gamma, op.outputs[1], op.outputs[2])
    return dx, dgamma, dbeta


@tf.RegisterGradient("RMSNorm")
def _rms_norm_grad(op, dy, _dinv):
    x, gamma = op.inputs
    return tuple(_lib.rms_norm_grad(dy, x, gamma, op.outputs[1]))


@tf.RegisterGradient("ScaleMaskSoftmax")
def _scale_mask_softmax_grad(op, dprobs):
    probs = op.outputs[0]
    scale = op.get_attr("scale")
    dscores = _lib.scale_mask_softmax_grad(dprobs, probs, scale=scale)
    if len(op.inputs) == 1:
        return [dscores]
    skip = getattr(op, "skip_input_indices", None)  # set by the TF2 tape for unwatched inputs
    if skip is not None and 1 in skip:
        return [dscores, None]
    # d/dmask = d/dlogits summed over the dims the mask was broadcast along
    dlogits = _lib.scale_mask_softmax_grad(dprobs, probs, scale=1.0)
    mask = op.inputs[1]
    _, rm = tf.raw_ops.BroadcastGradientArgs(s0=tf.shape(probs), s1=tf.shape(mask))
    dmask = tf.reshape(tf.reduce_sum(dlogits, rm), tf.shape(mask))
    return [dscores, dmask]


__all__ = ["layer_norm", "rms_norm", "scale_mask_softmax", "fused_attention"]
