"""hgrt.rpc: run hgrt graphs on a remote machine through TVM RPC.

>>> remote = hgrt.rpc.connect(tracker="10.0.0.1:9190", key="jetson")   # doctest: +SKIP
>>> lib = hgrt.rpc.upload(remote, "out/lib.so")                         # doctest: +SKIP
>>> m = hgrt.create(graph_json, lib, [remote.cpu(0), remote.cuda(0)])   # doctest: +SKIP
>>> m.set_input("x", x); m.run(); y = m.get_output(0).numpy()           # doctest: +SKIP

The server side is ``hgrt rpc-server`` (``hgrt.rpc.server.serve``).
"""

from hgrt.rpc.client import RemoteGraphModule, create_remote
from hgrt.rpc.session import connect, stats, upload

__all__ = ["RemoteGraphModule", "connect", "create_remote", "stats", "upload"]
