"""The table of converters: ``CONVERTERS`` maps an ONNX op type to the function that turns one
node of it into Relax (``converter.Converter``), gathered from one module per family of ops
(``elementwise.py``, ``recurrent.py``, ``tensors.py``). A family module holds its own table;
adding a family is a module and one entry in ``FAMILIES``.
"""

from __future__ import annotations

from hgrt.importer import elementwise, recurrent, tensors
from hgrt.importer.converter import Converter

FAMILIES = (elementwise, recurrent, tensors)
CONVERTERS: dict[str, Converter] = {op: convert for family in FAMILIES
                                    for op, convert in family.CONVERTERS.items()}
