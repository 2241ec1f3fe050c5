"""``python -m tools.gpu_tune``: the Triton kernels' configs timed on this GPU within a time budget, the winners
written into an output folder (``make gpu-tune``; docs/gpu.md). A developer's tool, run at a checkout's root.

    python -m tools.gpu_tune                        # on a GPU: 420 s, results into --out's folder (or $OUT)
    python -m tools.gpu_tune --steps compare        # the comparison alone, with the shipped configs
    python -m tools.gpu_tune --smoke --budget 120   # anywhere: every step at toy sizes, under Triton's interpreter

Built on gpu-check's runner (``tools.gpu_check.runner``): the steps (``plan.py``) run in order of value, each a
subprocess within its share of the budget, stopped when it overruns, and the results are rewritten after each in
the output folder (``--out``, default ``benchmarks/results/gpu-tune-{device}-{date}``; the ``OUT`` environment
variable, when set, names it instead): ``summary.md``, ``gpu-tune.json`` and ``gpu-tune.tgz``, with
``measured-<family>.json``: the winners, with provenance, as the launcher reads them
(``flashattn/backends/triton/measured/``; copy it there to ship it). Each tuning step (``sweep.py``) tries one
kernel group at one head dim (``space.py`` says which configs, ``problems.py`` which call); the last step times the
library, with the configs just measured, against SDPA's backends and FlexAttention (``flashattn bench sweep``).
"""
