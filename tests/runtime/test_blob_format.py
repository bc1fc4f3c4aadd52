"""The packed-weight blob's header is defined once, in providers/onednn/blob.py: the C++
header the shim compiles (providers/onednn/onednn_blob.h) is what that module generates, every
file of the shim is in the key of its build cache, and the compiled shim reports the format
Python writes."""

from __future__ import annotations

import re
import shutil

import pytest

from hgrt.providers.onednn import blob as onednn_blob
from hgrt.providers.onednn import kernels as onednn
from hgrt.runtime import native

RUNTIME = onednn.SOURCES[0].parent
HEADER = RUNTIME / "onednn_blob.h"
REGENERATE = "python -m hgrt.providers.onednn.blob > providers/onednn/onednn_blob.h"


def test_the_shim_s_blob_header_is_the_one_onednn_blob_generates():
    assert HEADER.read_text() == onednn_blob.cpp_header(), (
        f"providers/onednn/onednn_blob.h is not what providers/onednn/blob.py generates: "
        f"{REGENERATE}")


def test_the_generated_slots_sit_where_python_puts_them():
    text = onednn_blob.cpp_header()
    body = re.search(r"enum Slot : int \{(.*?)\};", text, re.DOTALL).group(1)
    slots = dict(re.findall(r"(k\w+) = (\d+),", body))
    names = [onednn_blob._cpp_name(name) for name in onednn_blob.HEADER_SLOTS]
    assert len(set(names)) == len(names)
    assert {name: int(slots[name]) for name in names} == {
        name: i for i, name in enumerate(names)}
    assert int(slots["kUsedSlots"]) == len(names) <= onednn_blob.HEADER_INT64
    # the names the shim's code reads (a rename here would not compile there)
    assert names[:3] == ["kMagicSlot", "kVersionSlot", "kKind"]
    assert {"kIC", "kPadT", "kPost0", "kPost0Alpha", "kPoolKH", "kPoolOW", "kAlgo"} <= set(names)


def test_every_file_of_the_shim_is_compiled_and_in_the_cache_key(tmp_path):
    assert set(RUNTIME.glob("onednn*.cc")) == set(onednn.SOURCES)
    assert set(RUNTIME.glob("onednn*.h")) == set(onednn.HEADERS)
    copies = []
    for path in (*onednn.SOURCES, *onednn.HEADERS):
        copies.append(tmp_path / path.name)
        shutil.copy(path, copies[-1])
    keys = {native.cache_dir("hgrt_onednn", copies, ["-O2"])}
    for path in copies:
        path.write_text(path.read_text() + "\n")
        keys.add(native.cache_dir("hgrt_onednn", copies, ["-O2"]))
    assert len(keys) == 1 + len(copies)
    assert native.cache_dir("hgrt_onednn", copies, ["-O3"]) not in keys


@pytest.mark.skipif(onednn.unavailable_reason() is not None, reason="oneDNN unavailable")
def test_the_compiled_shim_reads_the_format_python_writes():
    compiled, written = onednn.blob_format(), onednn_blob.blob_format()
    differ = {k: (compiled.get(k), written.get(k)) for k in compiled.keys() | written.keys()
              if compiled.get(k) != written.get(k)}
    assert differ == {}, f"shim, onednn_blob.py: {differ}; {REGENERATE}"
