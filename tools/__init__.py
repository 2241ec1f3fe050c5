"""Developer tooling for flashattn, kept out of the package users install (``pyproject.toml`` ships ``flashattn``
only) and never imported by it. Run from a checkout, at its root:

- ``python -m tools.gpu_check``: everything a session with a GPU must run, into one folder (``make gpu-check``);
- ``python -m tools.offline.health`` and ``python -m tools.offline.profile``: the Triton kernels compiled offline
  for sm_80 and sm_90 and read from their SASS (registers, spills, shared memory, tensor-core instructions, main
  loop length; ``make health``);
- ``tools.gluon``: an experimental FlashAttention-3-style forward in Gluon, measured offline, routed to by nothing.
"""
