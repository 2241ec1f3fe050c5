"""Benchmarks: everything ``flashattn bench <subcommand>`` and ``flashattn demo`` measure, print and write.

- ``measure``: one case's time, TFLOP/s and peak memory (CPU subprocess isolation, CUDA events with L2 flush);
  ``OURS`` and the implementation table.
- ``report``: the one table formatter, plot helper and results writer (JSON with a ``meta`` block).
- ``options``: option types and options shared by the subcommands.
- One module per subcommand, each with ``add_arguments(parser)`` and ``command(args)``: ``sweep``, ``decode``,
  ``cpu``, ``context_parallel`` (also ``python -m flashattn.bench.context_parallel`` under torchrun) and
  ``cuda_kernel``.
"""
