"""Benchmarks: everything ``flashattn bench <subcommand>`` and ``flashattn demo`` measure, print and write.

- ``measure``: one case's time, TFLOP/s and peak memory (CPU subprocess isolation, CUDA events with L2 flush);
  ``OURS`` and the implementation table.
- ``report``: the plot helper and results writer (JSON with a ``meta`` block) and the column templates of the
  tables (``flashattn.tables`` formats them).
- ``options``: option types and options shared by the subcommands.
- ``load``: whether the machine is busy, read before timing and recorded in every result file.
- One module per subcommand, each with ``add_arguments(parser)`` and ``command(args)``: ``sweep``, ``decode``,
  ``cpu``, ``context_parallel`` (also ``python -m flashattn.bench.context_parallel`` under torchrun),
  ``cuda_kernel`` and ``block_mask``.
"""
