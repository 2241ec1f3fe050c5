"""``python -m tools.gpu_check``: what a session with a lent GPU runs first, in one call that fits the lease.
A developer's tool, run at a checkout's root (``make gpu-check``).

    python -m tools.gpu_check                       # on a GPU: 420 s, results into $OUT (else --out)
    python -m tools.gpu_check --budget 240          # a shorter, second call
    python -m tools.gpu_check --smoke --budget 90   # anywhere: every step at toy sizes on the CPU

The steps (``plan.py``) run in order of value, each a subprocess given ``min(its share of the budget, what
remains)``: one that would get less than it needs is ``skipped (budget)``, one that runs past its allowance is
interrupted (SIGINT, then killed) and marked ``stopped (budget)``, keeping whatever it wrote. Every status is one
of ok, failed (exit code), skipped (budget) or stopped (budget). After every step the three result files are
rewritten (``pack.py``): ``summary.md``, ``gpu-check.json`` and ``gpu-check.tgz`` with every log, JSON and plot.
Each step's compile seconds (Triton kernels, cache hits, launcher stubs) are counted (``clock.py``). The summary
table is the last thing printed. Exit status 1 when a step failed or was stopped; 2 on a machine without CUDA
(unless ``--smoke``).
"""
