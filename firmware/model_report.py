"""``qsched inspect MODEL.tflite``: what a model holds and what a board needs to train it.

It prints, for any ``.tflite`` file, every operator with what qsched does with it (a
layer it runs, an adapter at the edge, shape arithmetic it folds away, or unsupported),
the file's input and output with their quantisation, and, when the file imports, every
layer with its output shape, parameters and MACs, whether it can be trained, the name
a board knows it by, and the memory a C board needs to train the last layer and all
layers. A file that does not import still gets its operator list, with every
unsupported operator marked, and the reason; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from qsched.firmware.budget import model_budget
from qsched.zo._tflite_common import op_name, schema
from qsched.zo._tflite_import import ADAPTER_OPERATORS, FOLDABLE_OPERATORS, SUPPORTED_OPERATORS
from qsched.zo.blob import blob_name
from qsched.zo.clamping import clamping_report
from qsched.zo.datasets import load_dataset
from qsched.zo.errors import DatasetError, TFLiteError
from qsched.zo.graph import QuantModel
from qsched.zo.tflite_io import import_tflite
from qsched.zo.zoo import infer_shapes, model_summary, node_macs

__all__ = ["OperatorRow", "clamping_lines", "inspect_report", "main", "operator_rows"]

_SHOWN_NAME = 48  # characters of a converter's long names shown in a table


@dataclass(frozen=True)
class OperatorRow:
    """One operator of the file."""

    index: int
    name: str
    output: str  # the first output tensor's name and shape
    role: str  # layer, adapter, folded, unsupported


def operator_rows(data: bytes, qmodel: QuantModel | None) -> list[OperatorRow]:
    """Every operator of the file's first subgraph and its role in qsched.

    Args:
        data: the file's bytes (already known to parse as a flatbuffer).
        qmodel: the imported model, or None when the import failed.
    """
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    graph = model.subgraphs[0]
    source = qmodel.source if qmodel is not None else None
    # A file that did not import: every operator that could be an adapter or folded is
    # shown as one (whether it sits where that works is the import's to say).
    adapters = {*source.input_ops, *source.output_ops} if source else set(ADAPTER_OPERATORS)
    folded = set(source.folded_ops) if source else set(FOLDABLE_OPERATORS)
    rows = []
    for k, op in enumerate(graph.operators or []):
        code = model.operatorCodes[op.opcodeIndex]
        name = op_name(max(int(code.builtinCode), int(code.deprecatedBuiltinCode)))
        out = graph.tensors[op.outputs[0]] if op.outputs is not None and len(op.outputs) else None
        label = (out.name.decode() if out is not None else "")[:_SHOWN_NAME]
        shape = [int(d) for d in out.shape] if out is not None and out.shape is not None else []
        rows.append(OperatorRow(k, name, f"{label} {shape}", _role(name, adapters, folded)))
    return rows


def _role(name: str, adapters: set[str], folded: set[str]) -> str:
    if name in adapters:
        return "adapter (kept in the file, not trained)"
    if name in folded:
        return "folded (static shape arithmetic)"
    supported = name in SUPPORTED_OPERATORS
    return "layer" if supported else "UNSUPPORTED"


def _layer_lines(qmodel: QuantModel) -> list[str]:
    shapes = infer_shapes(qmodel.model)
    lines = [
        "| # | layer | op | output | params | MACs | trainable | board name |",
        "| ---: | --- | --- | --- | ---: | ---: | --- | --- |",
    ]
    params = {n.name: int(n.weight.size + n.bias.size) for n in qmodel.model.param_nodes()}
    for k, node in enumerate(qmodel.model.nodes):
        count = params.get(node.name, 0)
        lines.append(
            f"| {k} | {node.name[:_SHOWN_NAME]} | {type(node).__name__} "
            f"| {list(shapes[node.output])} | {count} | {node_macs(node, shapes[node.output])} "
            f"| {'yes' if node.name in params else '-'} | {blob_name(node.name).decode()} |"
        )
    return lines


def _memory_lines(qmodel: QuantModel) -> list[str]:
    layers = [n.name for n in qmodel.model.param_nodes()]
    kib = lambda n: f"{n / 1024:.1f} KiB"  # noqa: E731
    lines = ["| trained | P (int8 weights) | blob | region | with agent and stack |"]
    lines.append("| --- | ---: | ---: | ---: | ---: |")
    for label, chosen in (("last layer", layers[-1:]), ("all layers", layers)):
        b = model_budget(qmodel, chosen)
        lines.append(f"| {label} | {b.params} | {kib(b.blob)} | {kib(b.region)} | {kib(b.total)} |")
    return lines


def inspect_report(
    path: Path, dataset: str | None = None, samples: int | None = None
) -> tuple[str, bool]:
    """The report on one file, and whether it imports; with ``dataset``, the section on
    its activations there (``clamping_lines``) when it imports.

    Raises:
        OSError: the file cannot be read.
        DatasetError: ``dataset`` cannot be loaded or does not fit the model.
    """
    data = path.read_bytes()
    try:
        qmodel: QuantModel | None = import_tflite(data)
        problem = ""
    except TFLiteError as exc:
        qmodel, problem = None, str(exc)
    if qmodel is None and problem.startswith(("not a .tflite", "malformed", "the .tflite")):
        return f"{path}: {problem}", False
    lines = [f"# {path}", ""]
    lines += _edge_lines(qmodel)
    lines += [
        "",
        "## Operators",
        "",
        "| # | operator | output | role |",
        "| ---: | --- | --- | --- |",
    ]
    lines += [
        f"| {r.index} | {r.name} | {r.output} | {r.role} |" for r in operator_rows(data, qmodel)
    ]
    if qmodel is None:
        lines += ["", f"Does not import: {problem}"]
        return "\n".join(lines), False
    params, macs = model_summary(qmodel.model)
    lines += ["", f"## Layers ({params:,} parameters, {macs:,} MACs per sample)", ""]
    lines += _layer_lines(qmodel)
    lines += ["", "## Memory a C board needs (INT8, FP16 accumulation buffer)", ""]
    lines += _memory_lines(qmodel)
    if dataset:
        lines += ["", *clamping_lines(qmodel, dataset, samples)]
    return "\n".join(lines), True


def _edge_lines(qmodel: QuantModel | None) -> list[str]:
    if qmodel is None or qmodel.source is None:
        return []
    source = qmodel.source
    logits = qmodel.tensors[qmodel.model.output_name]
    return [
        f"- input: `{source.input.name}` {source.input.describe()}"
        + (f", then {' -> '.join(source.input_ops)}" if source.input_ops else ""),
        f"- output: `{source.output.name}` {source.output.describe()}"
        + (f", after {' -> '.join(source.output_ops)}" if source.output_ops else ""),
        f"- trained graph: {list(qmodel.model.input_shape)} -> "
        f"{qmodel.model.num_classes} int8 logits (scale {logits.scale:.6g}, zp "
        f"{logits.zero_point}); the training loss is taken on these",
    ]


def clamping_lines(qmodel: QuantModel, dataset_spec: str, samples: int | None) -> list[str]:
    """The section on how the model's activations sit in their int8 ranges on the
    validation split of ``dataset_spec`` (its first ``samples``; all when None).

    Raises:
        DatasetError: the data set cannot be loaded or does not fit the model.
    """
    data = load_dataset(dataset_spec)
    if tuple(data.input_shape) != tuple(qmodel.model.input_shape):
        raise DatasetError(
            f"{dataset_spec}: inputs {list(data.input_shape)} do not fit the model's "
            f"{list(qmodel.model.input_shape)}"
        )
    x, y = data.x_val[:samples], data.y_val[:samples]
    labelled = data.num_classes == qmodel.model.num_classes
    report = clamping_report(qmodel, x, y if labelled else None)
    lines = [
        f"## Activations on {dataset_spec} (validation split, {report.samples} samples)",
        "",
        "| # | layer | op | real range | at -128 | at 127 |",
        "| ---: | --- | --- | --- | ---: | ---: |",
    ]
    for t in report.tensors:
        # A range that starts at 0 (a fused ReLU, a pool of its outputs, a logistic):
        # -128 is the value 0 the op cannot go below, not a clamp.
        bottom = "floor (0)" if t.low == 0.0 else f"{100 * t.bottom:.2f} %"
        lines.append(
            f"| {t.index} | {t.node[:_SHOWN_NAME]} | {t.op} | [{t.low:.4g}, {t.high:.4g}] "
            f"| {bottom} | {100 * t.top:.2f} % |"
        )
    lines.append("")
    if report.int8_accuracy is None or report.float_accuracy is None:
        lines.append(
            f"- accuracy: not computed ({data.num_classes} classes in the data set, "
            f"{qmodel.model.num_classes} in the model)"
        )
    else:
        lines.append(
            f"- accuracy with int8 activations {100 * report.int8_accuracy:.2f} %; the same "
            f"weights with float activations {100 * report.float_accuracy:.2f} % (what "
            "the activation ranges cost)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """``qsched inspect``.

    Returns:
        0 when every file imports, 1 when one does not, 2 for a file that cannot be read.
    """
    parser = argparse.ArgumentParser(
        prog="qsched inspect",
        description="Show a .tflite model's operators, layers and the memory a board needs.",
    )
    parser.add_argument("models", nargs="+", type=Path, metavar="MODEL.tflite")
    parser.add_argument(
        "--dataset",
        metavar="SPEC",
        help="also run the model over this data set's validation split (a job spec's "
        "dataset string, e.g. eurosat:size=32,scale=255) and show, per layer, the share "
        "of activations clamped at -128 and 127, and the accuracy with int8 against "
        "float activations",
    )
    parser.add_argument(
        "--samples", type=int, metavar="N", help="with --dataset: its first N samples only"
    )
    args = parser.parse_args(argv)
    if args.samples is not None and args.samples < 1:
        parser.error("--samples must be at least 1")
    status = 0
    for path in args.models:
        try:
            report, imports = inspect_report(path, args.dataset, args.samples)
        except OSError as exc:
            print(f"qsched inspect: {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except DatasetError as exc:
            print(f"qsched inspect: {exc}", file=sys.stderr)
            return 2
        print(report + "\n")
        status = max(status, 0 if imports else 1)
    return status
