"""npu-amp-tf graph engine: GraphDef in, GraphDef and stats out.

This package never imports ``npu_amp_tf`` and never creates sessions or
variables.  It may ask TensorFlow about op definitions, kernels and shapes.
"""
