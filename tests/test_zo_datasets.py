"""Data sets: built-ins, user-file loaders, splits, resizing, hashes."""

import numpy as np
import pytest

from qsched.zo.datasets import (
    INPUT_SCALE,
    INPUT_ZERO_POINT,
    Dataset,
    DatasetError,
    dataset_names,
    load_dataset,
    load_digits,
    load_eurosat,
    load_image_folder,
    load_stl10,
    parse_classes,
    resize_images,
    select_classes,
    split_classes,
    stratified_split,
)


def test_dataset_names_lists_builtins():
    """The built-in names are digits and eurosat."""
    assert dataset_names() == ["digits", "eurosat"]


def test_digits_shapes_and_label_counts():
    """Digits: 1,797 samples, 8x8x1 in [0, 1], a stratified 80/20 split."""
    ds = load_dataset("digits")
    assert ds.x_train.shape[1:] == (8, 8, 1) and ds.input_shape == (8, 8, 1)
    assert len(ds.x_train) + len(ds.x_val) == 1797
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0
    counts = np.bincount(ds.y_train, minlength=10) + np.bincount(ds.y_val, minlength=10)
    assert counts.sum() == 1797 and counts.min() >= 170
    val_share = np.bincount(ds.y_val, minlength=10) / counts
    assert np.all(np.abs(val_share - 0.2) < 0.02)
    assert ds.num_classes == 10 and ds.input_range == (0.0, 1.0)


def test_digits_flat_option_same_values():
    """flat=True gives (N, 64) vectors holding the same pixels in row-major order."""
    img, flat = load_digits(), load_digits(flat=True)
    assert flat.x_train.shape == (len(img.x_train), 64)
    assert np.array_equal(flat.x_train, img.x_train.reshape(-1, 64))
    assert np.array_equal(flat.y_val, img.y_val)


def test_digits_split_deterministic_and_seeded():
    """The same seed gives the same split and hash; another seed another split."""
    a, b, c = load_digits(seed=0), load_digits(seed=0), load_digits(seed=1)
    assert a.content_hash == b.content_hash and np.array_equal(a.y_train, b.y_train)
    assert a.content_hash != c.content_hash
    assert len(a.content_hash) == 64


def test_stratified_split_partitions_indices():
    """Train and val indices are disjoint, cover everything and keep class shares."""
    labels = np.repeat(np.arange(3), [10, 20, 30])
    tr, va = stratified_split(labels, 0.3, seed=5)
    assert np.array_equal(np.sort(np.concatenate([tr, va])), np.arange(60))
    assert list(np.bincount(labels[va])) == [3, 6, 9]


def test_content_hash_depends_on_values():
    """Changing one pixel changes the content hash."""
    ds = load_digits()
    x = ds.x_train.copy()
    x[0, 0, 0, 0] += 0.5
    other = Dataset("digits", x, ds.y_train, ds.x_val, ds.y_val, 10)
    assert other.content_hash != ds.content_hash


def test_dataset_rejects_bad_labels():
    """Labels outside 0..num_classes-1 raise DatasetError."""
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(DatasetError, match="labels"):
        Dataset("bad", x, np.array([0, 3]), x, np.array([0, 1]), 3)


def test_resize_block_mean_known_case():
    """Halving a 4x4 image is the mean of each 2x2 block."""
    x = np.arange(16, dtype=np.float32).reshape(1, 4, 4, 1)
    out = resize_images(x, 2)[0, :, :, 0]
    assert np.array_equal(out, np.array([[2.5, 4.5], [10.5, 12.5]], np.float32))


def test_resize_area_non_integer_factor():
    """Shrinking 3 -> 2 weights the shared middle pixel by half in each output."""
    x = np.array([0.0, 3.0, 6.0], np.float32).reshape(1, 1, 3, 1)
    out = resize_images(x, (1, 2))[0, 0, :, 0]
    assert np.allclose(out, [(0 * 1 + 3 * 0.5) / 1.5, (3 * 0.5 + 6 * 1) / 1.5])


def test_resize_bilinear_upscale_known_case():
    """Doubling [0, 1] with half-pixel centres gives [0, .25, .75, 1]."""
    x = np.array([0.0, 1.0], np.float32).reshape(1, 1, 2, 1)
    assert np.allclose(resize_images(x, (1, 4))[0, 0, :, 0], [0, 0.25, 0.75, 1])


def test_resize_keeps_constant_images_and_channels():
    """A constant image stays constant at any size, per channel."""
    x = np.broadcast_to(np.array([0.2, 0.5, 0.9], np.float32), (2, 7, 5, 3))
    out = resize_images(x, (3, 11))
    assert out.shape == (2, 3, 11, 3)
    assert np.allclose(out, np.array([0.2, 0.5, 0.9], np.float32))


def test_eurosat_subset_resized_and_balanced():
    """The shipped EuroSAT subset resizes to 16x16 and keeps 10 balanced classes."""
    ds = load_eurosat(size=16, limit_per_class=5)
    assert ds.x_train.shape == (50, 16, 16, 3) and ds.x_val.shape == (50, 16, 16, 3)
    assert list(np.bincount(ds.y_train)) == [5] * 10
    assert ds.class_names[1] == "Forest"
    assert ds.x_train.min() >= 0.0 and ds.x_train.max() <= 1.0


def _write_npy_folder(root, per_class, shape, rng):
    for cls in ("cats", "apples", "boats"):
        (root / cls).mkdir()
        for i in range(per_class):
            img = rng.integers(0, 256, shape, dtype=np.uint8)
            np.save(root / cls / f"img{i:02d}.npy", img)


def test_image_folder_npy_labels_and_split(tmp_path):
    """Class sub-folders become sorted labels; .npy uint8 images scale by 1/255."""
    rng = np.random.default_rng(0)
    _write_npy_folder(tmp_path, 10, (6, 6, 3), rng)
    ds = load_image_folder(tmp_path, val_fraction=0.2, seed=3)
    assert ds.class_names == ("apples", "boats", "cats")
    assert ds.x_train.shape == (24, 6, 6, 3) and ds.x_val.shape == (6, 6, 6, 3)
    assert list(np.bincount(ds.y_val)) == [2, 2, 2]
    first = np.load(tmp_path / "apples" / "img00.npy").astype(np.float32) / 255
    pool = np.concatenate([ds.x_train[ds.y_train == 0], ds.x_val[ds.y_val == 0]])
    assert any(np.array_equal(first, im) for im in pool)
    again = load_dataset(tmp_path, val_fraction=0.2, seed=3)
    assert again.content_hash == ds.content_hash


def test_image_folder_resize_and_grayscale(tmp_path):
    """size= resizes every image; HxW grayscale arrays become HxWx1."""
    rng = np.random.default_rng(1)
    _write_npy_folder(tmp_path, 4, (8, 8), rng)
    ds = load_image_folder(tmp_path, size=4, val_fraction=0.25)
    assert ds.x_train.shape[1:] == (4, 4, 1)


def test_image_folder_png_via_pillow(tmp_path):
    """PNG images are read with Pillow when it is installed."""
    image_mod = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    for cls, value in (("a", 10), ("b", 200)):
        (tmp_path / cls).mkdir()
        for i in range(2):
            image_mod.fromarray(np.full((5, 5, 3), value, np.uint8)).save(
                tmp_path / cls / f"{i}.png"
            )
    ds = load_image_folder(tmp_path, val_fraction=0.5)
    assert np.allclose(ds.x_train[ds.y_train == 1], 200 / 255)


def test_image_folder_errors(tmp_path):
    """A folder without class sub-folders, or mixed sizes, raises DatasetError."""
    with pytest.raises(DatasetError, match="class sub-folders"):
        load_image_folder(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    np.save(tmp_path / "a" / "x.npy", np.zeros((4, 4, 3), np.uint8))
    np.save(tmp_path / "b" / "x.npy", np.zeros((5, 5, 3), np.uint8))
    with pytest.raises(DatasetError, match="differ in shape"):
        load_image_folder(tmp_path, val_fraction=0.0)


def _write_stl10(root, split, images, labels):
    # STL-10 stores each image column-major: channel, column, row.
    images.transpose(0, 3, 2, 1).astype(np.uint8).tofile(root / f"{split}_X.bin")
    np.asarray(labels, np.uint8).tofile(root / f"{split}_y.bin")


def test_stl10_binary_layout(tmp_path):
    """STL-10 binaries decode to NHWC, labels 1..10 become 0..9, test is validation."""
    rng = np.random.default_rng(2)
    train = rng.integers(0, 256, (3, 96, 96, 3), dtype=np.uint8)
    train[0, 5, 7] = (1, 2, 3)  # row 5, column 7: not symmetric, catches a transposed read
    test = rng.integers(0, 256, (2, 96, 96, 3), dtype=np.uint8)
    _write_stl10(tmp_path, "train", train, [1, 10, 4])
    _write_stl10(tmp_path, "test", test, [2, 3])
    ds = load_stl10(tmp_path)
    assert ds.x_train.shape == (3, 96, 96, 3) and list(ds.y_train) == [0, 9, 3]
    assert np.array_equal(ds.x_train[0, 5, 7], np.array([1, 2, 3], np.float32) / 255)
    assert np.array_equal(ds.x_val, test.astype(np.float32) / np.float32(255))
    small = load_dataset(tmp_path, size=32)
    assert small.x_val.shape == (2, 32, 32, 3)
    assert np.allclose(
        small.x_train[1, 0, 0], train[1, :3, :3].reshape(-1, 3).mean(0) / 255, atol=1e-5
    )


def test_stl10_missing_files(tmp_path):
    """A folder without the test split raises DatasetError naming the file."""
    _write_stl10(tmp_path, "train", np.zeros((1, 96, 96, 3), np.uint8), [1])
    with pytest.raises(DatasetError, match=r"test_X\.bin"):
        load_stl10(tmp_path)


def test_split_classes_disjoint_relabelled():
    """split_classes gives two tasks with disjoint classes, relabelled 0..k-1."""
    ds = load_digits()
    src, tgt = split_classes(ds, [0, 1, 2, 3, 4], [7, 9])
    assert src.num_classes == 5 and tgt.num_classes == 2
    assert set(np.unique(tgt.y_train)) == {0, 1}
    assert len(tgt.x_train) == int(np.sum(np.isin(ds.y_train, [7, 9])))
    nines = ds.x_train[ds.y_train == 9]
    assert np.array_equal(tgt.x_train[tgt.y_train == 1], nines)
    assert tgt.class_names == ("7", "9")
    with pytest.raises(DatasetError, match="share"):
        split_classes(ds, [1, 2], [2, 3])


def test_load_dataset_unknown_and_bad_option(tmp_path):
    """Unknown names and options raise DatasetError."""
    with pytest.raises(DatasetError, match="unknown data set"):
        load_dataset("mnist-not-here")
    with pytest.raises(DatasetError, match="no option"):
        load_dataset("digits", size=4)


def test_input_quantisation_maps_uint8_exactly():
    """Every uint8 pixel p, scaled by 1/255, quantises to p - 128 with scale 1/255, zp -128."""
    p = np.arange(256)
    x = (p.astype(np.float32) / np.float32(255.0)).astype(np.float32)
    q = np.round(x / INPUT_SCALE) + INPUT_ZERO_POINT
    assert np.array_equal(q, p - 128)


def test_load_dataset_inline_options():
    """'name:key=value,...' passes options to a built-in loader (one string in a job spec)."""
    ds = load_dataset("digits:flat=true,seed=2,val_fraction=0.5")
    ref = load_digits(flat=True, seed=2, val_fraction=0.5)
    assert ds.content_hash == ref.content_hash and ds.input_shape == (64,)
    with pytest.raises(DatasetError, match="key=value"):
        load_dataset("digits:flat")


def test_classes_option_keeps_and_renumbers_in_order():
    """``classes=5-9`` keeps those classes, renumbered from 0 in the order given; ``+``
    lists choose any order; the name says which were kept."""
    full = load_digits()
    target = load_dataset("digits:classes=5-9")
    assert target.num_classes == 5 and target.name.endswith("[classes:5,6,7,8,9]")
    assert len(target.x_train) == int((full.y_train >= 5).sum())
    assert np.array_equal(target.x_train, full.x_train[full.y_train >= 5])
    assert np.array_equal(target.y_train, full.y_train[full.y_train >= 5] - 5)
    picked = load_dataset("digits:classes=7+2")
    assert picked.class_names == (full.class_names[7], full.class_names[2])
    assert np.array_equal(picked.x_val[picked.y_val == 0], full.x_val[full.y_val == 7])
    assert parse_classes("3-3") == [3] and parse_classes(4) == [4]


@pytest.mark.parametrize("text", ["9-5", "a-b", "1,2", "", "2+x"])
def test_classes_option_rejects_bad_text(text):
    """A reversed range, non-numbers or a comma list is one DatasetError."""
    with pytest.raises(DatasetError, match="classes"):
        parse_classes(text)


def test_select_classes_needs_two_known_classes():
    """One class, a repeated class or a label the data set lacks is refused."""
    ds = load_digits()
    for classes in ([3], [3, 3], [2, 10]):
        with pytest.raises(DatasetError, match="classes"):
            select_classes(ds, classes)
