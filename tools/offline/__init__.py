"""The Triton kernels compiled for a GPU that is not there (sm_80, sm_90) and judged from their binaries:
``compile`` (the offline driver and ``cuobjdump``), ``sass`` (reading SASS), ``health`` (every shipped config:
spills, shared memory, HGMMA) and ``profile`` (the main loops of the calls that matter most)."""
