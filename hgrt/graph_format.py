"""The graph JSON's fixed words, in one place: the format version of its ``hgrt`` section and
the function names of the nodes that are no kernel.

The version rule: a reader refuses a section version it does not list in ``FORMAT_VERSIONS``;
a change that an older reader would misread (a field whose meaning changes, a field it must
not ignore) raises ``FORMAT_VERSION`` and keeps the older versions readable where it can. A new
``list_int`` attrs column needs no new version: readers keep columns they do not know
(``Graph.extra_columns``) and write them back.
"""

FORMAT_VERSION = 3
FORMAT_VERSIONS = (1, 2, 3)  # what this hgrt reads
COPY_FUNC = "__copy"  # copies input 0 to the node's own device
NOP_FUNC = "__nop"  # a view of its input (a reshape that moves no byte)
CONCAT_FUNC = "__concat"  # a concatenation whose pieces their kernels wrote in place, in order
SLICE_FUNC = "__slice"  # a view of input 0's bytes from attrs["byte_offset"] (version 3)
VIEW_FUNCS = (NOP_FUNC, CONCAT_FUNC, SLICE_FUNC)  # nodes that are views of bytes other steps write
SPECIAL_FUNCS = (COPY_FUNC, *VIEW_FUNCS)  # nodes no library function computes
# a kernel node's attrs that say why it runs where it does and by whom, each "<kind>: <detail>"
# or "<kind>" (``hgrt inspect --ops``); a graph without them still loads ("not recorded")
DEVICE_WHY = "device_why"  # why its device: "fallback", "rule 'nn.conv2d'", "auto: 1.2 ms ..."
PROVIDER_WHY = "provider_why"  # why its provider ("tvm" where no "provider" attr): "asked: ..."
