"""Wire format and authentication of the message plane: tensors round-trip bit for bit, zero copy;
every malformed, oversized or unauthentic frame list is rejected with the right code, in order;
the replay guard and the secret file behave as documented."""

from __future__ import annotations

import logging
import os
import stat

import msgpack
import pytest
import torch

from flotilla.comm import auth, codec
from flotilla.comm.codec import Limits
from flotilla.comm.schema import check_body, normalise_schema
from flotilla.core.errors import ConfigError, MessageRejected

SECRET = bytes(range(32))
REQ = auth.DOMAIN_REQUEST
DTYPES = [
    torch.float32,
    torch.float64,
    torch.int64,
    torch.bfloat16,
    torch.uint8,
    torch.float16,
    torch.int32,
    torch.int8,
    torch.int16,
    torch.bool,
    torch.complex64,
]


def _enc(tensors=(), header=None, limits=Limits(), secret=SECRET, domain=REQ):
    header = header or {"v": 1}
    return codec.encode(header, list(tensors), secret=secret, domain=domain, limits=limits)


def _dec(frames, limits=Limits(), secret=SECRET, domain=REQ):
    return codec.decode(frames, secret=secret, domain=domain, limits=limits)


def _signed(head: bytes, *payload: bytes) -> list:
    return [head, auth.sign(SECRET, REQ, [head, *payload]), *payload]


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, denormals, ...) of ``dtype``."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, dtype=torch.bool)
    n = dtype.itemsize * int(torch.tensor(shape).prod().item()) if shape else dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _rejected(code: str, frames, **kw) -> MessageRejected:
    with pytest.raises(MessageRejected) as info:
        _dec(frames, **kw)
    assert info.value.code == code, info.value
    return info.value


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)], ids=str)
def test_tensor_round_trip_is_bitwise(dtype, shape):
    t = _random_bits(dtype, shape)
    header, [out] = _dec([bytes(f) for f in _enc([t])])
    assert out.dtype == dtype and out.shape == t.shape
    assert _bytes_of(out) == _bytes_of(t)
    assert header["tensors"] == [{"dtype": str(dtype).removeprefix("torch."), "shape": list(shape)}]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0).reshape(4, 6).t(),
        lambda: torch.arange(40, dtype=torch.int64)[3::4],
        lambda: torch.arange(12.0, requires_grad=True).reshape(3, 4)[1:],
        lambda: torch.randn(3, 4, dtype=torch.bfloat16).expand(2, 3, 4),
        lambda: torch.randn(3, dtype=torch.complex64).conj(),
    ],
    ids=["transposed", "strided", "requires_grad_offset", "expanded", "conj"],
)
def test_non_contiguous_inputs_round_trip(make):
    t = make()
    _, [out] = _dec([bytes(f) for f in _enc([t])])
    assert out.is_contiguous() and out.shape == t.shape
    assert torch.equal(out, t.detach().resolve_conj())


def test_several_tensors_and_body_round_trip():
    ts = [torch.arange(3), torch.zeros(0, 2), torch.tensor(1.5, dtype=torch.float64)]
    header, out = _dec(_enc(ts, header={"v": 1, "body": {"k": [1, 2.5, "s", b"\x00"]}}))
    assert header["body"] == {"k": [1, 2.5, "s", b"\x00"]}
    assert [o.tolist() for o in out] == [t.tolist() for t in ts]


def test_encode_is_zero_copy_for_contiguous_tensors():
    t = torch.arange(1000, dtype=torch.float32)
    frames = _enc([t])
    view = frames[2]
    assert isinstance(view, memoryview) and view.nbytes == 4000
    t[0] = 42.0
    assert torch.frombuffer(bytearray(view), dtype=torch.float32)[0].item() == 42.0


def test_decode_aliases_the_receive_buffer():
    t = torch.arange(16, dtype=torch.float64)
    frames = [bytearray(f) for f in _enc([t])]
    _, [out] = _dec(frames)
    frames[2][0:8] = torch.tensor([7.0], dtype=torch.float64).view(torch.uint8).numpy().tobytes()
    assert out[0].item() == 7.0


def test_decode_copies_a_misaligned_buffer_and_keeps_values():
    t = torch.arange(8, dtype=torch.float32)
    frames = _enc([t])
    backing = bytearray(1 + frames[2].nbytes)
    backing[1:] = bytes(frames[2])
    _, [out] = _dec([frames[0], frames[1], memoryview(backing)[1:]])
    assert out.data_ptr() % 4 == 0
    assert torch.equal(out, t)


def test_unsupported_dtype_and_layout_raise_type_error():
    with pytest.raises(TypeError, match="dtype"):
        _enc([torch.zeros(2, dtype=torch.uint16)])
    with pytest.raises(TypeError, match="layout"):
        _enc([torch.eye(2).to_sparse()])
    with pytest.raises(TypeError):
        _enc(header={"v": 1, "body": {"x": object()}})


def test_encode_refuses_oversized_messages():
    with pytest.raises(MessageRejected) as info:
        _enc([torch.zeros(100)], limits=Limits(max_message_bytes=300, max_header_bytes=100))
    assert info.value.code == "oversized"


# ----------------------------------------------------------------------------- rejections
def test_size_checks_reject_before_auth():
    big = _enc([torch.zeros(64), torch.zeros(64)])
    _rejected("oversized", big, limits=Limits(max_frames=3))
    _rejected("oversized", big, limits=Limits(max_message_bytes=400, max_header_bytes=100))
    _rejected("oversized", big, limits=Limits(max_header_bytes=8))
    forged = [big[0], b"\x00" * 32, *big[2:]]
    err = _rejected("oversized", forged, limits=Limits(max_frames=3))
    assert "frames" in err.message


def test_too_few_frames_is_malformed():
    _rejected("malformed", [])
    _rejected("malformed", [msgpack.packb({"v": 1, "tensors": []})])


@pytest.mark.parametrize("mutate", ["tag", "header", "payload", "short_tag", "drop_frame"])
def test_tampering_is_rejected_as_auth(mutate):
    frames = [bytearray(f) for f in _enc([torch.arange(8.0)], header={"v": 1, "op": "x"})]
    if mutate == "tag":
        frames[1][0] ^= 1
    elif mutate == "header":
        frames[0][-1] ^= 1
    elif mutate == "payload":
        frames[2][5] ^= 1
    elif mutate == "short_tag":
        frames[1] = frames[1][:16]
    else:
        frames.pop()
    _rejected("auth", frames)


def test_wrong_secret_and_wrong_domain_are_rejected_as_auth():
    frames = _enc([torch.ones(2)])
    _rejected("auth", frames, secret=bytes(32))
    _rejected("auth", frames, domain=auth.DOMAIN_REPLY)


def test_length_prefix_prevents_moving_bytes_between_frames():
    a = _signed(msgpack.packb({"v": 1, "tensors": [{"dtype": "uint8", "shape": [2]}]}), b"ab")
    moved = [a[0] + b"a", a[1], b"b"]
    _rejected("auth", moved)


@pytest.mark.parametrize(
    "head",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"v": 1, "tensors": []}) + b"\x00",  # trailing data
        msgpack.packb([1, 2]),  # not a map
        msgpack.packb({"v": 2, "tensors": []}),
        msgpack.packb({"v": True, "tensors": []}),
        msgpack.packb({"v": 1}),
        msgpack.packb({"v": 1, "tensors": [{"dtype": "uint8", "shape": [1]}]}),  # count mismatch
        msgpack.packb({"v": 1, "tensors": [], "x": msgpack.ExtType(1, b"zz")}),
        msgpack.packb({1: 2}),  # non-str key
    ],
    ids=[
        "invalid",
        "trailing",
        "list",
        "version",
        "bool_version",
        "no_tensors",
        "count",
        "ext",
        "intkey",
    ],
)
def test_signed_but_malformed_headers(head):
    _rejected("malformed", _signed(head))


@pytest.mark.parametrize(
    "desc, payload",
    [
        ({"dtype": "float128", "shape": [1]}, b"\x00" * 16),
        ({"dtype": "object", "shape": [1]}, b"\x00" * 8),
        ({"dtype": "float32", "shape": [-1]}, b"\x00" * 4),
        ({"dtype": "float32", "shape": [True]}, b"\x00" * 4),
        ({"dtype": "float32", "shape": [1.0]}, b"\x00" * 4),
        ({"dtype": "uint8", "shape": [1] * 9}, b"\x00"),
        ({"dtype": "float32", "shape": [3]}, b"\x00" * 8),
        ({"dtype": "float32", "shape": [2**40, 0]}, b""),
        ({"dtype": "float32", "shape": 3}, b"\x00" * 12),
        ({"dtype": "float32", "shape": [3], "extra": 1}, b"\x00" * 12),
    ],
    ids=[
        "unknown",
        "object",
        "negative",
        "bool",
        "float",
        "ndim",
        "size",
        "huge_dim",
        "scalar",
        "extra",
    ],
)
def test_bad_tensor_descriptors_are_malformed(desc, payload):
    head = msgpack.packb({"v": 1, "tensors": [desc]})
    _rejected("malformed", _signed(head, payload))


def test_checks_run_in_documented_order():
    bad_tag_bad_header = [b"\xc1\xc1", b"\x00" * 32]
    _rejected("auth", bad_tag_bad_header)
    _rejected("oversized", bad_tag_bad_header, limits=Limits(max_header_bytes=1))


def test_peek_header_reads_leading_fields_with_bounded_work():
    head = msgpack.packb({"v": 1, "rid": "r1", "op": "x", "body": {"pad": "y" * 100_000}})
    frames = [head, b"\x00" * 32]
    assert codec.peek_header(frames, Limits()) == {"v": 1, "rid": "r1", "op": "x"}
    assert codec.peek_header(frames, Limits(max_header_bytes=4)) == {"v": 1}
    assert codec.peek_header([b"\xc1"], Limits()) == {}
    assert codec.peek_header([msgpack.packb([1, 2])], Limits()) == {}
    assert codec.peek_header([], Limits()) == {}


def test_limits_validate_fields():
    with pytest.raises(ConfigError, match="max_frames"):
        Limits(max_frames=1)
    with pytest.raises(ConfigError, match="replay_window_s"):
        Limits(replay_window_s=0)
    with pytest.raises(ConfigError, match="max_header_bytes"):
        Limits(max_message_bytes=10, max_header_bytes=20)
    with pytest.raises(ConfigError, match="max_frames"):
        Limits(max_frames=10.5)
    assert Limits(replay_window_s=5).replay_window_s == 5


# ----------------------------------------------------------------------------- body schema
def test_body_schema_names_the_field():
    schema = normalise_schema({"n": int, "x": (float, None), "flag": bool})
    check_body({"n": 1, "x": None, "flag": True}, schema)
    check_body({"n": 1, "x": 2, "flag": False}, schema)  # int is accepted for float
    for body, field in [
        ({"x": 1.0, "flag": True}, "'n'"),
        ({"n": 1, "x": 1.0, "flag": True, "y": 0}, "'y'"),
        ({"n": True, "x": 1.0, "flag": True}, "'n'"),
        ({"n": 1, "x": "s", "flag": True}, "'x'"),
    ]:
        with pytest.raises(MessageRejected, match=field) as info:
            check_body(body, schema)
        assert info.value.code == "schema"
    with pytest.raises(ConfigError):
        normalise_schema({"n": "int"})


# ----------------------------------------------------------------------------- auth
def test_sign_depends_on_every_input():
    base = auth.sign(SECRET, REQ, [b"a", b"b"])
    assert len(base) == auth.TAG_BYTES
    assert auth.verify(SECRET, REQ, [b"a", memoryview(b"b")], base)
    for other in (
        auth.sign(bytes(32), REQ, [b"a", b"b"]),
        auth.sign(SECRET, auth.DOMAIN_REPLY, [b"a", b"b"]),
        auth.sign(SECRET, REQ, [b"ab"]),
        auth.sign(SECRET, REQ, [b"a", b"b", b""]),
    ):
        assert other != base
    assert not auth.verify(SECRET, REQ, [b"a", b"b"], base[:-1])


def test_large_parts_are_digested_and_still_bound_to_every_byte():
    """Parts above DIGEST_THRESHOLD enter the HMAC as BLAKE3 digests: a flip anywhere is caught."""
    import blake3

    n = auth.DIGEST_THRESHOLD
    big = bytearray(os.urandom(n + 1))
    tag = auth.sign(SECRET, REQ, [b"head", big])
    for pos in (0, n // 2, n):  # first, middle, last byte
        altered = bytearray(big)
        altered[pos] ^= 1
        assert not auth.verify(SECRET, REQ, [b"head", altered], tag)
    assert not auth.verify(SECRET, REQ, [b"head", big[:-1]], tag)  # length changed
    # A digested part differs from a short part made of its digest (the length says which it is).
    digest = blake3.blake3(bytes(big)).digest()
    assert auth.sign(SECRET, REQ, [b"head", digest]) != tag
    # At the threshold the bytes themselves are fed: still length-prefixed and bound.
    edge = os.urandom(n)
    assert auth.verify(SECRET, REQ, [memoryview(edge)], auth.sign(SECRET, REQ, [edge]))
    assert not auth.verify(SECRET, REQ, [edge[:-1] + bytes([edge[-1] ^ 1])], auth.sign(SECRET, REQ, [edge]))


def test_replay_guard_window_and_sequence():
    now = [1000.0]
    guard = auth.ReplayGuard(60.0, now=lambda: now[0])
    guard.accept("w0", 5, 1000.0)
    for seq, ts in [(5, 1000.0), (4, 1000.0), (4, 1059.0)]:
        with pytest.raises(MessageRejected) as info:
            guard.accept("w0", seq, ts)
        assert info.value.code == "replay"
    for ts in (939.0, 1061.0):  # an unknown sender must be within the window of this clock
        with pytest.raises(MessageRejected) as info:
            guard.accept("w9", 1, ts)
        assert info.value.code == "clock_skew"
    # a known sender whose wall clock jumped (a VM resumed after a pause) is not locked out:
    # its seq grows, which is what rejects replays
    guard.accept("w0", 6, 939.0)
    guard.accept("w0", 7, 1500.0)
    guard.accept("w1", 1, 1000.0)  # senders are independent
    now[0] = 2000.0
    with pytest.raises(MessageRejected) as info:
        guard.accept("w2", 1, 1000.0)  # stale for an unknown sender
    assert info.value.code == "clock_skew"


def test_replay_guard_evicts_least_recently_used_sender():
    guard = auth.ReplayGuard(60.0, max_senders=2, now=lambda: 0.0)
    guard.accept("a", 10, 0.0)
    guard.accept("b", 10, 0.0)
    guard.accept("a", 11, 0.0)  # a is now most recent
    guard.accept("c", 1, 0.0)  # evicts b
    assert len(guard) == 2
    guard.accept("b", 1, 0.0)  # b forgotten: fresh timestamp suffices
    with pytest.raises(MessageRejected):
        guard.accept("c", 1, 0.0)


def test_secret_file_round_trip_and_mode(tmp_path):
    secret = auth.generate_secret()
    assert len(secret) == 32 and secret != auth.generate_secret()
    path = tmp_path / "sub" / "cluster.secret"
    auth.write_secret_file(path, secret)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert auth.read_secret_file(path) == secret
    assert secret.hex() in path.read_text() and not list(path.parent.glob(".*tmp"))


def test_secret_file_errors_name_the_path_not_the_secret(tmp_path, caplog):
    with pytest.raises(ConfigError, match="does not exist"):
        auth.read_secret_file(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("abcd\n")
    with pytest.raises(ConfigError, match="short|at least"):
        auth.read_secret_file(short)
    junk = tmp_path / "junk"
    junk.write_text("not hex at all\n")
    with pytest.raises(ConfigError, match="hex") as info:
        auth.read_secret_file(junk)
    assert "not hex at all" not in str(info.value)
    secret = auth.generate_secret()
    loose = tmp_path / "loose"
    auth.write_secret_file(loose, secret)
    os.chmod(loose, 0o644)
    with caplog.at_level(logging.WARNING, logger="flotilla"):
        assert auth.read_secret_file(loose) == secret
    assert "0600" in caplog.text and secret.hex() not in caplog.text
    with pytest.raises(ConfigError):
        auth.write_secret_file(tmp_path / "x", b"short")
    with pytest.raises(ConfigError):
        auth.check_secret("a string secret" * 4)
