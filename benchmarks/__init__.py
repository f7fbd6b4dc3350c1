"""The benchmark of a built artifact: ``moe-build bench``.

It consumes an artifact (it builds nothing), so it lives apart from
``pipeline``:

- ``benchmarks.command``: the ``bench`` click command (registered in
  ``pipeline.cli``) and the text tables of a result (every row; the README's
  Performance table).
- ``benchmarks.bench``: the measurement: copy bandwidth, the correctness check
  of each case against the float64 reference, CUDA-graph and host timing, the
  result JSON and its plot.
- ``benchmarks.baseline``: the plain-torch MoE layer the kernels are compared
  against.

Committed results (JSON and PNG) are under ``benchmarks/results/``; they are
data, not part of the installed package. ``benchmarks/cluster_stream.cu`` is
a standalone CUDA program (built with nvcc on a GPU machine) that measures
how fast a grid of clusters streams HBM, the floor the mega kernel's grids
are compared against.
"""
