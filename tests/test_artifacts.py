"""Artifact files that are damaged: a library cut short, a params.bin with corrupt records.

Each is refused with an ``HgrtError`` that names the file (and the param), on every path that
reads it: ``hgrt.load``, ``hgrt.create`` with a path, ``Host.add``, ``hgrt.rpc.upload``.
"""

from __future__ import annotations

import os
import shutil
import struct

import numpy as np
import pytest
import tvm

import hgrt
import hgrt.rpc
from hgrt.artifacts import (
    LIB_FILE,
    PARAMS_FILE,
    ArtifactError,
    elf_end,
    iter_params,
    params_to_bytes,
)
from hgrt.errors import ParamError
from hgrt.testing import GraphBuilder, N, elementwise_lib


def graph() -> str:
    g = GraphBuilder()
    g.output(g.op("mul", [g.op("add_one", [g.input("x")]), g.input("w", param=True)]))
    return g.json()


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return hgrt.save(str(tmp_path_factory.mktemp("a") / "art"), graph(), elementwise_lib(),
                     {"w": np.full(N, 2, "float32")})


def damaged(art: str, tmp_path, name: str, data: bytes) -> str:
    """A copy of ``art`` with the file ``name`` replaced by ``data``."""
    out = str(tmp_path / "damaged")
    shutil.copytree(art, out)
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)
    return out


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ---- a library cut short: dlopen would map past the end of the file and die of SIGBUS ---------


def test_elf_end_is_the_file_size_of_a_whole_library(art):
    lib = os.path.join(art, LIB_FILE)
    assert elf_end(lib) == os.path.getsize(lib)  # the section headers come last
    assert elf_end(os.path.join(art, PARAMS_FILE)) is None  # not ELF: nothing to say


@pytest.mark.parametrize("keep", [0.999, 0.8, 0.5, 0.15, 40 / 1e9])
def test_a_truncated_library_is_refused_on_every_path(art, tmp_path, keep):
    whole = read(os.path.join(art, LIB_FILE))
    cut = max(int(len(whole) * keep), 40)  # 40 bytes: inside the ELF header itself
    out = damaged(art, tmp_path, LIB_FILE, whole[:cut])
    lib = os.path.join(out, LIB_FILE)
    msg = rf"{LIB_FILE} is truncated: {cut} bytes, but its ELF headers place data up to byte"
    with pytest.raises(ArtifactError, match=msg):
        hgrt.load(out, ["cpu:0"])
    with pytest.raises(ArtifactError, match=msg):
        hgrt.create(graph(), lib, [tvm.cpu(0)])
    host = hgrt.Host(["cpu:0"])
    with pytest.raises(ArtifactError, match=msg):
        host.add("net", out)
    assert host.budgets()["cpu:0"].used == 0
    with pytest.raises(ArtifactError, match=msg):
        hgrt.rpc.upload(tvm.rpc.LocalSession(), lib)


def test_the_whole_library_still_loads_and_runs(art):
    m = hgrt.load(art, ["cpu:0"])
    m.run(x=np.ones(N, "float32"))
    np.testing.assert_array_equal(m.get_output(0).numpy(), np.full(N, 4, "float32"))


# ---- params.bin: every count and size checked before it is used ------------------------------

PARAMS = {"w": np.arange(12, dtype="float32").reshape(3, 4), "b": np.arange(5, dtype="int64")}
BLOB = params_to_bytes(PARAMS)
NAMES_AT = 24  # list magic, reserved, name count
# where the records of param "w" start: after the names and the tensor count
W_AT = NAMES_AT + sum(8 + len(n) for n in PARAMS) + 8


def patched(at: int, fmt: str, value) -> bytes:
    blob = bytearray(BLOB)
    struct.pack_into(fmt, blob, at, value)
    return bytes(blob)


CORRUPT = {
    "a name count past the file": (patched(16, "<Q", 1 << 60), r"says \d+ params, more than"),
    "a name longer than the file": (patched(NAMES_AT, "<Q", 1 << 40),
                                    "ends inside the name of param 0"),
    "a name that is not UTF-8": (patched(NAMES_AT + 8, "<B", 0xFF),
                                 "the name of param 0 is not UTF-8"),
    "negative dims": (patched(W_AT + 24, "<i", -3), r"'w' has a header .* -3 dims"),
    "a 37-bit float": (patched(W_AT + 29, "<B", 37), r"'w' of shape \(3, 4\) and dtype code 2 "
                                                     r"of 37 bits x 1 records 48 bytes"),
    "a negative size": (patched(W_AT + 32, "<q", -3), r"'w' of shape \(-3, 4\) .* records"),
    "a huge size": (patched(W_AT + 32, "<q", 1 << 40), r"'w' of shape \(1099511627776, 4\)"),
    "a byte count that is not the shape's": (patched(W_AT + 48, "<Q", 40),
                                             r"'w' .* records 40 bytes of data, not 48"),
    "data cut short": (BLOB[:-3], r"'b' \(5,\) is truncated \(37 of its 40 bytes"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_corrupt_params_record_is_a_param_error_naming_it(case):
    blob, match = CORRUPT[case]
    with pytest.raises(ParamError, match=match):
        list(iter_params(blob))


def test_the_offsets_above_point_at_the_records_they_name():
    # the layout the corruptions assume, checked on the untouched blob
    assert struct.unpack_from("<Q", BLOB, 16)[0] == 2
    assert struct.unpack_from("<Q", BLOB, NAMES_AT)[0] == 1 and BLOB[NAMES_AT + 8:][:1] == b"w"
    assert struct.unpack_from("<iBBH", BLOB, W_AT + 24) == (2, 2, 32, 1)
    assert struct.unpack_from("<qqQ", BLOB, W_AT + 32) == (3, 4, 48)
    got = dict(iter_params(BLOB))
    assert got.keys() == PARAMS.keys()
    for k, v in PARAMS.items():
        np.testing.assert_array_equal(got[k], v)


def test_a_corrupt_params_file_is_refused_by_load_and_host_leaving_nothing(art, tmp_path):
    blob = read(os.path.join(art, PARAMS_FILE))
    out = damaged(art, tmp_path, PARAMS_FILE, blob[:-5])
    with pytest.raises(ParamError, match=rf"{PARAMS_FILE}'?: param 'w' \(16,\) is truncated"):
        hgrt.load(out, ["cpu:0"])
    host = hgrt.Host(["cpu:0"])
    with pytest.raises(ParamError, match=r"param 'w' \(16,\) is truncated"):
        host.add("net", out)
    assert host.budgets()["cpu:0"].used == 0 and "net" not in repr(host)


def test_a_library_with_corrupt_headers_is_refused(art, tmp_path):
    whole = bytearray(read(os.path.join(art, LIB_FILE)))
    struct.pack_into("<H", whole, 54, 35)  # e_phentsize: 35, not 56 (struct.error before)
    out = damaged(art, tmp_path, LIB_FILE, bytes(whole))
    with pytest.raises(ArtifactError, match="its ELF headers are corrupt"):
        hgrt.load(out, ["cpu:0"])


def test_params_of_dtypes_numpy_lacks_still_read_through_tvm():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    blob = params_to_bytes({"b": np.arange(3, dtype=ml_dtypes.bfloat16),
                            "f": np.arange(4, dtype="float32")})
    got = dict(iter_params(blob))
    assert str(got["b"].dtype) == "bfloat16" and got["b"].shape == (3,)
    np.testing.assert_array_equal(got["b"].numpy().astype("float32"), [0, 1, 2])
    np.testing.assert_array_equal(got["f"], np.arange(4, dtype="float32"))
    cut = blob[:-17]  # into the bfloat16 data, its sizes checked before TVM reads it
    with pytest.raises(ParamError, match="truncated"):
        list(iter_params(cut))


def test_a_zero_dimensional_weight_keeps_its_shape_through_save_and_load():
    """numpy's ascontiguousarray makes a 0-d array 1-d: params must not (a scalar weight of a
    GPT-2 export was saved as (1,) and refused at load)."""
    from hgrt.artifacts import iter_params, params_to_bytes

    blob = params_to_bytes({"scale": np.array(0.5, "float32"), "w": np.ones((2, 3), "float32")})
    got = dict(iter_params(blob))
    assert np.asarray(got["scale"]).shape == ()
    assert float(np.asarray(got["scale"])) == 0.5
    assert np.asarray(got["w"]).shape == (2, 3)
