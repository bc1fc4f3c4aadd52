"""What the passes share and no pass is: the build context, the pipeline that runs passes and
checks their contracts, readers of Relax and TIR, which kernel provider computes each op,
and readers of a lowered ``main``."""
