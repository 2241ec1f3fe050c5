"""An experiment kept for what it measured, not a path: a FlashAttention-3-style forward for Hopper written in Gluon
(``triton.experimental.gluon``, Triton 3.6), with a producer warp feeding two consumer warpgroups through TMA and
mbarriers and a wgmma kept in flight under each softmax.

It answers one question (issue 15): can Gluon express what ``tl`` cannot on sm_90, and what would it gain? Its
offline SASS counts against the ``tl`` forward are in ``benchmarks/NOTES.md`` (``python -m tools.gluon.profile``);
``tests/test_gluon_forward.py`` keeps it compiling. ``gpu_run.py`` (gpu-check's ``gluon`` step) checks every
schedule against float64 on a Hopper GPU, then times it: on an H200 all were correct, at d=64 1.4x the ``triton``
path's forward and at d=128 level with it. Nothing routes calls here yet: the Hopper tier that will serve them
(issue 45) needs lse in the backward's layout, launch plans and the remaining features first.
"""
