"""Data sets: two built-in (shipped with the package, no download) and loaders for full sets.

Every loader returns a :class:`Dataset`: float32 inputs in ``[0, 1]`` (NHWC images or
``(N, F)`` vectors) and int64 labels, split into train and validation parts
deterministically. Inputs in ``[0, 1]`` map to int8 as ``q = round(x * 255) - 128``,
i.e. input scale ``1/255`` and zero point ``-128`` (:data:`INPUT_SCALE`,
:data:`INPUT_ZERO_POINT`), so a uint8 pixel ``p`` becomes exactly ``p - 128``; the
quantiser calibrates against :attr:`Dataset.input_range`.

Boards check they hold the same data through :attr:`Dataset.content_hash`.
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qsched.zo.errors import DatasetError

__all__ = [
    "INPUT_SCALE",
    "INPUT_ZERO_POINT",
    "Dataset",
    "DatasetError",
    "content_hash",
    "dataset_names",
    "load_dataset",
    "load_digits",
    "load_eurosat",
    "load_image_folder",
    "load_npz",
    "load_stl10",
    "parse_classes",
    "resize_images",
    "scaled",
    "select_classes",
    "split_classes",
    "stratified_split",
]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

INPUT_SCALE: Final = 1.0 / 255.0
INPUT_ZERO_POINT: Final = -128
_IMAGE_SUFFIXES: Final = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
_STL10_SIDE: Final = 96


def content_hash(*arrays: npt.NDArray[Any]) -> str:
    """SHA-256 (hex) over each array's dtype, shape and C-order bytes, in order.

    Args:
        *arrays: the arrays, e.g. ``x_train, y_train, x_val, y_val``.

    Returns:
        64 hex digits; equal only for equal dtypes, shapes and values.
    """
    digest = hashlib.sha256()
    for array in arrays:
        a = np.ascontiguousarray(array)
        digest.update(f"{a.dtype.str}{a.shape};".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


@dataclass(eq=False)
class Dataset:
    """A classification data set, split into train and validation parts.

    ``x_*`` are float32 in :attr:`input_range`, NHWC images or ``(N, F)`` vectors;
    ``y_*`` int64 in ``0..num_classes-1``. ``content_hash`` is computed on creation.
    """

    name: str
    x_train: F32
    y_train: I64
    x_val: F32
    y_val: I64
    num_classes: int
    class_names: tuple[str, ...] = ()
    input_range: tuple[float, float] = (0.0, 1.0)
    content_hash: str = field(init=False)

    def __post_init__(self) -> None:
        self.x_train = np.ascontiguousarray(self.x_train, dtype=np.float32)
        self.x_val = np.ascontiguousarray(self.x_val, dtype=np.float32)
        self.y_train = np.ascontiguousarray(self.y_train, dtype=np.int64)
        self.y_val = np.ascontiguousarray(self.y_val, dtype=np.int64)
        self._check()
        if not self.class_names:
            self.class_names = tuple(str(c) for c in range(self.num_classes))
        self.content_hash = content_hash(self.x_train, self.y_train, self.x_val, self.y_val)

    def _check(self) -> None:
        if len(self.x_train) != len(self.y_train) or len(self.x_val) != len(self.y_val):
            raise DatasetError(f"{self.name}: inputs and labels differ in count")
        if self.x_train.shape[1:] != self.x_val.shape[1:]:
            raise DatasetError(
                f"{self.name}: train {self.x_train.shape} and val {self.x_val.shape} differ"
            )
        for y in (self.y_train, self.y_val):
            if y.size and (y.min() < 0 or y.max() >= self.num_classes):
                raise DatasetError(f"{self.name}: labels outside 0..{self.num_classes - 1}")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Per-sample input shape, without the batch dimension."""
        return tuple(int(d) for d in self.x_train.shape[1:])


# --------------------------------------------------------------------------- splitting


def stratified_split(labels: npt.ArrayLike, val_fraction: float, seed: int) -> tuple[I64, I64]:
    """Deterministic per-class split into train and validation indices.

    Each class's indices are permuted by ``numpy.random.default_rng(seed)`` (classes
    in ascending order) and the first ``round(n * val_fraction)`` go to validation.

    Args:
        labels: one label per sample.
        val_fraction: share of each class held out, in ``[0, 1)``.
        seed: the permutation seed.

    Returns:
        ``(train_indices, val_indices)``, each sorted ascending.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DatasetError(f"val_fraction must be in [0, 1), got {val_fraction}")
    y = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train: list[I64] = []
    val: list[I64] = []
    for cls in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cls))
        n_val = round(len(idx) * val_fraction)
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def split_classes(
    dataset: Dataset, source_classes: Sequence[int], target_classes: Sequence[int]
) -> tuple[Dataset, Dataset]:
    """Two disjoint-class tasks from one data set, for transfer learning.

    The source task pretrains a backbone (backprop); the target task, with classes the
    backbone never saw, is trained on the boards. Labels are renumbered ``0..k-1`` in
    the order the classes are given.

    Args:
        dataset: the full data set.
        source_classes: original labels of the source task.
        target_classes: original labels of the target task, disjoint from the source.

    Returns:
        ``(source, target)`` data sets.
    """
    if set(source_classes) & set(target_classes):
        raise DatasetError(
            f"source and target share classes {sorted(set(source_classes) & set(target_classes))}"
        )
    return _subset(dataset, source_classes, "source"), _subset(dataset, target_classes, "target")


def _subset(ds: Dataset, classes: Sequence[int], tag: str) -> Dataset:
    classes = [int(c) for c in classes]
    if len(classes) < 2 or len(set(classes)) != len(classes):
        raise DatasetError(f"{tag} classes must be at least two distinct labels, got {classes}")
    if min(classes) < 0 or max(classes) >= ds.num_classes:
        raise DatasetError(f"{tag} classes must be in 0..{ds.num_classes - 1}, got {classes}")
    lut = np.full(ds.num_classes, -1, dtype=np.int64)
    lut[classes] = np.arange(len(classes))
    keep_t, keep_v = lut[ds.y_train] >= 0, lut[ds.y_val] >= 0
    return Dataset(
        f"{ds.name}[{tag}:{','.join(map(str, classes))}]",
        ds.x_train[keep_t],
        lut[ds.y_train[keep_t]],
        ds.x_val[keep_v],
        lut[ds.y_val[keep_v]],
        len(classes),
        tuple(ds.class_names[c] for c in classes),
        ds.input_range,
    )


# --------------------------------------------------------------------------- resizing


def _axis_weights(n_in: int, n_out: int) -> F32:
    """(n_out, n_in) resampling matrix: area averaging to shrink, bilinear to grow."""
    w = np.zeros((n_out, n_in), dtype=np.float64)
    if n_out <= n_in:
        # Output pixel o covers input span [o*s, (o+1)*s); weight = overlap length / s.
        s = n_in / n_out
        for o in range(n_out):
            lo, hi = o * s, (o + 1) * s
            for i in range(int(np.floor(lo)), min(n_in, int(np.ceil(hi)))):
                w[o, i] = min(hi, i + 1) - max(lo, i)
            w[o] /= s
    else:
        # Half-pixel centres, edges clamped (as TensorFlow's and Pillow's bilinear).
        centre = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
        centre = np.clip(centre, 0, n_in - 1)
        left = np.floor(centre).astype(int)
        right = np.minimum(left + 1, n_in - 1)
        frac = centre - left
        np.add.at(w, (np.arange(n_out), left), 1 - frac)
        np.add.at(w, (np.arange(n_out), right), frac)
    return w.astype(np.float32)


def resize_images(images: npt.ArrayLike, size: int | tuple[int, int]) -> F32:
    """Resize NHWC images deterministically (area average to shrink, bilinear to grow).

    Separable: rows then columns, each a fixed matrix, in float32. Shrinking by an
    integer factor is the exact block mean.

    Args:
        images: ``(N, H, W, C)`` array (any real dtype).
        size: output side, or ``(height, width)``.

    Returns:
        float32 ``(N, height, width, C)`` in the input's value scale.
    """
    x = np.asarray(images, dtype=np.float32)
    if x.ndim != 4:
        raise DatasetError(f"resize expects (N, H, W, C) images, got shape {x.shape}")
    out_h, out_w = (size, size) if isinstance(size, int) else size
    if (out_h, out_w) == x.shape[1:3]:
        return x.copy()
    rows, cols = _axis_weights(x.shape[1], out_h), _axis_weights(x.shape[2], out_w)
    y = np.tensordot(rows, x, axes=([1], [1]))  # (out_h, N, W, C)
    z = np.tensordot(cols, y, axes=([1], [2]))  # (out_w, out_h, N, C)
    return np.ascontiguousarray(z.transpose(2, 1, 0, 3), dtype=np.float32)


def _resize_u8_chunks(images: npt.NDArray[np.uint8], size: int | None, chunk: int = 512) -> F32:
    """uint8 NHWC images -> float32 in [0, 1], resized in chunks to bound memory."""
    parts = []
    for start in range(0, len(images), chunk):
        part = images[start : start + chunk].astype(np.float32)
        if size is not None:
            part = resize_images(part, size)
        parts.append(part / np.float32(255.0))
    if not parts:
        side = images.shape[1:3] if size is None else (size, size)
        return np.zeros((0, *side, images.shape[3]), dtype=np.float32)
    return np.concatenate(parts)


# --------------------------------------------------------------------------- built-ins


def _data_file(name: str) -> Path:
    return Path(str(resources.files("qsched.zo.data").joinpath(name)))


def load_digits(flat: bool = False, val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """The UCI 8x8 handwritten digits (1,797 samples, 10 classes), shipped with the package.

    Args:
        flat: ``(N, 64)`` vectors instead of ``(N, 8, 8, 1)`` images.
        val_fraction: stratified validation share.
        seed: split seed.

    Returns:
        The data set, pixels ``0..16`` scaled to ``[0, 1]`` by ``/16``.
    """
    with gzip.open(_data_file("digits.csv.gz"), "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.int64)
    if table.shape[1] != 65:
        raise DatasetError(f"digits.csv.gz: expected 65 columns, got {table.shape[1]}")
    x = (table[:, :64] / 16.0).astype(np.float32)
    x = x if flat else x.reshape(-1, 8, 8, 1)
    y = table[:, 64]
    tr, va = stratified_split(y, val_fraction, seed)
    return Dataset("digits", x[tr], y[tr], x[va], y[va], 10)


def load_eurosat(size: int | None = None, limit_per_class: int | None = None) -> Dataset:
    """The shipped EuroSAT RGB subset: 3,000 train and 1,000 val 64x64 images, 10 classes.

    Args:
        size: resize to ``size x size`` (area average), ``None`` keeps 64x64.
        limit_per_class: keep only the first this-many train and val images per class.

    Returns:
        The data set, pixels scaled to ``[0, 1]`` by ``/255``.
    """
    with np.load(_data_file("eurosat_rgb_subset.npz"), allow_pickle=False) as npz:
        xt, yt, xv, yv = npz["x_train"], npz["y_train"], npz["x_val"], npz["y_val"]
        classes = tuple(str(c) for c in npz["classes"])
    if limit_per_class is not None:
        (xt, yt), (xv, yv) = _limit(xt, yt, limit_per_class), _limit(xv, yv, limit_per_class)
    name = "eurosat" if size is None else f"eurosat{size}"
    return Dataset(
        name,
        _resize_u8_chunks(xt, size),
        yt,
        _resize_u8_chunks(xv, size),
        yv,
        len(classes),
        classes,
    )


def _limit(
    x: npt.NDArray[Any], y: npt.NDArray[Any], n: int
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    keep = np.concatenate([np.flatnonzero(y == c)[:n] for c in np.unique(y)])
    keep.sort()
    return x[keep], y[keep]


# --------------------------------------------------------------------------- user files


def _read_image(path: Path) -> npt.NDArray[Any]:
    if path.suffix == ".npy":
        return np.asarray(np.load(path, allow_pickle=False))
    try:
        from PIL import Image
    except ImportError as exc:
        raise DatasetError(
            f"{path.name}: reading {path.suffix} images needs Pillow (pip install pillow); "
            ".npy images need nothing"
        ) from exc
    with Image.open(path) as img:
        return np.asarray(img.convert("L" if img.mode in ("L", "I;16", "1") else "RGB"))


def _to_unit(image: npt.NDArray[Any], path: Path) -> F32:
    """One image as float32 HWC in [0, 1]: uint8 is divided by 255, floats must already be."""
    img = image[..., None] if image.ndim == 2 else image
    if img.ndim != 3:
        raise DatasetError(f"{path.name}: expected an HxW or HxWxC image, got shape {image.shape}")
    if img.dtype == np.uint8:
        return img.astype(np.float32) / np.float32(255.0)
    if not np.issubdtype(img.dtype, np.floating) or img.min() < 0 or img.max() > 1:
        raise DatasetError(f"{path.name}: non-uint8 images must be floats in [0, 1]")
    return img.astype(np.float32)


def load_image_folder(
    path: str | Path,
    size: int | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    limit_per_class: int | None = None,
) -> Dataset:
    """A folder of class sub-folders of images (EuroSAT's own layout), split per class.

    Classes are the sub-folder names in sorted order (label = position); files are
    read in sorted order, ``.npy`` arrays (HxW or HxWxC, uint8 or floats in [0, 1])
    or ``.png``/``.jpg`` via Pillow. The split is :func:`stratified_split`.

    Args:
        path: the root folder.
        size: resize every image to ``size x size``; ``None`` needs equal sizes.
        val_fraction: validation share per class.
        seed: split seed.
        limit_per_class: read only the first this-many files of each class.

    Returns:
        The data set, named after the folder.
    """
    root = Path(path)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if len(classes) < 2:
        raise DatasetError(f"{root}: expected a folder with at least two class sub-folders")
    images, labels = [], []
    for label, cls in enumerate(classes):
        files = sorted(
            f for f in (root / cls).iterdir() if f.suffix.lower() in (*_IMAGE_SUFFIXES, ".npy")
        )
        for f in files[:limit_per_class]:
            img = _to_unit(_read_image(f), f)
            images.append(img if size is None else resize_images(img[None], size)[0])
            labels.append(label)
    x = _stack(images, root)
    y = np.asarray(labels, dtype=np.int64)
    tr, va = stratified_split(y, val_fraction, seed)
    return Dataset(root.name or "images", x[tr], y[tr], x[va], y[va], len(classes), tuple(classes))


def _stack(images: list[F32], root: Path) -> F32:
    if not images:
        raise DatasetError(f"{root}: no images (.npy, {', '.join(_IMAGE_SUFFIXES)}) found")
    shapes = {im.shape for im in images}
    if len(shapes) != 1:
        raise DatasetError(f"{root}: images differ in shape {sorted(shapes)}; pass size= to resize")
    return np.stack(images)


def _read_stl10_split(root: Path, split: str, size: int | None) -> tuple[F32, I64]:
    xs, ys = root / f"{split}_X.bin", root / f"{split}_y.bin"
    if not xs.is_file() or not ys.is_file():
        raise DatasetError(f"{root}: STL-10 needs {xs.name} and {ys.name}")
    raw = np.fromfile(xs, dtype=np.uint8)
    pixels = 3 * _STL10_SIDE * _STL10_SIDE
    if raw.size % pixels:
        raise DatasetError(f"{xs.name}: size {raw.size} is not a multiple of 3x96x96")
    # Stored column-major per image: channel, then column, then row.
    images = raw.reshape(-1, 3, _STL10_SIDE, _STL10_SIDE).transpose(0, 3, 2, 1)
    labels = np.fromfile(ys, dtype=np.uint8).astype(np.int64) - 1
    if len(labels) != len(images) or (labels.size and (labels.min() < 0 or labels.max() > 9)):
        raise DatasetError(f"{ys.name}: expected {len(images)} labels in 1..10")
    return _resize_u8_chunks(images, size), labels


def load_stl10(path: str | Path, size: int | None = None) -> Dataset:
    """STL-10's binary release: ``train_*`` becomes train, ``test_*`` validation.

    Args:
        path: folder holding ``train_X.bin``, ``train_y.bin``, ``test_X.bin``, ``test_y.bin``.
        size: resize 96x96 to ``size x size``; ``None`` keeps 96x96.

    Returns:
        The data set, labels 1..10 mapped to 0..9, pixels scaled by ``/255``.
    """
    root = Path(path)
    xt, yt = _read_stl10_split(root, "train", size)
    xv, yv = _read_stl10_split(root, "test", size)
    classes = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck")
    return Dataset("stl10" if size is None else f"stl10_{size}", xt, yt, xv, yv, 10, classes)


def load_npz(path: str | Path, num_classes: int | None = None) -> Dataset:
    """An ``.npz`` with ``x_train, y_train, x_val, y_val`` (uint8 pixels or floats in [0, 1]).

    Args:
        path: the file.
        num_classes: defaults to the largest label plus one.

    Returns:
        The data set, named after the file.
    """
    p = Path(path)
    with np.load(p, allow_pickle=False) as npz:
        missing = {"x_train", "y_train", "x_val", "y_val"} - set(npz.files)
        if missing:
            raise DatasetError(f"{p.name}: missing arrays {sorted(missing)}")
        arrays = [npz[k] for k in ("x_train", "y_train", "x_val", "y_val")]
    xt, xv = (
        a.astype(np.float32) / np.float32(255.0) if a.dtype == np.uint8 else a for a in arrays[::2]
    )
    yt, yv = arrays[1].astype(np.int64), arrays[3].astype(np.int64)
    k = num_classes or int(max(yt.max(initial=0), yv.max(initial=0)) + 1)
    return Dataset(p.stem, xt, yt, xv, yv, k)


# --------------------------------------------------------------------------- registry

_BUILTIN: dict[str, Callable[..., Dataset]] = {"digits": load_digits, "eurosat": load_eurosat}


def dataset_names() -> list[str]:
    """The built-in data sets, loadable by name with no files."""
    return sorted(_BUILTIN)


def _is_stl10(root: Path) -> bool:
    return (root / "train_X.bin").is_file()


def load_dataset(name_or_path: str | Path, **options: Any) -> Dataset:
    """Load a built-in data set by name, or a data set from a path.

    A built-in name may carry options inline, for the one string of a job spec:
    ``"eurosat:size=32"``, ``"digits:flat=true,seed=1"``; every data set takes
    ``scale=F`` too (inputs multiplied by F, see :func:`scaled`) and ``classes=5-9`` or
    ``classes=0+3+7`` (only those classes, renumbered from 0 in that order, see
    :func:`select_classes`). A path may be an STL-10
    folder (``train_X.bin`` ...), a folder of class sub-folders, or an ``.npz`` file
    (:func:`load_npz`).

    Args:
        name_or_path: ``"digits"``, ``"eurosat"`` (optionally ``name:key=value,...``) or a path.
        **options: passed to the loader (e.g. ``flat=True``, ``size=32``).

    Returns:
        The data set.

    Raises:
        DatasetError: unknown name, missing path, or an unreadable layout.
    """
    key = str(name_or_path)
    name, _, inline = key.partition(":")
    if name in _BUILTIN:
        options = {**_parse_inline(inline, key), **options}
    scale = options.pop("scale", None)
    classes = options.pop("classes", None)
    builtin = name in _BUILTIN
    dataset = _call(_BUILTIN[name], key, options) if builtin else _load_path(key, options)
    if classes is not None:
        dataset = select_classes(dataset, classes)
    return dataset if scale is None else scaled(dataset, scale)


def parse_classes(text: Any) -> list[int]:
    """``"5-9"`` -> ``[5, 6, 7, 8, 9]``; ``"0+3+7"`` -> ``[0, 3, 7]`` (the ``classes=``
    option: a comma would end the option in a data set string)."""
    raw = str(text).strip()
    first, dash, last = raw.partition("-")
    try:
        if dash:
            lo, hi = int(first), int(last)
            if hi < lo:
                raise ValueError(raw)
            return list(range(lo, hi + 1))
        return [int(part) for part in raw.split("+")]
    except ValueError:
        raise DatasetError(f"classes must be FIRST-LAST or A+B+..., got {raw!r}") from None


def select_classes(dataset: Dataset, classes: Any) -> Dataset:
    """The data set with only ``classes`` (a list or the ``classes=`` text), renumbered
    ``0..k-1`` in the order given: a transfer task's target classes, say.

    Raises:
        DatasetError: fewer than two distinct classes, or a class the data set lacks.
    """
    chosen = classes if isinstance(classes, list | tuple) else parse_classes(classes)
    return _subset(dataset, chosen, "classes")


def _load_path(key: str, options: dict[str, Any]) -> Dataset:
    path = Path(key).expanduser()
    if path.is_dir():
        loader: Callable[..., Dataset] = load_stl10 if _is_stl10(path) else load_image_folder
        return _call(loader, key, options, path)
    if path.is_file() and path.suffix == ".npz":
        return _call(load_npz, key, options, path)
    raise DatasetError(
        f"unknown data set {key!r}: not one of {dataset_names()} nor an existing folder or .npz"
    )


def scaled(dataset: Dataset, scale: Any) -> Dataset:
    """The data set with every input multiplied by ``scale`` (the ``scale=`` option).

    A model imported from a user's file may expect other input units than the built-in
    ``[0, 1]``: MLPerf Tiny's ResNet-8 takes pixels 0..255 (``scale=255``). The factor is
    applied in float32, so ``x / 255 * 255`` quantises back to the pixel it came from.

    Raises:
        DatasetError: a scale that is not a positive finite number.
    """
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale < 1e6:
        raise DatasetError(f"data set {dataset.name!r}: scale must be a number in (0, 1e6)")
    factor = np.float32(scale)
    lo, hi = dataset.input_range
    return Dataset(
        f"{dataset.name}x{scale:g}",
        dataset.x_train * factor,
        dataset.y_train,
        dataset.x_val * factor,
        dataset.y_val,
        dataset.num_classes,
        dataset.class_names,
        (lo * float(factor), hi * float(factor)),
    )


def _parse_inline(text: str, key: str) -> dict[str, Any]:
    """``"size=32,flat=true"`` -> ``{"size": 32, "flat": True}`` (ints, floats, booleans)."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise DatasetError(
                f"data set {key!r}: expected key=value options after ':', got {item!r}"
            )
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    continue
        out[name.strip()] = value
    return out


def _call(
    loader: Callable[..., Dataset], key: str, options: dict[str, Any], *args: Path
) -> Dataset:
    known = list(inspect.signature(loader).parameters)[len(args) :]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise DatasetError(f"data set {key!r} has no option(s) {unknown}; options: {known}")
    return loader(*args, **options)
