"""``python -m npu_amp_tf.run [rewrite flags] train.py [script args]``: the same
as ``npu-amp run`` (see :func:`npu_amp_tf.compat.run_script`)."""
import sys

if __name__ == "__main__":
    from npu_amp_tf.cli import main

    sys.exit(main(["run"] + sys.argv[1:]))
