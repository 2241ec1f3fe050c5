"""An experiment kept for what it measured, not a path: a FlashAttention-3-style forward for Hopper written in Gluon
(``triton.experimental.gluon``, Triton 3.6), with a producer warp feeding two consumer warpgroups through TMA and
mbarriers and a wgmma kept in flight under each softmax.

It answers one question (issue 15): can Gluon express what ``tl`` cannot on sm_90, and what would it gain? Its
offline SASS counts against the ``tl`` forward are in ``benchmarks/NOTES.md`` (``python -m tools.gluon.profile``);
``tests/test_gluon_forward.py`` keeps it compiling. It has not run on a GPU, so nothing routes calls to it: it
becomes a path only once a GPU session has checked it against the float64 oracle and measured it faster than the
``triton`` path's forward.
"""
