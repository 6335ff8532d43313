"""Loading and saving the model kinds the tools accept.

* a frozen ``GraphDef``: binary ``.pb`` or text ``.pbtxt``;
* a ``MetaGraphDef``: binary ``.meta`` or text ``.meta.txt``/``.pbtxt``
  holding a ``meta_info_def`` (detected by content, not only the suffix);
* a SavedModel directory (``saved_model.pb`` or ``saved_model.pbtxt``), with a
  selectable signature (default ``serving_default``) and tag set.

:func:`load_model` reads any of them into a :class:`Model`;
:func:`save_model` writes a rewritten graph back in the *same kind* (a
SavedModel directory is copied with its variables and assets, only the graph
changes).  :func:`runnable` gives a self-contained frozen ``GraphDef`` (variables
folded into constants, functions inlined where TF can) plus its input
placeholders and outputs: the form that dump / compare / tune / profile run.

Every problem a user can cause (missing file, unparsable model, unknown
signature, bad input names) raises :class:`ToolError` with one clear line.
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np

from ..errors import NpuAmpError

SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp", "VarIsInitializedOp"})
_NON_OUTPUT_OPS = frozenset({
    "NoOp", "Assert", "Assign", "AssignVariableOp", "AssignAdd", "AssignSub", "SaveV2", "Save",
    "RestoreV2", "Placeholder", "PlaceholderWithDefault", "Const", "VariableV2", "VarHandleOp",
    "MergeSummary", "ScalarSummary", "HistogramSummary", "ApplyGradientDescent",
    "ResourceApplyGradientDescent", "Print", "PrintV2"})


class ToolError(NpuAmpError, ValueError):
    """A user-caused problem in a tool (bad file, bad model, bad inputs)."""


@dataclasses.dataclass
class Model:
    """A loaded model.

    ``inputs`` maps a user-facing key (placeholder name, or signature input
    key) to a tensor name; ``outputs`` likewise for the outputs.
    """

    kind: str  # "graphdef", "metagraph", "savedmodel"
    path: str
    graph_def: object
    binary: bool = True
    meta_graph: object = None
    saved_model: object = None
    meta_index: int = 0
    signature: str | None = None
    inputs: dict = dataclasses.field(default_factory=dict)
    outputs: dict = dataclasses.field(default_factory=dict)

    @property
    def fetch_nodes(self) -> list[str]:
        return sorted({_node_of(t) for t in self.outputs.values()})

    @property
    def input_nodes(self) -> list[str]:
        return sorted({_node_of(t) for t in self.inputs.values()})

    def preserve_nodes(self) -> list[str]:
        """Nodes a rewrite must keep by name: inputs, outputs, and for a
        MetaGraph / SavedModel every node a collection, signature or saver
        refers to (the train op, initialisers, save/restore)."""
        keep = set(self.input_nodes) | set(self.fetch_nodes)
        mg = self.meta_graph
        if mg is not None:
            for col in mg.collection_def.values():
                for s in col.node_list.value:
                    keep.add(_node_of(s))
                for b in col.bytes_list.value:
                    try:
                        s = b.decode()
                    except UnicodeDecodeError:
                        continue
                    if s in self._names():
                        keep.add(s)
            for sig in mg.signature_def.values():
                for ti in list(sig.inputs.values()) + list(sig.outputs.values()):
                    if ti.name:
                        keep.add(_node_of(ti.name))
            sd = mg.saver_def
            for t in (sd.filename_tensor_name, sd.save_tensor_name, sd.restore_op_name):
                if t:
                    keep.add(_node_of(t))
        names = self._names()
        return sorted(k for k in keep if k in names)

    def _names(self):
        return {n.name for n in self.graph_def.node}


def _node_of(tensor: str) -> str:
    t = tensor.lstrip("^")
    name, sep, port = t.rpartition(":")
    return name if sep and port.isdigit() else t


def tensor_ref(name: str) -> str:
    """``x`` -> ``x:0``; ``x:1`` unchanged."""
    name = name.lstrip("^")
    _, sep, port = name.rpartition(":")
    return name if sep and port.isdigit() else name + ":0"


# --------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------
def _read_bytes(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise ToolError(f"model file '{path}' does not exist") from None
    except IsADirectoryError:
        raise ToolError(f"'{path}' is a directory without saved_model.pb; expected a SavedModel "
                        "directory, a .pb/.pbtxt GraphDef or a .meta MetaGraph") from None
    except OSError as exc:
        raise ToolError(f"model file '{path}' cannot be read: {exc.strerror or exc}") from None


def _parse(proto_cls, data: bytes, path: str, what: str, text: bool | None = None):
    """Parse ``data`` as binary or text proto.  Returns (proto, binary?)."""
    from google.protobuf import message, text_format

    errors = []
    if text is not True:
        msg = proto_cls()
        try:
            msg.ParseFromString(data)
            if msg.ByteSize() > 0 or not data:
                return msg, True
        except (message.DecodeError, RuntimeError, ValueError) as exc:
            errors.append(str(exc))
    if text is not False:
        msg = proto_cls()
        try:
            text_format.Parse(data.decode("utf-8"), msg)
            return msg, False
        except (text_format.ParseError, UnicodeDecodeError, ValueError) as exc:
            errors.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    detail = errors[-1] if errors else "empty"
    raise ToolError(f"'{path}' is not a valid {what} (binary or text): {detail}")


def _looks_like_meta(path: str, data: bytes) -> bool:
    if path.endswith((".meta", ".meta.txt", ".meta.pbtxt")):
        return True
    head = data[:4096]
    return b"meta_info_def" in head or b"graph_def {" in head


def load_model(path: str, signature: str | None = None, tags: str | None = None,
               outputs: list[str] | None = None) -> Model:
    """Read a GraphDef, MetaGraph or SavedModel.  ``signature`` selects a
    SavedModel / MetaGraph signature; ``outputs`` overrides the output tensors
    (node names or ``node:k``)."""
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ToolError(f"model '{path}' does not exist")
    if os.path.isdir(path):
        for fname in SAVED_MODEL_FILES:
            full = os.path.join(path, fname)
            if os.path.exists(full):
                break
        else:
            raise ToolError(f"'{path}' is a directory without saved_model.pb; expected a SavedModel "
                            "directory, a .pb/.pbtxt GraphDef or a .meta MetaGraph")
        sm, binary = _parse(saved_model_pb2.SavedModel, _read_bytes(full), full, "SavedModel",
                            text=fname.endswith(".pbtxt"))
        if not sm.meta_graphs:
            raise ToolError(f"SavedModel '{path}' holds no MetaGraph")
        idx = _select_meta(sm, tags, path)
        mg = sm.meta_graphs[idx]
        model = Model("savedmodel", path, mg.graph_def, binary, meta_graph=mg, saved_model=sm,
                      meta_index=idx)
        _select_signature(model, signature, required=True)
    else:
        data = _read_bytes(path)
        text = None
        if path.endswith((".pbtxt", ".txt")):
            text = True
        if _looks_like_meta(path, data):
            mg, binary = _parse(meta_graph_pb2.MetaGraphDef, data, path, "MetaGraphDef", text)
            model = Model("metagraph", path, mg.graph_def, binary, meta_graph=mg)
            if mg.signature_def:
                _select_signature(model, signature, required=signature is not None)
            elif signature:
                raise ToolError(f"unknown signature '{signature}' in '{path}': the MetaGraph has no signatures")
        else:
            gd, binary = _parse(graph_pb2.GraphDef, data, path, "GraphDef", text)
            if not gd.node:
                raise ToolError(f"'{path}' is not a valid GraphDef: it has no nodes")
            model = Model("graphdef", path, gd, binary)
            if signature:
                raise ToolError(f"--signature '{signature}' given but '{path}' is a GraphDef, which has no signatures")
    if not model.inputs:
        model.inputs = {n.name: n.name + ":0" for n in model.graph_def.node if n.op == "Placeholder"}
    if outputs:
        names = {n.name for n in model.graph_def.node}
        model.outputs = {}
        for o in outputs:
            if _node_of(o) not in names:
                raise ToolError(f"output '{o}' is not a node of '{path}'")
            model.outputs[o] = tensor_ref(o)
    if not model.outputs:
        model.outputs = {n: n + ":0" for n in _sink_nodes(model.graph_def)}
    return model


def _select_meta(sm, tags, path):
    if tags is None:
        want = None
    else:
        want = set(t.strip() for t in tags.split(",") if t.strip())
    avail = []
    for i, mg in enumerate(sm.meta_graphs):
        mtags = set(mg.meta_info_def.tags)
        avail.append(",".join(sorted(mtags)))
        if want is None and "serve" in mtags:
            return i
        if want is not None and mtags == want:
            return i
    if want is None:
        return 0
    raise ToolError(f"no MetaGraph with tags '{tags}' in SavedModel '{path}'; available: {'; '.join(avail)}")


def _select_signature(model: Model, signature: str | None, required: bool):
    sigs = model.meta_graph.signature_def
    usable = {k: v for k, v in sigs.items() if not k.startswith("__")}
    if not usable:
        if signature:
            raise ToolError(f"unknown signature '{signature}' in '{model.path}': no signatures")
        return
    if signature is None:
        signature = "serving_default" if "serving_default" in usable else sorted(usable)[0]
    if signature not in usable:
        raise ToolError(f"unknown signature '{signature}' in '{model.path}'; "
                        f"available: {', '.join(sorted(usable))}")
    sig = usable[signature]
    model.signature = signature
    model.inputs = {k: v.name for k, v in sorted(sig.inputs.items())}
    model.outputs = {k: v.name for k, v in sorted(sig.outputs.items())}


def _sink_nodes(gd) -> list[str]:
    """Nodes no data edge reads, that produce a value (the natural outputs)."""
    read = set()
    for n in gd.node:
        for i in n.input[:]:
            if not i.startswith("^"):
                read.add(_node_of(i))
    out = []
    for n in gd.node:
        if n.name in read or n.op in _NON_OUTPUT_OPS or n.op.startswith(("Save", "Restore")):
            continue
        if n.name.startswith(("save/", "init")):
            continue
        out.append(n.name)
    return out


# --------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------
def save_model(model: Model, graph_def, out: str, report=None) -> list[str]:
    """Write ``graph_def`` as the same kind of model as ``model`` at ``out``,
    and the report (if given) as JSON beside it.  Returns the written paths."""
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

    out = os.fspath(out)
    written = []
    if model.kind == "savedmodel":
        if os.path.abspath(out) == os.path.abspath(model.path):
            raise ToolError(f"output '{out}' is the input SavedModel; choose a new directory")
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise ToolError(f"output directory '{out}' exists and is not empty")
        os.makedirs(out, exist_ok=True)
        for entry in os.listdir(model.path):
            if entry in SAVED_MODEL_FILES:
                continue
            src = os.path.join(model.path, entry)
            dst = os.path.join(out, entry)
            if os.path.isdir(src):
                shutil.copytree(src, dst)
            else:
                shutil.copy2(src, dst)
        sm = saved_model_pb2.SavedModel()
        sm.CopyFrom(model.saved_model)
        sm.meta_graphs[model.meta_index].graph_def.CopyFrom(graph_def)
        fname = "saved_model.pb" if model.binary else "saved_model.pbtxt"
        target = os.path.join(out, fname)
        _write(target, sm, model.binary)
        written.append(target)
        report_path = os.path.join(out, "npu_amp_report.json")
    else:
        d = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(d):
            raise ToolError(f"output directory '{d}' does not exist")
        if model.kind == "metagraph":
            mg = meta_graph_pb2.MetaGraphDef()
            mg.CopyFrom(model.meta_graph)
            mg.graph_def.CopyFrom(graph_def)
            msg = mg
        else:
            msg = graph_def
        binary = model.binary
        if out.endswith((".pbtxt", ".txt")):
            binary = False
        elif out.endswith((".pb", ".meta")):
            binary = True
        _write(out, msg, binary)
        written.append(out)
        base = out
        for suf in (".pbtxt", ".pb", ".meta", ".txt"):
            if base.endswith(suf):
                base = base[: -len(suf)]
                break
        report_path = base + ".report.json"
    if report is not None:
        with open(report_path, "w", encoding="utf-8") as fh:
            fh.write(report.dumps(indent=1))
        written.append(report_path)
    return written


def _write(path, msg, binary):
    from google.protobuf import text_format

    if binary:
        with open(path, "wb") as fh:
            fh.write(msg.SerializeToString())
    else:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text_format.MessageToString(msg))


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------
#: variable node op -> kind ("resource" handles or TF1 "ref" variables)
VARIABLE_NODE_KINDS = {"VarHandleOp": "resource", "VariableV2": "ref", "Variable": "ref"}


@dataclasses.dataclass
class Runnable:
    """A self-contained graph with named inputs and outputs, and the values
    of its variables.

    ``graph_def`` is either frozen (no variables: a GraphDef, a TF2
    SavedModel signature) or keeps the MetaGraph's variables, optimizer slots
    and train op as they are (a TF1 MetaGraph / SavedModel).  In the second
    case ``variables`` maps each variable *node* (``VarHandleOp`` or
    ``VariableV2``) to its value, read once from ``--checkpoint`` or the
    graph's initializers: :class:`StepSession` loads exactly these values into
    every graph it runs (the FP32 one and the rewritten one) before each
    step, so both start from the same weights and a step that fetches the
    train op really updates them (forward + backward + apply).
    """

    graph_def: object
    inputs: dict  # key -> tensor name (placeholders of graph_def)
    outputs: dict  # key -> tensor name (or ``op:0`` of an op without outputs, e.g. the train op)
    variables: dict = dataclasses.field(default_factory=dict)
    weights_from: str = "constants"
    notes: list = dataclasses.field(default_factory=list)  # what the loader had to change, for the user

    @property
    def fetch_nodes(self):
        return sorted({_node_of(t) for t in self.outputs.values()})

    @property
    def input_nodes(self):
        return sorted({_node_of(t) for t in self.inputs.values()})

    @property
    def preserve_nodes(self):
        """Nodes a rewrite must keep by name: the inputs and the variables."""
        return sorted(set(self.input_nodes) | set(self.variables))

    @property
    def training(self) -> bool:
        """True when an output is an op that changes a variable (a train op)."""
        return bool(self.variables) and _updates_variables(self.graph_def, self.fetch_nodes)


def _updates_variables(graph_def, fetch_nodes) -> bool:
    nodes = {n.name: n for n in graph_def.node}
    seen, stack = set(), list(fetch_nodes)
    while stack:
        name = stack.pop()
        if name in seen or name not in nodes:
            continue
        seen.add(name)
        op = nodes[name].op
        if op.startswith(("Apply", "ResourceApply", "Assign", "ResourceScatter", "ScatterAdd", "ScatterUpdate",
                          "ResourceSparseApply", "SparseApply")):
            return True
        stack.extend(_node_of(i) for i in nodes[name].input[:])
    return False


def runnable(model: Model, checkpoint: str | None = None) -> Runnable:
    """What dump / compare / tune / profile run.

    * a frozen GraphDef runs as it is;
    * a TF2 SavedModel signature is frozen (variables -> constants);
    * a TF1 MetaGraph or SavedModel keeps its variables (resource *and* ref)
      and everything its outputs need, the train op's update ops included.
      The variable values come from ``checkpoint`` (a checkpoint prefix or a
      directory holding one) when given, else from the SavedModel's variables,
      else from the graph's initializers (run once, so the FP32 and the
      rewritten graph get the same random draws).
    """
    import tensorflow as tf

    gd = model.graph_def
    has_vars = any(n.op in VARIABLE_OPS for n in gd.node)
    has_calls = any(n.op in ("StatefulPartitionedCall", "PartitionedCall") for n in gd.node)
    if model.kind == "graphdef":
        if checkpoint:
            raise ToolError(f"--checkpoint '{checkpoint}' given but '{model.path}' is a frozen GraphDef, which "
                            "has no variables to restore; pass the MetaGraph (.meta) instead")
        if has_vars:
            raise ToolError(f"GraphDef '{model.path}' holds variables; freeze it first or pass the "
                            "MetaGraph (.meta) or SavedModel directory instead")
        return Runnable(gd, dict(model.inputs), dict(model.outputs))
    if model.kind == "savedmodel" and model.meta_graph.object_graph_def.nodes and has_calls:
        if checkpoint:
            raise ToolError(f"--checkpoint '{checkpoint}' given but '{model.path}' is a TF2 SavedModel, whose "
                            "variables are in the SavedModel itself; accepted: a TF1 MetaGraph (.meta)")
        return _runnable_tf2_saved_model(model)
    ckpt = _checkpoint_prefix(checkpoint) if checkpoint else None
    out_nodes = model.fetch_nodes
    sub = tf.compat.v1.graph_util.extract_sub_graph(gd, sorted(set(out_nodes + model.input_nodes)))
    notes = _stub_orphan_py_funcs(sub)
    var_nodes = {n.name: n.op for n in sub.node if n.op in VARIABLE_NODE_KINDS}
    g = tf.Graph()
    with g.as_default(), tf.compat.v1.Session(graph=g, config=session_config()) as sess:
        try:
            if model.kind == "savedmodel":
                tags = list(model.meta_graph.meta_info_def.tags)
                tf.compat.v1.saved_model.loader.load(sess, tags, model.path)
                saver, source = None, "SavedModel variables"
            else:
                saver = tf.compat.v1.train.import_meta_graph(_importable_meta(model.meta_graph),
                                                             clear_devices=True)
                source = "initializers"
                _run_initializers(sess, g)
            if ckpt:
                if saver is None:
                    saver = tf.compat.v1.train.Saver()
                saver.restore(sess, ckpt)
                source = f"checkpoint {ckpt}"
        except (tf.errors.OpError, ValueError, KeyError) as exc:
            what = f"checkpoint '{checkpoint}' into '{model.path}'" if ckpt else f"'{model.path}'"
            raise ToolError(f"cannot load {what}: {_first_line(exc)}") from None
        values = _read_variables(sess, g, var_nodes, model.path)
    return Runnable(sub, dict(model.inputs), dict(model.outputs), values, source, notes)


_PY_FUNC_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def _stub_orphan_py_funcs(graph_def) -> list[str]:
    """Replace (in place) each ``tf.py_function`` / ``tf.compat.v1.py_func``
    node that nothing reads as data (a side effect only, e.g. logging) by a
    constant of its one output dtype, keeping its inputs as control inputs.

    TF never serializes the Python callable of a py_func: a MetaGraph that
    holds one cannot run in another process (TF fails with "Could not find
    callback").  The typical case is logging (``AMP_Optimizer``'s loss-scale
    event log), read by nothing but control dependencies.  A py_func whose
    value is used stays as it is and runs only where its callback is
    registered.  Returns one note per replaced node."""
    notes = []

    def read_as_data(nodes):
        return {i.split(":")[0] for n in nodes for i in n.input[:] if not i.startswith("^")}

    def stub(node, where, read, valid=None):
        touts = node.attr["Tout"].list.type[:]
        if len(touts) != 1 or node.name in read:
            return
        import tensorflow as tf

        dtype = tf.dtypes.as_dtype(touts[0])
        value = tf.make_tensor_proto(np.zeros([], dtype.as_numpy_dtype), dtype=dtype)
        ctrl = ["^" + i.lstrip("^").split(":")[0] for i in node.input[:]
                if valid is None or i.lstrip("^").split(":")[0] in valid]
        op = node.op
        node.op = "Const"
        del node.input[:]
        node.input.extend(sorted(set(ctrl)))
        for k in list(node.attr):
            if k not in ("_class",):
                del node.attr[k]
        node.attr["dtype"].type = dtype.as_datatype_enum
        node.attr["value"].tensor.CopyFrom(value)
        notes.append(f"{op} '{node.name}'{where} (a Python side effect nothing reads) is not called: TF does "
                     "not save py_func code in a MetaGraph")

    read = read_as_data(graph_def.node)
    for node in graph_def.node:
        if node.op in _PY_FUNC_OPS:
            stub(node, "", read)
    for fn in graph_def.library.function:
        valid = {n.name for n in fn.node_def}  # control inputs must name nodes, not arguments
        read = read_as_data(fn.node_def) | {v.split(":")[0] for v in fn.ret.values()}
        for node in fn.node_def:
            if node.op in _PY_FUNC_OPS:
                stub(node, f" in function {fn.signature.name}", read, valid)
    return notes


def _importable_meta(mg):
    """``mg`` without collection entries that name no node of the graph.

    ``tf.compat.v1.train.import_meta_graph`` fails on such an entry.  They
    occur in real exports: an optimizer whose ``apply_gradients`` runs inside
    a ``tf.cond`` (control flow v2, e.g. an overflow-skip) adds the op *in the
    cond's function body* to the outer graph's ``train_op`` collection."""
    from tensorflow.core.protobuf import meta_graph_pb2

    names = {n.name for n in mg.graph_def.node}
    if all(_node_of(v) in names for col in mg.collection_def.values() for v in col.node_list.value):
        return mg
    out = meta_graph_pb2.MetaGraphDef()
    out.CopyFrom(mg)
    for col in out.collection_def.values():
        keep = [v for v in col.node_list.value if _node_of(v) in names]
        if len(keep) != len(col.node_list.value):
            del col.node_list.value[:]
            col.node_list.value.extend(keep)
    return out


def _checkpoint_prefix(path: str) -> str:
    import tensorflow as tf

    path = os.fspath(path)
    if os.path.isdir(path):
        prefix = tf.train.latest_checkpoint(path)
        if prefix is None:
            raise ToolError(f"checkpoint directory '{path}' holds no checkpoint (no 'checkpoint' state file); "
                            "accepted: a checkpoint prefix such as model.ckpt-100 or its directory")
        return prefix
    if not (os.path.exists(path + ".index") or os.path.exists(path)):
        raise ToolError(f"checkpoint '{path}' does not exist (no '{path}.index'); accepted: a checkpoint prefix "
                        "such as model.ckpt-100, or a directory holding one")
    return path


def _run_initializers(sess, g):
    """Every initializer the MetaGraph's collections name (global and local
    variables, tables), in one run."""
    import tensorflow as tf

    init = [v.initializer for v in tf.compat.v1.global_variables() + tf.compat.v1.local_variables()]
    init += list(g.get_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS))
    if init:
        sess.run(init)


def _read_variables(sess, g, var_nodes: dict, path: str) -> dict:
    """{variable node: ndarray} read in ``sess``; a ToolError names the
    variables that have no value (no initializer, not in the checkpoint)."""
    import tensorflow as tf

    if not var_nodes:
        return {}
    names = sorted(var_nodes)
    with g.as_default(), g.name_scope("npu_amp_read"):
        ops = [g.get_operation_by_name(n) for n in names]
        inited = [tf.raw_ops.VarIsInitializedOp(resource=op.outputs[0]) if var_nodes[op.name] == "VarHandleOp"
                  else tf.compat.v1.is_variable_initialized(op.outputs[0]) for op in ops]
        reads = [tf.raw_ops.ReadVariableOp(resource=op.outputs[0], dtype=op.get_attr("dtype"))
                 if var_nodes[op.name] == "VarHandleOp" else tf.identity(op.outputs[0]) for op in ops]
    missing = [n for n, ok in zip(names, sess.run(inited)) if not ok]
    if missing:
        raise ToolError(f"variable(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} of "
                        f"'{path}' have no value: no initializer in the MetaGraph's collections and no "
                        "--checkpoint holding them")
    return dict(zip(names, sess.run(reads)))


class StepSession:
    """One graph in a ``tf.compat.v1.Session`` with a :class:`Runnable`'s
    variable values loaded.

    ``reset()`` (called by the constructor) assigns every variable of
    ``variables`` that the graph holds from a fed placeholder, so a training
    step can be repeated from the same weights.  ``run`` fetches tensor names
    and, for an output that names an op without outputs (``train:0`` for a
    train op), runs that op and returns ``None`` in its place.
    """

    def __init__(self, graph_def, variables: dict | None = None, graph=None, config=None):
        import tensorflow as tf

        self.graph = graph if graph is not None else import_graph(graph_def)
        self._assign, self._feed = [], {}
        with self.graph.as_default(), self.graph.name_scope("npu_amp_load"):
            for name, value in sorted((variables or {}).items()):
                try:
                    op = self.graph.get_operation_by_name(name)
                except KeyError:
                    continue  # not part of this graph (pruned by the rewrite)
                dtype = op.get_attr("dtype")
                ph = tf.compat.v1.placeholder(dtype, shape=np.shape(value))
                if op.type == "VarHandleOp":
                    self._assign.append(tf.raw_ops.AssignVariableOp(resource=op.outputs[0], value=ph))
                else:
                    self._assign.append(tf.compat.v1.assign(op.outputs[0], ph, validate_shape=False).op)
                self._feed[ph] = value
        self.session = tf.compat.v1.Session(graph=self.graph, config=config or session_config())
        self.reset()

    def reset(self):
        if self._assign:
            self.session.run(self._assign, feed_dict=self._feed)

    def resolve(self, name: str):
        """``op:0`` of an op with no outputs -> the op (a run target)."""
        node = _node_of(name)
        try:
            op = self.graph.get_operation_by_name(node)
        except KeyError:
            raise ToolError(f"'{name}' is not a node of the graph being run") from None
        return op if not op.outputs else self.graph.get_tensor_by_name(tensor_ref(name))

    def run(self, fetches, feeds: dict, options=None, run_metadata=None, what: str = "the graph"):
        import tensorflow as tf

        targets = [self.resolve(f) if isinstance(f, str) else f for f in fetches]
        try:
            vals = self.session.run(targets, feed_dict=feeds, options=options, run_metadata=run_metadata)
        except tf.errors.OpError as exc:
            raise ToolError(f"running {what} failed: {_first_line(exc.message)}") from None
        return [None if isinstance(t, tf.Operation) else v for t, v in zip(targets, vals)]

    def close(self):
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def inlined_graph_def(model: Model, for_saving: bool = False):
    """The model's graph as a Session would hand it to the pass: function
    calls inlined by grappler's function optimizer (:mod:`npu_amp_tf.inline`,
    the one rule every offline entry point follows), the model's inputs,
    outputs and saver / collection nodes kept by name.

    ``for_saving``: the graph will be written back as the same model.  A TF2
    SavedModel is loaded through its function library
    (``tf.saved_model.load`` runs the signature *functions*), so the signature
    functions' bodies are inlined too (signatures kept) and every library
    function the object graph may name is kept."""
    from .. import inline

    gd = model.graph_def
    tf2 = model.kind == "savedmodel" and bool(model.meta_graph.object_graph_def.nodes)
    try:
        if for_saving and tf2:
            sig_nodes = {_node_of(t.name) for sig in model.meta_graph.signature_def.values()
                         for t in sig.outputs.values()}
            gd = inline.inline_bodies(gd, inline.called_functions(gd, sig_nodes))
            return inline.merge_library(inline.inline_calls(gd, model.fetch_nodes, model.preserve_nodes()),
                                        gd.library)
        return inline.inline_calls(gd, model.fetch_nodes, model.preserve_nodes())
    except inline.InlineError as exc:
        raise ToolError(str(exc)) from None


def _runnable_tf2_saved_model(model: Model) -> Runnable:
    import tensorflow as tf

    from .. import _tf

    try:
        loaded = tf.saved_model.load(model.path, tags=list(model.meta_graph.meta_info_def.tags))
    except Exception as exc:  # noqa: BLE001 - TF raises many kinds here
        raise ToolError(f"cannot load SavedModel '{model.path}': {_first_line(exc)}") from None
    fn = loaded.signatures[model.signature]
    frozen_fn = _tf.convert_variables_to_constants_v2(fn)
    gd = frozen_fn.graph.as_graph_def()
    # Map signature keys to the frozen graph's placeholders / outputs.
    arg_keys = [k for k in sorted(fn.structured_input_signature[1])] if isinstance(
        fn.structured_input_signature[1], dict) else []
    placeholders = [t.name for t in frozen_fn.inputs if t.dtype != tf.resource]
    inputs = {}
    spec = fn.structured_input_signature[1]
    if isinstance(spec, dict) and len(spec) == len(placeholders):
        by_name = {_node_of(p): p for p in placeholders}
        for k in arg_keys:
            sname = spec[k].name or k
            inputs[k] = by_name.get(sname, by_name.get(k))
        if any(v is None for v in inputs.values()):
            inputs = dict(zip(arg_keys, placeholders))
    else:
        inputs = {_node_of(p): p for p in placeholders}
    outputs = {}
    struct = frozen_fn.structured_outputs
    flat_out = [t.name for t in frozen_fn.outputs]
    if isinstance(struct, dict):
        keys = sorted(struct)
        flat = tf.nest.flatten(struct)
        names = [t.name for t in flat]
        for k, t in zip(keys, names):
            outputs[k] = t
    else:
        outputs = {_node_of(t): t for t in flat_out}
    return Runnable(gd, inputs, outputs)


def _first_line(exc) -> str:
    """The first informative line of an error (TF >= 2.11 starts a Session
    error with a bare "Graph execution error:")."""
    s = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in s.splitlines() if ln.strip()]
    for ln in lines:
        if ln.rstrip(":") not in ("Graph execution error", "Detected at node") and not ln.startswith(
                ("Detected at node", "Traceback", "File ")):
            return ln
    return lines[0]


def load_inputs(path: str, run: Runnable, allow_missing: bool = False) -> dict:
    """Read an ``.npz`` whose keys name the placeholders (``x`` or ``x:0``,
    or a signature input key).  Returns {tensor name: array}.  A key that
    matches no input, or an input with no key, is a :class:`ToolError`."""
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ToolError(f"inputs file '{path}' does not exist") from None
    except (OSError, ValueError) as exc:
        raise ToolError(f"inputs file '{path}' is not a readable .npz: {_first_line(exc)}") from None
    if not hasattr(data, "files"):
        raise ToolError(f"inputs file '{path}' is a single .npy array; expected an .npz keyed by placeholder name")
    lookup = {}
    for key, tname in run.inputs.items():
        for alias in (key, tensor_ref(key), tname, _node_of(tname)):
            lookup[alias] = tname
    feeds = {}
    for key in data.files:
        if key not in lookup:
            raise ToolError(f"inputs file '{path}': key '{key}' matches no placeholder; "
                            f"expected keys: {', '.join(sorted(run.inputs)) or '(the graph has no inputs)'}")
        feeds[lookup[key]] = data[key]
    missing = [k for k, t in run.inputs.items() if t not in feeds]
    if missing and not allow_missing:
        raise ToolError(f"inputs file '{path}' has no value for placeholder(s) {', '.join(missing)}; "
                        f"its keys are: {', '.join(data.files) or '(none)'}")
    _check_shapes(run, feeds, path)
    return feeds


def _check_shapes(run: Runnable, feeds: dict, path: str):
    import tensorflow as tf

    nodes = {n.name: n for n in run.graph_def.node}
    for tname, arr in feeds.items():
        node = nodes.get(_node_of(tname))
        if node is None or "shape" not in node.attr:
            continue
        shape = tf.TensorShape(node.attr["shape"].shape)
        if shape.rank is not None and not shape.is_compatible_with(arr.shape):
            raise ToolError(f"inputs file '{path}': '{_node_of(tname)}' has shape {tuple(arr.shape)} but the "
                            f"placeholder expects {shape}")


def synthetic_inputs(run: Runnable, batch: int = 2, seed: int = 0) -> dict:
    """Random feeds for every placeholder (unknown dims become ``batch``)."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    nodes = {n.name: n for n in run.graph_def.node}
    feeds = {}
    for key, tname in run.inputs.items():
        node = nodes[_node_of(tname)]
        dtype = tf.dtypes.as_dtype(node.attr["dtype"].type)
        shape = tf.TensorShape(node.attr["shape"].shape) if "shape" in node.attr else tf.TensorShape(None)
        dims = [batch] if shape.rank is None else [d if d is not None else batch for d in shape.as_list()]
        if dtype.is_floating:
            arr = rng.standard_normal(dims).astype(dtype.as_numpy_dtype)
        elif dtype.is_integer:
            arr = rng.integers(0, 2, size=dims).astype(dtype.as_numpy_dtype)
        elif dtype == tf.bool:
            arr = rng.integers(0, 2, size=dims).astype(bool)
        else:
            raise ToolError(f"cannot synthesise input '{key}' of dtype {dtype.name}; pass --inputs")
        feeds[tname] = arr
    return feeds


#: Session threads for every tool run (None: TensorFlow's own choice); the CLI's --threads sets it.
THREADS: int | None = None


def session_config(threads: int | None = None, grappler: bool = True):
    """A plain ConfigProto for running already-rewritten graphs: our plugin is
    not registered, and TF's remapper is off (it fuses ops into kernels with no
    FP16 CPU implementation, and it aborts TF 2.15 on some graphs).
    ``grappler=False`` turns grappler and the classic graph optimizer's
    constant folding off, so the graph runs node for node as written (what
    ``dump`` needs).  ``threads`` (default
    :data:`THREADS`, else TF's own choice) sets intra- and inter-op threads."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    cfg = config_pb2.ConfigProto(allow_soft_placement=True)
    ro = cfg.graph_options.rewrite_options
    ro.remapping = rewriter_config_pb2.RewriterConfig.OFF
    ro.auto_mixed_precision = rewriter_config_pb2.RewriterConfig.OFF
    if not grappler:
        ro.disable_meta_optimizer = True
        cfg.graph_options.optimizer_options.opt_level = config_pb2.OptimizerOptions.L0
        cfg.graph_options.optimizer_options.do_constant_folding = False
    threads = THREADS if threads is None else threads
    if threads:
        cfg.intra_op_parallelism_threads = threads
        cfg.inter_op_parallelism_threads = threads
    return cfg


def import_graph(graph_def):
    """Import into a fresh ``tf.Graph``; returns it.  Errors become ToolError."""
    import tensorflow as tf

    g = tf.Graph()
    with g.as_default():
        try:
            tf.graph_util.import_graph_def(graph_def, name="")
        except (ValueError, tf.errors.OpError) as exc:
            raise ToolError(f"graph does not import into TensorFlow: {_first_line(exc)}") from None
    return g


def run_graph(graph_def, feeds: dict, fetches: list[str], options=None, run_metadata=None, graph=None,
              variables: dict | None = None):
    """One ``Session.run`` of ``graph_def`` (with ``variables`` loaded, see
    :class:`StepSession`); returns the fetched arrays (``None`` for ops)."""
    with StepSession(graph_def, variables, graph=graph) as sess:
        return sess.run(list(fetches), feeds, options=options, run_metadata=run_metadata)


def rewrite_runnable(run: Runnable, options):
    """Rewrite the runnable's graph with the pipeline; inputs, outputs and
    variables are preserved.  Returns (GraphDef, Report)."""
    from ..pipeline import optimize

    return optimize(run.graph_def, options, fetches=run.fetch_nodes, preserve=run.preserve_nodes)
