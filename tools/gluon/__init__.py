"""Tools for the Hopper tier's Gluon forward (``flashattn/backends/triton/hopper/``): a FlashAttention-3-style
forward written in Gluon (``triton.experimental.gluon``, Triton 3.6), a producer warp feeding two consumer
warpgroups through TMA and mbarriers, a wgmma kept in flight under each softmax.

It answers one question (issue 15): can Gluon express what ``tl`` cannot on sm_90, and what would it gain? Its
offline SASS counts against the ``tl`` forward are in ``benchmarks/NOTES.md`` (``python -m tools.gluon.profile``);
``tests/test_gluon_forward.py`` keeps it compiling. ``gpu_run.py`` (gpu-check's ``gluon`` step) checks every
schedule against float64 on a Hopper GPU, then times it: on an H200 all were correct, at d=64 1.4x the portable
``tl`` forward and at d=128 level with it, so the tier serves bf16 forwards at d=64 (``hopper.declines``).
"""
