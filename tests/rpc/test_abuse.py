"""The board network under abuse: peers that hold connections, drip bytes, flood frames or send
garbage, and clients that ask for odd session lengths. Each test runs the attack, bounded in
count and time, while a legitimate sender streams inputs, and asserts what that sender sees
(every input through, in order, right) and what the receiving process holds."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hgrt.errors import InputError
from hgrt.rpc import channel, wire
from hgrt.rpc.channel import Inbox, Outbox

MiB = 1 << 20


def _stream(inbox: Inbox, n: int, stream: str = "legit", size: int = 256) -> float:
    """Send ``n`` inputs (input i: ``size`` floats of value i) and take them in order, as a
    board's stage does; the seconds it took. Fails on a lost, late or wrong input."""
    inbox.announce(stream, {"x": ("float32", (size,))}, window=channel.WINDOW)
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    t0 = time.monotonic()
    sender = threading.Thread(target=lambda: [box.send(i, "x", np.full(size, i, "float32"),
                                                       stream) for i in range(n)])
    sender.start()
    for i in range(n):
        got = inbox.take(i, ["x"], timeout=10, stream=stream)["x"]
        assert got.shape == (size,) and (got == i).all(), f"input {i} came wrong"
    sender.join(10)
    box.close()
    return time.monotonic() - t0


def test_silent_connections_do_not_shut_out_a_sender():
    """100 connections that never give the token (more than there are slots): a sender with
    the token is served, its inputs come through in order."""
    inbox = Inbox()
    idle = [socket.create_connection(("127.0.0.1", inbox.port)) for _ in range(100)]
    try:
        assert _stream(inbox, 200) < 10
    finally:
        for s in idle:
            s.close()
        inbox.close()


def test_a_token_dripped_a_byte_at_a_time_is_cut_off(monkeypatch):
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT", 1.0)
    inbox = Inbox()
    drip = socket.create_connection(("127.0.0.1", inbox.port))
    drip.settimeout(10)
    t0 = time.monotonic()
    closed_at = None
    for b in inbox.token:  # the right token, too slowly
        try:
            drip.sendall(bytes([b]))
            time.sleep(0.25)
        except OSError:
            closed_at = time.monotonic()
            break
    if closed_at is None:
        with pytest.raises((OSError, AssertionError)):
            drip.sendall(wire.frame_head(0, "x", np.ones(1, "float32"), "legit") + bytes(4))
            assert drip.recv(1) != b""
        closed_at = time.monotonic()
    assert closed_at - t0 < 1.0 + 16 * 0.25
    assert _stream(inbox, 50) < 10
    drip.close()
    inbox.close()


def test_a_flood_of_new_inputs_is_held_to_the_window():
    """A token holder sends 200 inputs of 256 KiB that no stage takes, on a stream announced 8
    inputs ahead: the inbox holds 8 of them and closes the connection at the ninth; another
    stream goes on meanwhile."""
    inbox = Inbox()
    inbox.announce("flood", {"x": ("float32", (64 * 1024,))}, window=8)
    rss0 = psutil.Process().memory_info().rss
    flood = Outbox("127.0.0.1", inbox.port, inbox.token)
    frame = np.zeros(64 * 1024, "float32")  # 256 KiB

    def send_all():
        try:
            for i in range(200):
                flood.send(i, "x", frame, "flood")
        except Exception:  # noqa: BLE001 - the inbox gives up on it: expected
            pass

    t = threading.Thread(target=send_all, daemon=True)
    t.start()
    time.sleep(1.0)
    assert _stream(inbox, 100) < 10
    held = inbox.held_bytes()
    assert held <= 8 * frame.nbytes, held
    assert any("beyond the announced window (inputs 0 to 7)" in r for r in inbox.refused)
    assert psutil.Process().memory_info().rss - rss0 < 8 * frame.nbytes + 64 * MiB
    flood.close()
    inbox.close()


def _closed_by_peer(conn: socket.socket) -> bool:
    """Whether the other end closed ``conn`` (a reset: it closed with our bytes unread)."""
    try:
        while conn.recv(4096):  # the inbox's acknowledgement of the token, then the end
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _raw(inbox: Inbox) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", inbox.port))
    s.settimeout(10)
    s.sendall(inbox.token)
    return s


def _frame(seq: int, name: str, value: np.ndarray, stream: str) -> bytes:
    return wire.frame_head(seq, name, value, stream) + value.tobytes()


def test_a_tensor_sent_twice_or_after_its_take_is_refused():
    inbox = Inbox()
    inbox.announce("s", {"x": ("float32", (4,))}, window=4)
    one, two = np.ones(4, "float32"), np.full(4, 2.0, "float32")
    raw = _raw(inbox)
    raw.sendall(_frame(1, "x", one, "s") + _frame(1, "x", two, "s"))
    assert _closed_by_peer(raw)  # the second one closed the connection
    assert "sent twice" in inbox.refused[-1]
    np.testing.assert_array_equal(inbox.take(1, ["x"], timeout=5, stream="s")["x"], one)
    raw = _raw(inbox)
    raw.sendall(_frame(1, "x", two, "s"))  # input 1 was taken: a replay
    assert _closed_by_peer(raw)
    assert "already taken" in inbox.refused[-1]
    assert inbox.pending() == 0
    assert _stream(inbox, 20, stream="s2") < 10
    inbox.close()


def test_garbage_closes_its_connection_not_a_waiting_stage():
    """A malformed frame while a stage waits for a tensor whose sender has not connected yet:
    the stage still gets it when it comes."""
    inbox = Inbox()
    raw = _raw(inbox)
    raw.sendall(struct.pack("<qIQ", 1, 7, 0) + b"garbage")
    assert _closed_by_peer(raw)
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    threading.Timer(0.3, box.send, (1, "x", np.ones(2, "float32"), "s")).start()
    np.testing.assert_array_equal(inbox.take(1, ["x"], timeout=5, stream="s")["x"], 1.0)
    box.close()
    inbox.close()


_OUT_OF_DESCRIPTORS = """
import resource, socket, numpy as np
from hgrt.rpc.channel import Inbox, Outbox
inbox = Inbox()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
conns = []
try:
    for _ in range(80):
        conns.append(socket.create_connection(("127.0.0.1", inbox.port)))
except OSError:
    pass
import time; time.sleep(0.5)  # the inbox's accept fails meanwhile: EMFILE
for c in conns:
    c.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
time.sleep(0.5)
box = Outbox("127.0.0.1", inbox.port, inbox.token)
box.send(3, "x", np.arange(4, dtype="float32"), "s")
print("took", inbox.take(3, ["x"], timeout=10, stream="s")["x"].tolist())
"""


def test_the_inbox_accepts_again_after_running_out_of_descriptors():
    out = subprocess.run([sys.executable, "-c", _OUT_OF_DESCRIPTORS], capture_output=True,
                         text=True, timeout=60)
    assert "took [0.0, 1.0, 2.0, 3.0]" in out.stdout, out.stdout + out.stderr


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.binary(min_size=wire.FRAME.size, max_size=wire.FRAME.size),
       header=st.one_of(st.binary(max_size=200), st.builds(
           lambda name, dtype, shape, stream: (
               b'{"name": %s, "dtype": %s, "shape": %s, "stream": %s}'
               % (name, dtype, shape, stream)),
           st.sampled_from([b'"x"', b"1", b"null", b"[]"]),
           st.sampled_from([b'"float32"', b'"object"', b'"<f4"', b"3"]),
           st.sampled_from([b"[1, 2]", b"[-1]", b"[1e30]", b"[true]", b"{}", b"[[1]]",
                            b"[4294967297, 2]", b"[0]"]),
           st.sampled_from([b'"s"', b"1", b"null"]))))
def test_the_frame_parser_answers_any_bytes_with_a_frame_or_an_input_error(prefix, header):
    try:
        head = wire.parse_frame_head(prefix, header)
    except InputError:
        return
    assert head.dtype in wire.DTYPES and len(head.shape) <= wire.MAX_DIMS
    assert head.nbytes == int(np.prod(head.shape, dtype=np.int64)) * \
        np.dtype(head.dtype).itemsize <= wire.MAX_PAYLOAD


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), with_token=st.booleans())
def test_any_bytes_on_a_connection_leave_the_inbox_serving(inbox_for_fuzz, data, with_token):
    inbox = inbox_for_fuzz
    raw = socket.create_connection(("127.0.0.1", inbox.port))
    try:
        raw.sendall((inbox.token if with_token else b"") + data)
    except OSError:
        pass
    raw.close()
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    seq = time.monotonic_ns()
    box.send(seq, "x", np.ones(2, "float32"), f"check-{seq}")
    assert inbox.take(seq, ["x"], timeout=5, stream=f"check-{seq}")["x"].tolist() == [1.0, 1.0]
    box.close()


@pytest.fixture(scope="module")
def inbox_for_fuzz():
    inbox = Inbox()
    yield inbox
    inbox.close()


@pytest.mark.parametrize("asked, cap, want", [
    (float("nan"), 3.0, 3.0), (float("inf"), 3.0, 3.0), (-5.0, 3.0, 3.0), (2.0, 3.0, 2.0),
    (float("nan"), 0.0, None), (None, 0.0, None), (7.0, 0.0, 7.0)])
def test_a_session_length_counts_only_positive_finite_seconds(asked, cap, want):
    from hgrt.rpc.listen import session_limit

    assert session_limit(asked, cap) == want


# ---- a real board server under attack while a pipeline streams through it ------------------
ATTACK_SECONDS = 1.5  # each attack runs at most this long (and a bounded count of tries)
PER_ATTACKER = 64 * MiB  # what the board's processes may grow by per attack, beyond the window


@pytest.fixture(scope="module")
def board_pipeline(rpc_env, tmp_path_factory):
    """A two-stage pipeline of conv_model on two real `hgrt rpc-server`s (board-to-board), its
    inputs, and the outputs of a clean run of them."""
    import hgrt.rpc
    from hgrt.pipelines import load_pipeline
    from hgrt.stages import split
    from hgrt.testing import conv_model

    out = tmp_path_factory.mktemp("abuse") / "conv"
    split(conv_model(), 2, kernels="tvm").save(out)
    keys = ("abuse-a", "abuse-b")
    procs = [rpc_env.start_server(k) for k in keys]
    sessions = [hgrt.rpc.connect(tracker=rpc_env.tracker, key=k, timeout=30) for k in keys]
    p = load_pipeline(out, sessions, transfer="direct")
    rng = np.random.default_rng(9)
    xs = [{"x": rng.standard_normal((1, 3, 8, 8)).astype("float32")} for _ in range(16)]
    clean = [y[0] for y in p.map(xs)]
    yield p, procs, xs, clean
    p.close()


def _board_rss(proc) -> int:
    """Resident bytes of a board server and its session processes."""
    total = 0
    for q in proc.tree():
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _rpc_port(session) -> int:
    import re

    from hgrt.rpc.session import describe

    return int(re.search(r"server [\d.]+:(\d+)", describe(session)).group(1))


def _bounded(attack, *args) -> None:
    """Run ``attack`` until ATTACK_SECONDS or its own count ends it; OSErrors are expected."""
    deadline = time.monotonic() + ATTACK_SECONDS
    for _ in range(200):
        if time.monotonic() > deadline:
            return
        try:
            if attack(*args, deadline) is False:
                return
        except OSError:
            pass


def _drip_handshake(where, rpc_port, deadline) -> bool:
    """TVM RPC's magic and a key length, then the key a byte at a time."""
    s = socket.create_connection(("127.0.0.1", rpc_port), timeout=2)
    with s:
        s.sendall(struct.pack("<ii", 0xFF271, 100))
        while time.monotonic() < deadline:
            s.sendall(b"k")
            time.sleep(0.2)
    return False


def _idle_without_token(where, rpc_port, deadline) -> bool:
    conns = [socket.create_connection((where.host, where.port), timeout=2) for _ in range(100)]
    time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
    for c in conns:
        c.close()
    return False


def _with_token(where, frames: bytes) -> None:
    s = socket.create_connection((where.host, where.port), timeout=2)
    with s:
        s.sendall(where.token + frames)
        try:
            while s.recv(4096):  # the token's acknowledgement, until the inbox closes it
                pass
        except OSError:
            pass


def _new_sequence_numbers(where, stream, deadline) -> bool:
    _with_token(where, b"".join(_frame(10_000 + i, "x", np.ones((1, 3, 8, 8), "float32"), stream)
                                for i in range(50)))
    return True


def _oversized(where, stream, deadline) -> bool:
    head = json.dumps({"name": "x", "dtype": "float32", "shape": [1 << 30],
                       "stream": stream}).encode()
    _with_token(where, struct.pack("<qIQ", 5, len(head), 4 << 30) + head + bytes(1 << 16))
    return True


def _replayed(where, stream, deadline) -> bool:
    frame = _frame(0, "x", np.ones((1, 3, 8, 8), "float32"), stream)  # input 0: taken long ago
    _with_token(where, frame + frame)
    return True


def _malformed(where, stream, deadline) -> bool:
    _with_token(where, struct.pack("<qIQ", 1, 9, 3) + b"{not json")
    return True


ATTACKS = {"dripping handshake": _drip_handshake, "idle without the token": _idle_without_token,
           "new sequence numbers": _new_sequence_numbers, "oversized frames": _oversized,
           "duplicates": _replayed, "malformed frames": _malformed}


def _stream_under_attack(board_pipeline, n: int) -> None:
    """``n`` inputs through the pipeline while each attack runs in turn at the boards: none
    lost, in order, equal to the clean run, none waits over 10 s; the boards' memory grows by
    less than the window's bytes + PER_ATTACKER per attack."""
    p, procs, xs, clean = board_pipeline
    inboxes = [m.inbox() for m in p.modules]
    stream = p.links.stream
    rss0 = max(_board_rss(q) for q in procs)
    peak = [rss0]
    got, waits, done = [], [], threading.Event()

    def legit():
        for i in range(n):
            t0 = time.monotonic()
            got.append(p.submit(xs[i % len(xs)]).result(timeout=30)[0])
            waits.append(time.monotonic() - t0)
        done.set()

    t = threading.Thread(target=legit, daemon=True)
    t.start()
    rounds = 0
    while not done.is_set() or rounds == 0:
        for name, attack in ATTACKS.items():
            for k, where in enumerate(inboxes):
                arg = _rpc_port(p.modules[k].session.sess) if name == "dripping handshake" \
                    else stream
                _bounded(attack, where, arg)
                peak.append(max(_board_rss(q) for q in procs))
        rounds += 1
    t.join(60)
    window = 2 * len(p.modules) * (p.depth + 1) * xs[0]["x"].nbytes
    assert len(got) == n, f"{n - len(got)} inputs lost"
    for i, y in enumerate(got):
        np.testing.assert_array_equal(y, clean[i % len(xs)], err_msg=f"input {i}")
    assert max(waits) < 10, max(waits)
    assert max(peak) - rss0 < window + PER_ATTACKER * len(ATTACKS), (max(peak) - rss0) / MiB
    assert p.transfer == "direct" and p._broken is None


# two real board servers and a two-stage pipeline under each attack (about 20 s): -m slow; the
# inbox and handshake attacks above run in the default suite
@pytest.mark.slow
@pytest.mark.rpc
def test_a_pipeline_on_real_boards_streams_through_each_attack(board_pipeline):
    _stream_under_attack(board_pipeline, 60)


@pytest.mark.rpc
@pytest.mark.slow
def test_a_thousand_inputs_stream_through_the_attacks(board_pipeline):
    _stream_under_attack(board_pipeline, 1000)
