"""Binary data-plane codec: round trips, byte budgets, and refusal of bad input."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qsched.protocol
from qsched.protocol import (
    MAX_CHUNK,
    MAX_KS,
    MAX_PAYLOAD,
    MAX_SLICE_KS,
    PROTOCOL_VERSION,
    ApplyUpdate,
    Error,
    EvalRequest,
    EvalResult,
    EvalSliceRequest,
    EvalSliceResult,
    Heartbeat,
    Hello,
    JobConfig,
    Loaded,
    LoadModel,
    Ping,
    ProtocolError,
    Reset,
    SelectDataset,
    SetWeights,
    UpdateAck,
    ValidateRequest,
    ValidateResult,
    codec,
    decode,
    encode,
    job_config,
    job_id_of,
    peek_header,
)
from qsched.protocol.codec import decode_shared, encode_shared, layout_tables
from qsched.protocol.errors import ERROR_KINDS
from qsched.protocol.jobspec import JobSpec
from qsched.protocol.messages import BOARD_ERROR_CODES, TYPE_CODES, Shard, StepOrder

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**64 - 1)
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
f64 = st.floats(allow_nan=False, allow_infinity=False)
names = st.from_regex(r"[A-Za-z0-9_.-]{1,32}", fullmatch=True)
estimators = st.sampled_from(["two_sided", "one_sided"])


@st.composite
def key_sets(draw: st.DrawFn, max_size: int = 64) -> tuple[int, ...]:
    """Sample-key sets, contiguous (range form) or scattered (list form)."""
    if draw(st.booleans()):
        count = draw(st.integers(1, max_size))
        start = draw(st.integers(0, 0x10000 - count))
        return tuple(range(start, start + count))
    keys = draw(st.lists(u16, min_size=1, max_size=max_size, unique=True))
    return tuple(sorted(keys))


@st.composite
def eval_results(draw: st.DrawFn, max_keys: int = 64) -> EvalResult:
    ks = draw(key_sets(max_size=max_keys))
    estimator = draw(estimators)
    n = len(ks)
    plus = draw(st.lists(f32, min_size=n, max_size=n))
    two = estimator == "two_sided"
    minus = draw(st.lists(f32, min_size=n, max_size=n)) if two else []
    zero = None if two else draw(f32)
    return EvalResult(
        job_id=draw(u32),
        step=draw(u32),
        compute_us=draw(u32),
        estimator=estimator,
        ks=ks,
        loss_plus=tuple(plus),
        loss_minus=tuple(minus),
        loss_zero=zero,
    )


@st.composite
def slice_requests(draw: st.DrawFn) -> EvalSliceRequest:
    batch = draw(st.integers(1, 0xFFFF))
    start = draw(st.integers(0, batch - 1))
    return EvalSliceRequest(
        job_id=draw(u32),
        step=draw(u32),
        batch_size=batch,
        eps=draw(f32),
        estimator=draw(estimators),
        slice_start=start,
        slice_count=draw(st.integers(1, batch - start)),
        ks=draw(key_sets(max_size=MAX_SLICE_KS)),
    )


@st.composite
def slice_results(draw: st.DrawFn, max_keys: int = MAX_SLICE_KS) -> EvalSliceResult:
    ks = draw(key_sets(max_size=max_keys))
    estimator = draw(estimators)
    n = len(ks)
    two = estimator == "two_sided"
    return EvalSliceResult(
        job_id=draw(u32),
        step=draw(u32),
        compute_us=draw(u32),
        estimator=estimator,
        slice_start=draw(u16),
        slice_count=draw(st.integers(1, 0xFFFF)),
        ks=ks,
        sum_plus=tuple(draw(st.lists(u64, min_size=n, max_size=n))),
        sum_minus=tuple(draw(st.lists(u64, min_size=n, max_size=n))) if two else (),
        sum_zero=None if two else draw(u64),
    )


@st.composite
def chunk_fields(draw: st.DrawFn) -> dict[str, Any]:
    chunk = draw(st.binary(max_size=300))
    offset = draw(st.integers(0, 2**32 - 1 - len(chunk)))
    total = draw(st.integers(offset + len(chunk), 2**32 - 1))
    return {"chunk": chunk, "offset": offset, "total": total}


@st.composite
def apply_updates(draw: st.DrawFn) -> ApplyUpdate:
    ks = draw(key_sets())
    cs = draw(st.lists(f32, min_size=len(ks), max_size=len(ks)))
    return ApplyUpdate(job_id=draw(u32), step=draw(u32), ks=ks, coefficients=tuple(cs))


@st.composite
def shards_of(draw: st.DrawFn, board: str) -> Shard:
    """A board's shard: no keys, whole-batch keys, or keys on a batch slice."""
    kind = draw(st.sampled_from(["update", "whole", "slice"]))
    if kind == "update":
        return Shard(board_id=board)
    ks = draw(key_sets(max_size=16))
    if kind == "whole":
        return Shard(board_id=board, ks=ks)
    return Shard(
        board_id=board, ks=ks, slice_start=draw(u16), slice_count=draw(st.integers(1, 0xFFFF))
    )


@st.composite
def step_orders(draw: st.DrawFn) -> StepOrder:
    update = draw(apply_updates())
    boards = draw(st.lists(names, max_size=12, unique=True))
    shards = [draw(shards_of(b)) for b in boards]
    return StepOrder(
        job_id=update.job_id,
        step=update.step,
        ks=update.ks,
        coefficients=update.coefficients,
        batch_size=draw(u16),
        eps=draw(f32),
        estimator=draw(estimators),
        shards=tuple(shards),
    )


STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    Hello: st.builds(
        Hello,
        protocol_version=u16,
        board_id=names,
        firmware_version=st.from_regex(r"[\x21-\x7e]{1,24}", fullmatch=True),
        npu=st.sampled_from(["none", "neural_art", "virtual"]),
        ram_kib=u32,
        max_batch=u16,
        max_payload=u32,
        model_hash=u64,
        dataset_hash=u64,
    ),
    Heartbeat: st.builds(
        Heartbeat,
        nonce=u32,
        uptime_ms=u32,
        state=st.sampled_from(["idle", "loading", "ready", "busy", "fault"]),
        job_id=u32,
        step=u32,
    ),
    EvalResult: eval_results(),
    EvalSliceResult: slice_results(),
    EvalSliceRequest: slice_requests(),
    UpdateAck: st.builds(UpdateAck, job_id=u32, step=u32, checksum=u32),
    ValidateResult: st.builds(
        ValidateResult,
        job_id=u32,
        step=u32,
        start=u32,
        count=st.just(0xFFFFFFFF),
        loss_sum=f64,
        correct=u32,
        compute_us=u32,
    ),
    Loaded: st.builds(
        Loaded,
        resource=st.sampled_from(["model", "weights", "dataset", "job_config"]),
        job_id=u32,
        crc32=u32,
        size=u32,
    ),
    Error: st.builds(
        Error,
        code=st.sampled_from(BOARD_ERROR_CODES),
        ref_type=u8,
        job_id=u32,
        step=u32,
        detail=st.from_regex(r"[\x20-\x7e]{0,64}", fullmatch=True),
    ),
    LoadModel: chunk_fields().map(lambda f: LoadModel(crc32=0x1234, **f)),
    SetWeights: chunk_fields().map(lambda f: SetWeights(job_id=3, step=4, checksum=5, **f)),
    SelectDataset: st.builds(
        SelectDataset, name=names, dataset_hash=u64, train_size=u32, val_size=u32
    ),
    JobConfig: st.builds(
        JobConfig,
        job_id=u32,
        seed=u64,
        numerics=st.sampled_from(["fp32", "int8"]),
        estimator=estimators,
        accumulator=st.sampled_from(["fp16", "int8"]),
        batch_size=u16,
        eps=f32,
    ),
    EvalRequest: st.builds(
        EvalRequest,
        job_id=u32,
        step=u32,
        batch_size=u16,
        eps=f32,
        estimator=estimators,
        ks=key_sets(),
    ),
    ApplyUpdate: apply_updates(),
    ValidateRequest: st.builds(
        ValidateRequest, job_id=u32, step=u32, start=u32, count=st.integers(1, 2**32 - 1)
    ),
    Ping: st.builds(Ping, nonce=u32),
    Reset: st.builds(Reset, scope=st.sampled_from(["soft", "hard"])),
    StepOrder: step_orders(),
}
messages = st.one_of(*STRATEGIES.values())


@SETTINGS
@given(messages)
def test_codec_round_trips_every_message(msg: Any) -> None:
    """decode(encode(m)) == m for every message type and field range."""
    data = encode(msg)
    assert data[:4] == b"QS" + bytes([PROTOCOL_VERSION, TYPE_CODES[type(msg)]])
    assert decode(data) == msg


def test_codec_covers_every_message_type() -> None:
    """The round-trip strategies cover every message type the codec defines."""
    assert set(STRATEGIES) == set(TYPE_CODES)


def test_codec_eval_request_budget() -> None:
    """An eval request with a contiguous k range fits 64 bytes (a list of 20 ks too)."""
    request = EvalRequest(
        job_id=2**32 - 1,
        step=2**32 - 1,
        batch_size=4096,
        eps=1.0,
        estimator="two_sided",
        ks=tuple(range(1000, 1000 + MAX_KS)),
    )
    scattered = request.model_copy(update={"ks": tuple(range(0, 40, 2))})
    assert len(encode(request)) <= 64
    assert len(encode(scattered)) <= 64


def test_codec_apply_update_budget_q64() -> None:
    """An apply-update for q = 64 fits 512 bytes, as a range and as a scattered list."""
    coefficients = tuple(float(i) / 7 for i in range(64))
    contiguous = ApplyUpdate(job_id=1, step=9, ks=tuple(range(64)), coefficients=coefficients)
    scattered = ApplyUpdate(
        job_id=1, step=9, ks=tuple(range(60000, 65536, 87))[:64], coefficients=coefficients
    )
    assert len(encode(contiguous)) <= 512
    assert len(encode(scattered)) <= 512
    assert decode(encode(scattered)) == scattered


@pytest.mark.parametrize("estimator", ["two_sided", "one_sided"])
def test_codec_eval_result_budget_8_samples(estimator: str) -> None:
    """An eval result for 8 samples (contiguous ks) fits 96 bytes."""
    two = estimator == "two_sided"
    result = EvalResult(
        job_id=1,
        step=2,
        compute_us=3,
        estimator=estimator,
        ks=tuple(range(8, 16)),
        loss_plus=(1.5,) * 8,
        loss_minus=(2.5,) * 8 if two else (),
        loss_zero=None if two else 0.5,
    )
    assert len(encode(result)) <= 96


def test_codec_largest_messages_fit_max_payload() -> None:
    """MAX_KS keys with two losses, as a list, and a full chunk fit MAX_PAYLOAD."""
    ks = tuple(range(0, 2 * MAX_KS, 2))
    result = EvalResult(
        job_id=1,
        step=2,
        compute_us=3,
        estimator="two_sided",
        ks=ks,
        loss_plus=(1.0,) * MAX_KS,
        loss_minus=(2.0,) * MAX_KS,
    )
    chunk = SetWeights(
        total=MAX_CHUNK, offset=0, job_id=1, step=2, checksum=3, chunk=bytes(MAX_CHUNK)
    )
    assert len(encode(result)) <= MAX_PAYLOAD
    assert len(encode(chunk)) <= MAX_PAYLOAD


def test_codec_rounds_floats_to_float32() -> None:
    """A float field holds the float32 value that travels, so models compare equal after decode."""
    request = EvalRequest(job_id=1, step=1, batch_size=1, eps=0.1, estimator="two_sided", ks=(0,))
    assert request.eps == struct.unpack("<f", struct.pack("<f", 0.1))[0]
    assert decode(encode(request)) == request


@pytest.mark.parametrize(
    "value",
    [
        0.1,
        -0.0,
        1e-46,  # below the smallest subnormal: rounds to zero
        7e-46,  # rounds up to the smallest subnormal
        3.4028234663852886e38,  # float32's largest
        3.4028235677973362e38,  # just under half an ulp above it: rounds down to it
        3.4028235677973366e38,  # half an ulp above it: overflows
        1e39,
        float("inf"),
        float("nan"),
    ],
)
def test_a_float32_field_rounds_as_a_float32_sequence_does(value: float) -> None:
    """A scalar float32 field (packed) and a sequence of them (``array``) round alike
    and refuse the same values: one rule, two fast paths."""

    def rounded(build: Any) -> Any:
        try:
            return build()
        except ValueError:
            return "refused"

    scalar = rounded(
        lambda: (
            EvalRequest(
                job_id=1, step=1, batch_size=1, eps=value, estimator="two_sided", ks=(0,)
            ).eps
        )
    )
    sequence = rounded(
        lambda: ApplyUpdate(job_id=1, step=1, ks=(0,), coefficients=(value,)).coefficients[0]
    )
    assert repr(scalar) == repr(sequence)


@pytest.mark.parametrize(
    "bad",
    [
        {"ks": (3, 2)},
        {"ks": (1, 1)},
        {"ks": ()},
        {"ks": (70000,)},
        {"eps": float("nan")},
        {"eps": 1e39},
    ],
)
def test_messages_reject_invalid_fields(bad: dict[str, Any]) -> None:
    """Models refuse unordered or repeated keys, keys over uint16 and non-float32 values."""
    fields = {
        "job_id": 1,
        "step": 1,
        "batch_size": 1,
        "eps": 1.0,
        "estimator": "two_sided",
        "ks": (0,),
    }
    with pytest.raises(ValueError):
        EvalRequest(**(fields | bad))


def test_messages_eval_result_shape_follows_estimator() -> None:
    """A one-sided result needs loss_zero and no loss_minus; two-sided the reverse."""
    with pytest.raises(ValueError, match="one-sided"):
        EvalResult(
            job_id=1,
            step=1,
            compute_us=1,
            estimator="one_sided",
            ks=(0,),
            loss_plus=(1.0,),
            loss_minus=(1.0,),
        )
    with pytest.raises(ValueError, match="two-sided"):
        EvalResult(
            job_id=1,
            step=1,
            compute_us=1,
            estimator="two_sided",
            ks=(0,),
            loss_plus=(1.0,),
            loss_zero=1.0,
        )


def test_messages_chunk_cannot_run_past_total() -> None:
    """A chunk whose end passes the total length is refused."""
    with pytest.raises(ValueError, match="past"):
        LoadModel(total=10, offset=8, crc32=0, chunk=b"abc")


def test_codec_unsupported_version_keeps_header_fields() -> None:
    """A message of another version raises unsupported_version with version and type set."""
    data = bytearray(
        encode(Hello(board_id="b", firmware_version="1", npu="none", ram_kib=1, max_batch=1))
    )
    data[2] = PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError) as info:
        decode(bytes(data))
    assert (info.value.kind, info.value.version, info.value.msg_type) == (
        "unsupported_version",
        PROTOCOL_VERSION + 1,
        0x01,
    )
    assert peek_header(bytes(data)) == (PROTOCOL_VERSION + 1, 0x01)


def test_codec_encode_refuses_oversized() -> None:
    """A valid model whose encoding exceeds MAX_PAYLOAD raises ProtocolError on encode."""
    ks = tuple(range(0, 2 * MAX_KS, 2))
    update = ApplyUpdate(job_id=1, step=1, ks=ks, coefficients=(1.0,) * MAX_KS)
    assert len(encode(update)) <= MAX_PAYLOAD  # the largest update fits
    big = SetWeights(
        total=MAX_CHUNK, offset=0, job_id=1, step=1, checksum=0, chunk=bytes(MAX_CHUNK)
    )
    assert len(encode(big)) <= MAX_PAYLOAD
    with pytest.raises(ProtocolError) as info:
        decode(bytes(MAX_PAYLOAD + 1))
    assert info.value.kind == "oversized"


# Random bodies behind a valid header reach the field decoders, not just the magic check.
random_inputs = st.one_of(
    st.binary(max_size=200),
    st.tuples(st.sampled_from(sorted(TYPE_CODES.values())), st.binary(max_size=200)).map(
        lambda t: b"QS" + bytes([PROTOCOL_VERSION, t[0]]) + t[1]
    ),
)


@SETTINGS
@given(random_inputs)
def test_codec_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    """Random input either decodes to a valid message or raises ProtocolError, nothing else."""
    try:
        decoded = decode(data)
    except ProtocolError as exc:
        assert exc.kind in ERROR_KINDS
    else:
        assert decode(encode(decoded)) == decoded


@SETTINGS
@given(messages, st.data())
def test_codec_mutated_messages_raise_only_protocol_error(msg: Any, data: st.DataObject) -> None:
    """Flipped, cut or extended valid messages decode or raise ProtocolError only."""
    raw = bytearray(encode(msg))
    action = data.draw(st.sampled_from(["flip", "cut", "extend", "header"]))
    if action == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    elif action == "cut":
        del raw[data.draw(st.integers(0, len(raw) - 1)) :]
    elif action == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=8))
    else:
        raw[data.draw(st.integers(0, 3))] = data.draw(u8)
    try:
        decoded = decode(bytes(raw))
    except ProtocolError as exc:
        assert exc.kind in {
            "truncated",
            "trailing_bytes",
            "bad_magic",
            "unsupported_version",
            "unknown_type",
            "invalid_field",
            "oversized",
        }
    else:
        # Whatever decodes is a valid message with a canonical encoding of its own.
        assert decode(encode(decoded)) == decoded


def test_codec_job_config_from_spec() -> None:
    """JobConfig carries the spec's seed, numerics and batch size under the spec's job id."""
    spec = JobSpec(seed=2**63 + 5, numerics="fp32", eps=0.001, batch_size=32, estimator="one_sided")
    config = job_config(spec)
    assert config.job_id == job_id_of(spec) != job_id_of(spec.model_copy(update={"seed": 1}))
    assert (config.seed, config.numerics, config.batch_size, config.estimator) == (
        2**63 + 5,
        "fp32",
        32,
        "one_sided",
    )
    assert decode(encode(config)) == config


def test_codec_spec_tables_are_current() -> None:
    """SPEC.md section 6.3 holds exactly the tables generated from the codec layouts."""
    spec = (Path(qsched.protocol.__file__).parent / "SPEC.md").read_text(encoding="utf-8")
    begin = "<!-- BEGIN GENERATED: message tables -->\n"
    end = "<!-- END GENERATED: message tables -->"
    assert spec[spec.index(begin) + len(begin) : spec.index(end)] == layout_tables()


def test_codec_layout_tables_name_every_field() -> None:
    """The generated SPEC tables list every field of every message model."""
    tables = layout_tables()
    for cls in TYPE_CODES:
        for name in cls.model_fields:
            if name != "type":
                assert f"`{name}`" in tables


def test_decode_shared_gives_equal_bytes_of_its_type_one_object() -> None:
    """Equal bytes of the named type decode to one shared object (frozen, so safe);
    other types decode afresh, and bad bytes raise every time."""
    ack = encode(UpdateAck(job_id=4, step=9, checksum=0xBEEF))
    code = TYPE_CODES[UpdateAck]
    first = decode_shared(ack, code)
    assert decode_shared(bytes(bytearray(ack)), code) is first
    assert first == decode(ack)
    ping = encode(Ping(nonce=3))
    assert decode_shared(ping, code) is not decode_shared(ping, code)
    for _ in range(2):
        with pytest.raises(ProtocolError, match="truncated"):
            decode_shared(ack[:-1], code)


def test_a_message_encoded_shared_is_what_its_bytes_decode_to_shared() -> None:
    """``encode_shared`` gives ``encode``'s bytes, and ``decode_shared`` of them gives the
    message itself; only the latest few are kept."""
    update = ApplyUpdate(job_id=4, step=10, ks=(1, 2, 5), coefficients=(0.5, -1.0, 2.0))
    code = TYPE_CODES[ApplyUpdate]
    data = encode_shared(update)
    assert data == encode(update)
    assert decode_shared(bytes(bytearray(data)), code) is update
    for step in range(11, 12 + codec._SHARED_KEPT):  # more than are kept: decoded afresh
        encode_shared(update.model_copy(update={"step": step}))
    again = decode_shared(data, code)
    assert again == update and again is not update


def test_decode_shared_takes_any_of_the_named_types() -> None:
    """With several types named, each is kept; a type not named is decoded afresh."""
    request = EvalSliceRequest(
        job_id=4,
        step=3,
        batch_size=8,
        eps=0.5,
        estimator="two_sided",
        ks=(2, 7),
        slice_start=4,
        slice_count=4,
    )
    data = encode_shared(request)
    codes = (TYPE_CODES[ApplyUpdate], TYPE_CODES[EvalSliceRequest])
    assert decode_shared(data, *codes) is request
    assert decode_shared(data, TYPE_CODES[ApplyUpdate]) == request
    assert decode_shared(data, TYPE_CODES[ApplyUpdate]) is not request


def _walk(cls: Any, raw: bytes, layout: tuple[Any, ...]) -> tuple[str, Any]:
    """The fields ``layout`` reads from ``raw``, or the error it stops at."""

    reader = codec._Reader(raw, TYPE_CODES[cls])
    fields: dict[str, Any] = {}
    try:
        for item in layout:
            item.decode(reader, fields)
    except ProtocolError as exc:
        return "error", (exc.kind, str(exc))
    return "fields", (fields, reader.pos)


@settings(SETTINGS, max_examples=40)
@given(messages)
def test_codec_packed_runs_read_and_write_as_field_by_field(msg: Any) -> None:
    """Runs of fixed-width fields are encoded and decoded with one struct call each
    (``codec._WIRE``): the same bytes as the fields one by one, and, for the message cut
    anywhere or with any byte set to a small value (enum codes just past the last), the
    same fields or the same error, with the same words (which fault a bad message is
    refused for is part of the spec)."""

    cls = type(msg)
    out = bytearray()
    for item in codec._LAYOUTS[cls]:
        item.encode(msg, out)
    raw = encode(msg)
    assert raw[4:] == out
    variants = [raw[:end] for end in range(4, len(raw) + 1)] + [raw + b"\x00"]
    for at in range(4, len(raw)):
        variants += [raw[:at] + bytes([value]) + raw[at + 1 :] for value in (0, 1, 2, 3, 5, 255)]
    for bad in variants:
        walked = repr(_walk(cls, bad, codec._LAYOUTS[cls]))  # repr: a flipped byte may be NaN
        assert repr(_walk(cls, bad, codec._WIRE[cls])) == walked, bad.hex()


@pytest.mark.parametrize(("cls", "most"), [(EvalRequest, MAX_KS), (EvalSliceRequest, MAX_SLICE_KS)])
def test_codec_reads_a_range_of_keys_up_to_its_limit(cls: Any, most: int) -> None:
    """A k set given as a range holds at most its limit of keys, however it is read."""
    fields = {"job_id": 1, "step": 2, "batch_size": 4, "eps": 1.0, "estimator": "two_sided"}
    if cls is EvalSliceRequest:
        fields |= {"slice_start": 0, "slice_count": 4}
    head = encode(cls(**fields, ks=(0, 1)))[:-5]  # up to the k set: mode, count, start
    assert decode(head + struct.pack("<BHH", 0, most, 7)).ks == tuple(range(7, 7 + most))
    with pytest.raises(ProtocolError, match=f"k count {most + 1} outside"):
        decode(head + struct.pack("<BHH", 0, most + 1, 7))


def test_codec_packs_the_runs_of_fixed_width_fields() -> None:
    """The eval request's fixed fields are one run (so the test above exercises runs)."""

    kinds = [type(item).__name__ for item in codec._WIRE[EvalSliceRequest]]
    assert kinds == ["_Packed", "_KSet"]


def _decoded_or_error(data: bytes) -> tuple[str, Any]:
    try:
        msg = decode(data)
    except ProtocolError as exc:
        return "error", (exc.kind, str(exc))
    return "message", (repr(msg), msg.model_fields_set, msg.model_dump())  # repr: NaN != NaN


@settings(SETTINGS, max_examples=60)
@given(st.one_of(eval_results(max_keys=6), slice_results(max_keys=6)))
def test_an_eval_answer_decodes_the_short_way_as_the_generic_way(msg: Any) -> None:
    """The eval answers a host decodes by the dozen every step take a short way when
    their keys are a range (``codec._RangeAnswer``): for the message and for it cut,
    extended, or with any byte set to a value at a bound (an estimator code past the
    last, a zero slice count, a key past the limit, a NaN), ``decode`` gives the same
    message, set fields and all, or the same error, as the generic walk alone."""

    raw = encode(msg)
    variants = [raw[:end] for end in range(4, len(raw) + 1)] + [raw + b"\x00"]
    for at in range(4, len(raw)):
        variants += [raw[:at] + bytes([v]) + raw[at + 1 :] for v in (0, 1, 2, 3, 0x7F, 0xC0, 255)]
    short = [_decoded_or_error(bad) for bad in variants]
    taken = codec._RANGE_ANSWERS[TYPE_CODES[type(msg)]].decode(raw) is not None
    answers, codec._RANGE_ANSWERS = codec._RANGE_ANSWERS, {}  # type: ignore[misc]
    try:
        assert [_decoded_or_error(bad) for bad in variants] == short
    finally:
        codec._RANGE_ANSWERS = answers  # type: ignore[misc]
    assert taken == (msg.ks == tuple(range(msg.ks[0], msg.ks[0] + len(msg.ks))))


def test_a_slice_answer_at_the_bounds_of_its_model_takes_the_right_way() -> None:
    """The short way keeps the model's rules narrower than the wire: an answer with a
    zero slice count, a key past the limit or one key too many is left to the generic
    walk, which refuses it; one with the most keys goes the short way."""

    fields = {"job_id": 1, "step": 2, "compute_us": 3, "estimator": "two_sided"}
    answer = EvalSliceResult(
        **fields, slice_start=0, slice_count=2, ks=(9,), sum_plus=(4,), sum_minus=(5,)
    )
    raw = bytearray(encode(answer))
    zero_count = raw[:19] + b"\x00\x00" + raw[21:]  # slice_count follows slice_start
    with pytest.raises(ProtocolError, match="slice_count"):
        decode(bytes(zero_count))
    past = encode(answer.model_copy(update={"ks": (0xFFFF,)}))
    two_keys = bytearray(past)
    two_keys[22:24] = struct.pack("<H", 2)  # a range of 2 from 0xFFFF, values made to fit
    two_keys += struct.pack("<2Q", 6, 7)
    with pytest.raises(ProtocolError, match="ks"):
        decode(bytes(two_keys))
    for count in (MAX_SLICE_KS, MAX_SLICE_KS + 1):
        many = bytes(raw[:22]) + struct.pack("<H", count) + bytes(raw[24:26])
        many += struct.pack(f"<{2 * count}Q", *range(2 * count))
        short = codec._RANGE_ANSWERS[TYPE_CODES[EvalSliceResult]].decode(many)
        if count == MAX_SLICE_KS:
            assert short is not None and short == decode(many) and len(short.ks) == count
        else:
            assert short is None
            with pytest.raises(ProtocolError, match=f"k count {count} outside"):
                decode(many)
