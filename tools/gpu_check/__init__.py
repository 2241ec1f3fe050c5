"""``python -m tools.gpu_check``: the GPU check, a time-budgeted run whose summary and archive go into an output folder.
A developer's tool, run at a checkout's root on a machine with a GPU (``make gpu-check``; docs/gpu.md).

    python -m tools.gpu_check                       # on a GPU: 420 s, results into --out's folder (or $OUT)
    python -m tools.gpu_check --steps smoke,headline --budget 150   # some steps again, in less time
    python -m tools.gpu_check --smoke --budget 90   # anywhere: every step at toy sizes on the CPU

The steps (``plan.py``) run in order of value, each a subprocess given ``min(its share of the budget, what
remains)``: one that would get less than it needs is ``skipped (budget)``, one that runs past its allowance is
interrupted (SIGINT, then killed) and marked ``stopped (budget)``, keeping whatever it wrote. Every status is one
of ok, failed (exit code), skipped (budget) or stopped (budget). After every step the three result files are
rewritten (``pack.py``) in the output folder (``--out``, default ``benchmarks/results/gpu-check-{device}-{date}``;
the ``OUT`` environment variable, when set, names it instead): ``summary.md``, ``gpu-check.json`` and
``gpu-check.tgz`` with every log, JSON and plot.
Each step's compile seconds (Triton kernels, cache hits, launcher stubs) are counted (``clock.py``). The summary
table is the last thing printed. Exit status 1 when a step failed or was stopped; 2 on a machine without CUDA
(unless ``--smoke``).
"""
