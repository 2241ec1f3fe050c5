"""``python -m tools.gpu_tune``: the Triton kernels' configs timed on the lent GPU, in one call that fits the lease
(``make gpu-tune``). A developer's tool, run at a checkout's root.

    python -m tools.gpu_tune                        # on a GPU: 420 s, results into $OUT (else --out)
    python -m tools.gpu_tune --steps compare        # the comparison alone, with the measured table of $FLASHATTN_...
    python -m tools.gpu_tune --smoke --budget 120   # anywhere: every step at toy sizes, under Triton's interpreter

Built on gpu-check's runner (``tools.gpu_check.runner``): the steps (``plan.py``) run in order of value, each a
subprocess within its share of the budget, stopped when it overruns, and the results are rewritten after each into
``summary.md``, ``gpu-tune.json`` and ``gpu-tune.tgz``, with ``measured-<family>.json``: the winners, with
provenance, as the launcher reads them (``flashattn/backends/triton/measured/``; copy it there to ship it). Each
tuning step (``sweep.py``) tries one kernel group at one head dim (``space.py`` says which configs, ``problems.py``
which call); the last step times the library, with the configs just measured, against SDPA's backends and
FlexAttention (``flashattn bench sweep``).
"""
