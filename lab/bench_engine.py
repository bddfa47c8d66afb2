"""``qsched bench engine``: perturbed INT8 forward passes per second, engine vs LiteRT.

One ZO step evaluates the same batch under ``2q`` perturbed weight sets. Both sides get
the same quantised model, batch and ``2q`` weight sets (``w ± eps z_k``, saturating to
``[-127, 127]``, ``z_k`` from the job PRNG), built before timing:

- the engine evaluates all ``2q`` sets in one ``run_int8_perturbed`` call (TFLite
  reference-kernel semantics; the native C kernels when built, else numpy);
- LiteRT runs the model exported with its weights as graph inputs, with the default
  (optimised) op resolver: per perturbation, ``set_tensor`` of every weight, ``invoke``
  and a copy of the logits. A constant-weight model would need a new interpreter per
  weight set, which is slower still, so this is the fair comparison.

Both sides run with the same thread count (``--threads``, default 1): that ratio is
the floor's. ``--extra-threads N`` (default 2) measures both sides again with N threads,
reported in extra columns. Each side gets one untimed warm-up call, then the two sides
are called alternately, so background load on a shared machine hits both alike.

Wall time is the best of a few repetitions, both measured in one run. LiteRT's
reference resolver (the bit-exactness oracle) runs once too, for context and to check
the engine's logits bit for bit. The floor the
engine must meet is a ratio engine/LiteRT of at least 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

import numpy as np
import numpy.typing as npt

from qsched.zo import native, prng
from qsched.zo.engine import run_int8_perturbed
from qsched.zo.graph import QuantModel
from qsched.zo.quantize import quantize_input, quantize_model
from qsched.zo.tflite_io import export_tflite, weight_tensor_name
from qsched.zo.zoo import build_model, model_summary

__all__ = ["BenchResult", "bench_model", "main"]

I8 = npt.NDArray[np.int8]
# name -> (zoo model, input shape, options): the small CNN and a MobileNetV2-style net.
MODELS: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]] = {
    "cnn": ("cnn", (8, 8, 1), {}),
    "mobilenetv2": (
        "mobilenetv2",
        (32, 32, 3),
        {"stages": 4, "max_repeats": 2, "last_channels": 128},
    ),
}
FLOOR = 1.0
# Stop repeating once one side has spent this long (keeps the command under 2 minutes).
_SIDE_BUDGET_S = 20.0


@dataclass(frozen=True)
class BenchResult:
    """One model's measurement; rates are perturbed forward passes (of ``batch`` samples)
    per second."""

    model: str
    trainable: str
    params: int
    macs: int
    q: int
    batch: int
    engine_s: float
    litert_s: float
    engine_rate: float
    litert_rate: float
    ratio: float
    max_abs_diff: int
    reference_rate: float
    reference_exact: bool
    threads: int = 1
    engine_backend: str = "numpy"
    engine_cpu_rate: float = 0.0
    litert_cpu_rate: float = 0.0
    extra_threads: int = 0
    engine_rate_extra: float = 0.0
    litert_rate_extra: float = 0.0
    ratio_extra: float = 0.0


def _weight_sets(qm: QuantModel, names: list[str], q: int, eps: int, seed: int) -> dict[str, I8]:
    """``2q`` perturbed copies (+z_k, -z_k for k < q) of the named int8 weights, stacked."""
    sizes = [qm.layers[n].weight.size for n in names]
    flat = np.concatenate([qm.layers[n].weight.ravel() for n in names]).astype(np.int16)
    copies = []
    for k in range(q):
        z = prng.rademacher(seed, 0, k, flat.size).astype(np.int16)
        copies += [flat + eps * z, flat - eps * z]
    stacked = np.clip(np.stack(copies), -127, 127).astype(np.int8)
    out, start = {}, 0
    for name, size in zip(names, sizes, strict=True):
        shape = qm.layers[name].weight.shape
        out[name] = np.ascontiguousarray(stacked[:, start : start + size].reshape(-1, *shape))
        start += size
    return out


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best wall time of ``repeats`` calls (fewer when one call exceeds the budget)."""
    best, result, spent = float("inf"), None, 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - t0
        best, spent = min(best, elapsed), spent + elapsed
        if spent + elapsed > _SIDE_BUDGET_S:
            break
    return best, result


def _litert_runner(
    qm: QuantModel, x: I8, sets: dict[str, I8], threads: int, reference: bool = False
) -> Callable[[], I8]:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    data = export_tflite(qm, batch=x.shape[0], weights_as_inputs=True)
    resolver = OpResolverType.BUILTIN_REF if reference else OpResolverType.AUTO
    it = Interpreter(
        model_content=data, num_threads=threads, experimental_op_resolver_type=resolver
    )
    it.allocate_tensors()
    index = {d["name"]: d["index"] for d in it.get_input_details()}
    it.set_tensor(index[qm.model.input_name], x)
    for name, layer in qm.layers.items():  # frozen layers: set once
        it.set_tensor(index[weight_tensor_name(name)], layer.weight)
    feeds = [(index[weight_tensor_name(n)], w) for n, w in sets.items()]
    out = it.get_output_details()[0]["index"]
    count = next(iter(sets.values())).shape[0]

    def run() -> I8:
        logits = []
        for p in range(count):
            for i, w in feeds:
                it.set_tensor(i, w[p])
            it.invoke()
            logits.append(it.get_tensor(out).copy())
        return np.stack(logits)

    return run


@dataclass
class _Timing:
    """Best wall and process-CPU seconds of one side, and its last result."""

    wall: float = float("inf")
    cpu: float = float("inf")
    result: Any = None

    def call(self, fn: Callable[[], Any]) -> float:
        w0, c0 = time.perf_counter(), time.process_time()
        self.result = fn()
        wall = time.perf_counter() - w0
        self.wall, self.cpu = min(self.wall, wall), min(self.cpu, time.process_time() - c0)
        return wall


def _best_pair(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[_Timing, _Timing]:
    """Best times of ``a`` and ``b`` called alternately (after one warm-up call each).

    Alternating puts both sides under the same background load on a shared machine, so
    their ratio is fairer than two back-to-back series. Process CPU time is kept too:
    with one thread per side it is what each side costs, whatever else the machine runs.
    """
    a()
    b()
    ta, tb = _Timing(), _Timing()
    spent = 0.0
    for _ in range(repeats):
        spent += ta.call(a) + tb.call(b)
        if spent > 2 * _SIDE_BUDGET_S:
            break
    return ta, tb


def _engine_runner(qm: QuantModel, x: I8, sets: dict[str, I8], threads: int) -> Callable[[], I8]:
    def run() -> I8:
        native.set_threads(threads)
        try:
            return run_int8_perturbed(qm, x, sets)
        finally:
            native.set_threads(None)

    return run


def bench_model(
    key: str,
    q: int = 16,
    batch: int = 32,
    repeats: int = 5,
    threads: int = 1,
    seed: int = 0,
    trainable: str = "all",
    extra_threads: int = 0,
) -> BenchResult:
    """Time one model's ``2q`` perturbed passes on the engine and on LiteRT.

    Args:
        key: a key of ``MODELS``.
        q: perturbations per step (``2q`` forward passes).
        batch: samples per forward pass.
        repeats: timing repetitions per side (the best counts).
        threads: threads of both sides (LiteRT interpreter, native engine kernels).
        seed: seeds the calibration data, the batch and the perturbations.
        trainable: ``"all"`` layers perturbed, or ``"head"`` (the last layer only, the
            transfer-learning setting, where the engine runs the frozen prefix once).
        extra_threads: when positive and not ``threads``, both sides are timed again
            with this many threads.

    Returns:
        The measurement.
    """
    name, shape, options = MODELS[key]
    model = build_model(name, input_shape=shape, seed=seed, **options)
    rng = np.random.default_rng(seed)
    qm = quantize_model(model, rng.normal(size=(64, *shape)).astype(np.float32))
    x = quantize_input(qm, rng.normal(size=(batch, *shape)).astype(np.float32))
    names = [n.name for n in model.param_nodes()]
    sets = _weight_sets(qm, names if trainable == "all" else names[-1:], q, eps=1, seed=seed)
    native.available()  # build the native kernels (first use) before any timing
    eng, lite = _best_pair(
        _engine_runner(qm, x, sets, threads), _litert_runner(qm, x, sets, threads), repeats
    )
    engine_s, ours, litert_s, theirs = eng.wall, eng.result, lite.wall, lite.result
    extra = (0.0, 0.0)
    if extra_threads > 0 and extra_threads != threads:
        e_t, l_t = _best_pair(
            _engine_runner(qm, x, sets, extra_threads),
            _litert_runner(qm, x, sets, extra_threads),
            repeats,
        )
        extra = (e_t.wall, l_t.wall)
    # The reference resolver once: its speed for context, and the engine's bits checked.
    reference_s, exact = _best(_litert_runner(qm, x, sets, threads, reference=True), 1)
    params, macs = model_summary(model)
    passes = 2 * q
    return BenchResult(
        model=key,
        trainable=trainable,
        params=params,
        macs=macs,
        q=q,
        batch=batch,
        engine_s=engine_s,
        litert_s=litert_s,
        engine_rate=passes / engine_s,
        litert_rate=passes / litert_s,
        ratio=litert_s / engine_s,
        max_abs_diff=int(np.abs(ours.astype(np.int16) - theirs.astype(np.int16)).max()),
        reference_rate=passes / reference_s,
        reference_exact=bool(np.array_equal(ours, exact)),
        threads=threads,
        engine_backend=native.build_info(),
        engine_cpu_rate=passes / eng.cpu if eng.cpu > 0 else 0.0,
        litert_cpu_rate=passes / lite.cpu if lite.cpu > 0 else 0.0,
        extra_threads=extra_threads if extra[0] else 0,
        engine_rate_extra=passes / extra[0] if extra[0] else 0.0,
        litert_rate_extra=passes / extra[1] if extra[1] else 0.0,
        ratio_extra=extra[1] / extra[0] if extra[0] else 0.0,
    )


def _table(results: Sequence[BenchResult]) -> str:
    t = results[0].threads if results else 1
    head: tuple[str, ...] = (
        "model",
        "perturbed",
        "params",
        "MACs/sample",
        f"engine pass/s {t}T",
        f"LiteRT pass/s {t}T",
        "engine step ms",
        "LiteRT step ms",
        f"ratio {t}T",
        "CPU ratio",
        "max|diff|",
        "LiteRT-ref pass/s",
        "ref bit-exact",
    )
    extra = next((r.extra_threads for r in results if r.extra_threads), 0)
    if extra:
        head += (f"engine pass/s {extra}T", f"LiteRT pass/s {extra}T", f"ratio {extra}T")
    rows = [head]
    for r in results:
        row: tuple[str, ...] = (
            r.model,
            r.trainable,
            f"{r.params:,}",
            f"{r.macs:,}",
            f"{r.engine_rate:.1f}",
            f"{r.litert_rate:.1f}",
            f"{1e3 * r.engine_s:.1f}",
            f"{1e3 * r.litert_s:.1f}",
            f"{r.ratio:.2f}",
            f"{r.engine_cpu_rate / r.litert_cpu_rate:.2f}" if r.litert_cpu_rate else "-",
            str(r.max_abs_diff),
            f"{r.reference_rate:.1f}",
            "yes" if r.reference_exact else "NO",
        )
        if extra:
            row += (
                f"{r.engine_rate_extra:.1f}",
                f"{r.litert_rate_extra:.1f}",
                f"{r.ratio_extra:.2f}",
            )
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    description = "Perturbed INT8 forward passes per second: the engine against LiteRT."
    p = argparse.ArgumentParser(prog="qsched bench engine", description=description)
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, from {sorted(MODELS)} (default: all)",
    )
    p.add_argument("--q", type=int, default=16, help="perturbations per step; 2q passes")
    p.add_argument("--batch", type=int, default=32, help="samples per forward pass")
    p.add_argument("--repeats", type=int, default=5, help="timing repetitions (best counts)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads of both sides (the floor compares equal thread counts)",
    )
    p.add_argument(
        "--extra-threads",
        type=int,
        default=2,
        help="also time both sides with this many threads (0: skip)",
    )
    p.add_argument(
        "--trainable",
        default="all,head",
        help="comma-separated: all (every layer perturbed), head (last layer only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--check",
        action="store_true",
        help=f"exit with status 1 when a ratio is below the floor ({FLOOR})",
    )
    return p


def _header(args: argparse.Namespace, keys: Sequence[str]) -> str:
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    backend = native.build_info()
    kernels = (
        f"native C kernels ({backend}), {args.threads} thread(s)"
        if backend != "numpy"
        else f"numpy {np.__version__} kernels (native unavailable), BLAS threads: {blas}"
    )
    extra = (
        f"; extra columns: both sides with {args.extra_threads} threads"
        if args.extra_threads > 0 and args.extra_threads != args.threads
        else ""
    )
    models = ", ".join(
        f"{k} ({MODELS[k][0]}, input {'x'.join(map(str, MODELS[k][1]))})" for k in keys
    )
    return "\n".join(
        [
            f"INT8 perturbed forward passes: models {models}; q={args.q} ({2 * args.q} passes per "
            f"step), batch {args.batch}, best of {args.repeats} alternating calls per side after a "
            "warm-up call each",
            f"engine: qsched run_int8_perturbed, TFLite reference-kernel semantics, {kernels}",
            f"LiteRT: ai-edge-litert {metadata.version('ai-edge-litert')} Interpreter, default "
            f"(optimised) op resolver, {args.threads} thread(s), weights as graph inputs, "
            f"set_tensor per perturbation{extra}",
            "ratio = engine pass/s / LiteRT pass/s (wall time; the floor's); CPU ratio = the same "
            "from each side's best process CPU time (robust to background load at 1 thread)",
            "max|diff| = logits, engine vs optimised LiteRT (only the reference resolver is "
            "bit-exact); LiteRT-ref = the reference resolver (BUILTIN_REF), one repetition, and "
            "whether the engine equals it",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print a table.

    Args:
        argv: command-line arguments after ``qsched bench engine``.

    Returns:
        0, or 1 with ``--check`` when the engine is slower than LiteRT on a model or
        differs from the reference kernels; 2 on bad arguments.
    """
    args = _parser().parse_args(list(argv) if argv is not None else None)
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    modes = [m.strip() for m in args.trainable.split(",") if m.strip()]
    unknown = [k for k in keys if k not in MODELS] + [m for m in modes if m not in ("all", "head")]
    if (
        unknown
        or args.q < 1
        or args.batch < 1
        or args.repeats < 1
        or args.threads < 1
        or args.extra_threads < 0
    ):
        print(
            f"bad arguments: unknown models or modes {unknown}"
            if unknown
            else "bad arguments: q, batch, repeats and threads must be positive",
            file=sys.stderr,
        )
        return 2
    native.available()
    print(_header(args, keys), flush=True)
    results = [
        bench_model(
            k, args.q, args.batch, args.repeats, args.threads, args.seed, m, args.extra_threads
        )
        for k in keys
        for m in modes
    ]
    print(_table(results))
    below = [f"{r.model}/{r.trainable}" for r in results if r.ratio < FLOOR]
    print(
        f"floor (ratio >= {FLOOR}, {args.threads} thread(s) each side): "
        + ("met" if not below else f"NOT met for {below}")
    )
    inexact = [f"{r.model}/{r.trainable}" for r in results if not r.reference_exact]
    print(
        "engine vs LiteRT reference kernels: "
        + ("bit-exact" if not inexact else f"DIFFERENT for {inexact}")
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 1 if args.check and (below or inexact) else 0
