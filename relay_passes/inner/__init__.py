"""Passes that other passes call, never listed in ``hgrt.compiler.PASSES`` themselves: the
automatic placement of ``place_devices``, the rewrites inside ``legalize_and_fuse``, the default
CPU schedule and weight prepacking of ``schedule_cpu``, the tuning database of ``apply_tuning``
and ``hgrt tune``, and the model rewrites of ``hgrt.frontend`` (``simplify``)."""
