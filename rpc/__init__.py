"""hgrt.rpc: run hgrt graphs on a remote machine through TVM RPC."""
