"""Native INT8 kernels: ``_native/qsched_kernels.c`` built on first use, loaded with ctypes.

The numpy kernels in ``kernels_int8`` define the arithmetic (TFLite's reference integer
kernels); the C kernels compute the same integers without int64 temporaries, all P
perturbed copies and N samples in one call per layer. Functions here take the same
arguments as their ``kernels_int8`` namesakes and return the same bits.
``accumulate_signed`` sums an update's terms for ``qsched.zo.update`` (same bits as
its numpy loop); ``rademacher_rows`` computes perturbations' sign bits for
``qsched.zo.prng`` (the same bits as its numpy Philox).

Build: the system C compiler (``$CC`` or ``gcc``) with ``-O3 -march=native
-ffp-contract=off -fno-strict-aliasing``, into ``$XDG_CACHE_HOME/qsched/native/`` (else
``~/.cache/...``) under a name keyed by a hash of the source, the flags, the compiler's
version and the CPU's feature flags, written atomically. When no compiler is found or
the build fails, ``available()`` is False and one warning is logged; the engine then
uses numpy. ``QSCHED_NATIVE=0`` forces numpy; ``QSCHED_NATIVE_THREADS`` (default 1)
sets the threads per kernel call (work is split over samples; results do not depend on
it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qsched.zo.errors import NativeError
from qsched.zo.graph import Padding
from qsched.zo.kernels_fp32 import out_size, pad_amounts
from qsched.zo.kernels_int8 import AddParams, OutputStage

__all__ = [
    "CFLAGS",
    "NativeError",
    "accumulate_signed",
    "add",
    "available",
    "build_info",
    "conv2d",
    "dense",
    "depthwise_conv2d",
    "library_path",
    "rademacher_rows",
    "set_threads",
    "threads",
]

log = logging.getLogger(__name__)

CFLAGS: Final = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-fPIC",
    "-shared",
    "-pthread",
)
SOURCE: Final = Path(__file__).with_name("_native") / "qsched_kernels.c"
# Largest |w * (x - zp)|: the int32 accumulator holds K of them plus the bias (C file).
_MAX_PRODUCT: Final = 128 * 255
I8 = npt.NDArray[np.int8]
I64 = npt.NDArray[np.int64]
Array = npt.NDArray[Any]

_lock = threading.Lock()
_state: dict[str, Any] = {"lib": None, "tried": False, "threads": None}
_P8 = ctypes.POINTER(ctypes.c_int8)
_P32 = ctypes.POINTER(ctypes.c_int32)
_P64 = ctypes.POINTER(ctypes.c_int64)
_PF32 = ctypes.POINTER(ctypes.c_float)
_I = ctypes.c_int64


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qsched" / "native"


def _cpu_flags() -> str:
    """The CPU's feature line: ``-march=native`` code must not run on another CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "gcc"))


def library_path(cc: str | None = None) -> Path:
    """Where the shared library for this source, compiler and CPU lives (built or not).

    Args:
        cc: compiler path (default: ``$CC`` or ``gcc`` on the PATH).

    Returns:
        The cache path of the shared library.
    """
    cc = cc or _compiler() or "gcc"
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        " ".join(CFLAGS).encode(),
        version.encode(),
        _cpu_flags().encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return _cache_dir() / f"qsched_kernels-{h.hexdigest()[:16]}.so"


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *CFLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise NativeError(f"{cc} failed: {proc.stderr.strip()[:2000]}")
        os.replace(tmp, target)  # atomic: concurrent builders agree on the bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    conv_args: list[Any] = [_P8, _I, _I, _I, _I, _I, _P8, _I, _I, _I, _I]
    lib.qs_conv.argtypes = [
        *conv_args,
        _I,
        _P32,
        _I,
        _I,
        _I,
        _I,
        _I,
        _I,
        _I,
        _I,
        _P64,
        _I,
        _I,
        _I,
        _P8,
        _I,
    ]
    lib.qs_conv.restype = ctypes.c_int
    lib.qs_depthwise.argtypes = [
        *conv_args,
        _P32,
        _I,
        _I,
        _I,
        _I,
        _I,
        _I,
        _I,
        _I,
        _P64,
        _I,
        _I,
        _I,
        _P8,
        _I,
    ]
    lib.qs_depthwise.restype = ctypes.c_int
    lib.qs_add.argtypes = [_P8, _P8, _I, _P64, _P8]
    lib.qs_add.restype = ctypes.c_int
    lib.qs_accumulate_signed.argtypes = [_PF32, _P8, _PF32, _I, _I]
    lib.qs_accumulate_signed.restype = ctypes.c_int
    lib.qs_rademacher_rows.argtypes = [
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_uint32),
        _I,
        _I,
        ctypes.POINTER(ctypes.c_uint8),
    ]
    lib.qs_rademacher_rows.restype = ctypes.c_int
    lib.qs_build_info.argtypes = []
    lib.qs_build_info.restype = ctypes.c_char_p


def _load() -> ctypes.CDLL | None:
    """Build (once per source/compiler/CPU) and load the library; None when unavailable."""
    with _lock:
        if _state["tried"]:
            lib: ctypes.CDLL | None = _state["lib"]
            return lib
        _state["tried"] = True
        if os.environ.get("QSCHED_NATIVE", "1").strip() in ("0", "false", "no", "off"):
            return None
        cc = _compiler()
        try:
            if cc is None:
                raise NativeError("no C compiler found ($CC or gcc)")
            target = library_path(cc)
            if not target.exists():
                _build(cc, target)
            lib = ctypes.CDLL(str(target))
            _declare(lib)
        except (OSError, subprocess.SubprocessError, NativeError) as exc:
            log.warning("native INT8 kernels unavailable, using numpy: %s", exc)
            return None
        _state["lib"] = lib
        return lib


def available() -> bool:
    """Whether the native kernels are in use (built and loaded, not disabled).

    Returns:
        True when the C library loaded; False after one logged warning otherwise, or
        when ``QSCHED_NATIVE=0``.
    """
    return _load() is not None


def _lib() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise NativeError("native INT8 kernels are not available (see the logged warning)")
    return lib


def build_info() -> str:
    """The build's GEMM path (``avx512-vnni``, ``avx2`` or ``portable``), or ``numpy``."""
    lib = _load()
    return "numpy" if lib is None else str(lib.qs_build_info().decode())


def threads() -> int:
    """Threads per kernel call: ``set_threads``, else ``QSCHED_NATIVE_THREADS``, else 1."""
    if _state["threads"] is not None:
        return int(_state["threads"])
    try:
        return max(1, int(os.environ.get("QSCHED_NATIVE_THREADS", "1")))
    except ValueError:
        return 1


def set_threads(count: int | None) -> None:
    """Set the threads per kernel call (None: back to the environment's default).

    Args:
        count: a positive thread count, or None.
    """
    if count is not None and count < 1:
        raise ValueError("thread count must be positive")
    _state["threads"] = count


def _requant_table(stage: OutputStage, single_rounding: bool, channels: int) -> I64:
    """Per-channel ``[left, multiplier, add, threshold, right]`` for the C requantiser.

    The same integers as ``fixedpoint.multiply_by_quantized_multiplier`` (see the C
    file's requant_row for the formula and its bounds). Tables are cached by value: the
    engine prepares its stages anew on every call, with the same multipliers.
    """
    m = np.ascontiguousarray(stage.multiplier, np.int64)
    s = np.ascontiguousarray(stage.shift, np.int64)
    return _cached_table(m.tobytes(), s.tobytes(), m.shape, s.shape, single_rounding, channels)


@functools.lru_cache(maxsize=256)
def _cached_table(
    m_bytes: bytes,
    s_bytes: bytes,
    m_shape: tuple[int, ...],
    s_shape: tuple[int, ...],
    single_rounding: bool,
    channels: int,
) -> I64:
    m = np.broadcast_to(np.frombuffer(m_bytes, np.int64).reshape(m_shape), (channels,)).copy()
    s = np.broadcast_to(np.frombuffer(s_bytes, np.int64).reshape(s_shape), (channels,)).copy()
    table = _build_table(m, s, single_rounding, channels)
    table.flags.writeable = False  # shared by every caller
    return table


def _build_table(m: I64, s: I64, single_rounding: bool, channels: int) -> I64:
    """The table from per-channel multipliers and shifts (m and s are modified)."""
    never = np.full(channels, -(2**62), np.int64)  # below every x * m + add
    if single_rounding:
        big = s > 30
        m[big], s[big] = 2**31 - 1, 30
        right = 31 - s
        return np.stack([np.zeros(channels, np.int64), m, np.int64(1) << (right - 1), never, right])
    left = np.maximum(s, 0)
    e = np.maximum(-s, 0)
    half = (np.int64(1) << e) >> 1
    thr = np.where(e > 0, half << 31, never)
    return np.stack([left, m, (1 << 30) + (half << 31), thr, 31 + e])


def _fused(multiplier: int, shift: int, single_rounding: bool) -> I64:
    """One multiplier's ``[left, multiplier, add, threshold, right]`` (see ``_requant_table``)."""
    stage = OutputStage(
        np.array([multiplier], np.int64), np.array([shift], np.int64), 0, 0, -128, 127
    )
    return _requant_table(stage, single_rounding, 1)[:, 0]


def _ptr(a: Array, kind: Any) -> Any:
    return a.ctypes.data_as(kind)


def _c8(a: Array) -> I8:
    return np.ascontiguousarray(a, dtype=np.int8)


def _geometry(
    h: int, w: int, kernel: tuple[int, int], stride: tuple[int, int], padding: Padding
) -> tuple[int, int, int, int]:
    oh, ow = out_size(h, kernel[0], stride[0], padding), out_size(w, kernel[1], stride[1], padding)
    pt = pad_amounts(h, kernel[0], stride[0], padding)[0]
    pl = pad_amounts(w, kernel[1], stride[1], padding)[0]
    return oh, ow, pt, pl


def _sets(*counts: int) -> int:
    total = max(counts)
    if any(c not in (1, total) for c in counts):
        raise ValueError(f"set axes {counts} do not broadcast")
    return total


def _check_range(k: int, bias: npt.NDArray[np.int32]) -> None:
    """Refuse a layer whose int32 accumulator could overflow (TFLite's would too)."""
    peak = int(np.abs(bias.astype(np.int64)).max(initial=0))
    if k * _MAX_PRODUCT + peak >= 2**31:
        raise ValueError(
            f"dot-product length {k} with bias up to {peak} can overflow the int32 accumulator"
        )


def _check(status: int, what: str) -> None:
    if status != 0:
        raise NativeError(f"native {what} could not allocate its scratch memory")


def conv2d(
    x: I8,
    weight: I8,
    bias: I64,
    stage: OutputStage,
    stride: tuple[int, int],
    padding: Padding,
    groups: int = 1,
    single_rounding: bool = False,
) -> I8:
    """Native ``kernels_int8.conv2d`` (per-channel int8 convolution, grouped or not).

    Args:
        x: ``(S, N, H, W, C)`` int8.
        weight: ``(S', O, kh, kw, C // groups)`` int8.
        bias: ``(S'', O)`` int32 values.
        stage: from ``kernels_int8.prepare_output_stage``.
        stride: ``(sh, sw)``.
        padding: ``"same"`` or ``"valid"``.
        groups: channel groups.
        single_rounding: FULLY_CONNECTED-style single rounding instead of double.

    Returns:
        ``(max(S, S', S''), N, OH, OW, O)`` int8.
    """
    lib = _lib()
    s, n, h, w, c = x.shape
    sw, o, kh, kw, ig = weight.shape
    if ig * groups != c or o % groups:
        raise ValueError(f"weight {weight.shape} with groups={groups} does not fit {c} channels")
    b32 = np.ascontiguousarray(bias, dtype=np.int32).reshape(-1, o)
    _check_range(kh * kw * ig, b32)
    so = _sets(s, sw, b32.shape[0])
    oh, ow, pt, pl = _geometry(h, w, (kh, kw), stride, padding)
    xc, wc = _c8(x), _c8(weight)
    rq = _requant_table(stage, single_rounding, o)
    out = np.empty((so, n, oh, ow, o), np.int8)
    status = lib.qs_conv(
        _ptr(xc, _P8),
        s,
        n,
        h,
        w,
        c,
        _ptr(wc, _P8),
        sw,
        o,
        kh,
        kw,
        groups,
        _ptr(b32, _P32),
        b32.shape[0],
        stride[0],
        stride[1],
        pt,
        pl,
        oh,
        ow,
        stage.input_zero_point,
        _ptr(rq, _P64),
        stage.output_zero_point,
        stage.act_min,
        stage.act_max,
        _ptr(out, _P8),
        threads(),
    )
    _check(status, "conv2d")
    return out


def dense(x: I8, weight: I8, bias: I64, stage: OutputStage, single_rounding: bool = False) -> I8:
    """Native ``kernels_int8.dense``: ``(S, N, F) x (S', O, F) -> (S'', N, O)``.

    Args:
        x: ``(S, N, F)`` int8.
        weight: ``(S', O, F)`` int8.
        bias: ``(S'', O)`` int32 values.
        stage: from ``kernels_int8.prepare_output_stage``.
        single_rounding: TFLite's single-rounding requantisation (FULLY_CONNECTED).

    Returns:
        ``(max(S, S', S''), N, O)`` int8.
    """
    s, n, f = x.shape
    sw, o, _ = weight.shape
    y = conv2d(
        x.reshape(s, n, 1, 1, f),
        weight.reshape(sw, o, 1, 1, f),
        bias,
        stage,
        (1, 1),
        "valid",
        1,
        single_rounding,
    )
    return y.reshape(y.shape[0], n, o)


def depthwise_conv2d(
    x: I8,
    weight: I8,
    bias: I64,
    stage: OutputStage,
    stride: tuple[int, int],
    padding: Padding,
    single_rounding: bool = False,
) -> I8:
    """Native ``kernels_int8.depthwise_conv2d`` (1HWO weights, any depth multiplier).

    Args:
        x: ``(S, N, H, W, C)`` int8.
        weight: ``(S', 1, kh, kw, O)`` int8, ``O`` a multiple of ``C``.
        bias: ``(S'', O)`` int32 values.
        stage: from ``kernels_int8.prepare_output_stage``.
        stride: ``(sh, sw)``.
        padding: ``"same"`` or ``"valid"``.
        single_rounding: single instead of double rounding.

    Returns:
        ``(max(S, S', S''), N, OH, OW, O)`` int8.
    """
    lib = _lib()
    s, n, h, w, c = x.shape
    sw, _, kh, kw, o = weight.shape
    if o % c:
        raise ValueError(f"depthwise weight {weight.shape} does not fit {c} channels")
    b32 = np.ascontiguousarray(bias, dtype=np.int32).reshape(-1, o)
    _check_range(kh * kw, b32)
    so = _sets(s, sw, b32.shape[0])
    oh, ow, pt, pl = _geometry(h, w, (kh, kw), stride, padding)
    xc, wc = _c8(x), _c8(weight)
    rq = _requant_table(stage, single_rounding, o)
    out = np.empty((so, n, oh, ow, o), np.int8)
    status = lib.qs_depthwise(
        _ptr(xc, _P8),
        s,
        n,
        h,
        w,
        c,
        _ptr(wc, _P8),
        sw,
        o,
        kh,
        kw,
        _ptr(b32, _P32),
        b32.shape[0],
        stride[0],
        stride[1],
        pt,
        pl,
        oh,
        ow,
        stage.input_zero_point,
        _ptr(rq, _P64),
        stage.output_zero_point,
        stage.act_min,
        stage.act_max,
        _ptr(out, _P8),
        threads(),
    )
    _check(status, "depthwise_conv2d")
    return out


def add(a: I8, b: I8, p: AddParams, single_rounding: bool = False) -> I8:
    """Native ``kernels_int8.add`` (element-wise; a set axis of 1 broadcasts).

    Args:
        a: int8 tensor.
        b: int8 tensor broadcastable with ``a``.
        p: from ``kernels_int8.prepare_add``.
        single_rounding: single instead of double rounding.

    Returns:
        The int8 sum in the broadcast shape.
    """
    lib = _lib()
    shape = np.broadcast_shapes(a.shape, b.shape)
    ac = _c8(np.broadcast_to(a, shape))
    bc = _c8(np.broadcast_to(b, shape))
    fused = [
        _fused(m, sh, single_rounding)
        for m, sh in (
            (p.in1_multiplier, p.in1_shift),
            (p.in2_multiplier, p.in2_shift),
            (p.out_multiplier, p.out_shift),
        )
    ]
    head = [
        p.left_shift,
        p.in1_zero_point,
        p.in2_zero_point,
        p.out_zero_point,
        p.act_min,
        p.act_max,
    ]
    params = np.concatenate([np.array(head, np.int64), *fused])
    out = np.empty(shape, np.int8)
    _check(
        lib.qs_add(_ptr(ac, _P8), _ptr(bc, _P8), out.size, _ptr(params, _P64), _ptr(out, _P8)),
        "add",
    )
    return out


def accumulate_signed(
    delta: npt.NDArray[np.float32],
    negative: npt.NDArray[np.bool_],
    coefficients: npt.NDArray[np.float32],
) -> None:
    """``delta += c_k z_k`` for each row k in turn, in place: ``z_ki`` is -1 where
    ``negative[k, i]``, else +1 (``qsched.zo.update.accumulate_delta``, same bits).

    Args:
        delta: float32, C-contiguous, one value per element; updated in place.
        negative: bool rows, one per coefficient, each as long as ``delta``.
        coefficients: float32, one per row.
    """
    rows, size = negative.shape
    if delta.shape != (size,) or coefficients.shape != (rows,):
        raise ValueError("accumulate_signed: one coefficient per row, rows as long as delta")
    if delta.dtype != np.float32 or not delta.flags.c_contiguous:
        raise ValueError("accumulate_signed: delta must be a contiguous float32 array")
    if negative.dtype != np.bool_:
        raise ValueError("accumulate_signed: the signs must be a bool array")
    bits = np.ascontiguousarray(negative).view(np.int8)
    c = np.ascontiguousarray(coefficients, dtype=np.float32)
    _check(
        _lib().qs_accumulate_signed(
            _ptr(delta, _PF32), _ptr(bits, _P8), _ptr(c, _PF32), rows, size
        ),
        "accumulate_signed",
    )


def rademacher_rows(
    key: tuple[int, int], step: int, ks: npt.NDArray[np.uint32], size: int
) -> npt.NDArray[np.bool_]:
    """The sign bits of perturbations ``ks`` at ``step``: shape (len(ks), size), True
    where z = -1 (``qsched.zo.prng.rademacher_rows``, same bits; the caller checks the
    ranges).

    Args:
        key: the Philox key words (seed mod 2**32, seed >> 32).
        step: the step (a uint32).
        ks: the perturbation indices, uint32, C-contiguous.
        size: elements per row.
    """
    out = np.empty((len(ks), size), dtype=np.bool_)
    _check(
        _lib().qs_rademacher_rows(
            key[0],
            key[1],
            step,
            _ptr(ks, ctypes.POINTER(ctypes.c_uint32)),
            len(ks),
            size,
            _ptr(out, ctypes.POINTER(ctypes.c_uint8)),
        ),
        "rademacher_rows",
    )
    return out
