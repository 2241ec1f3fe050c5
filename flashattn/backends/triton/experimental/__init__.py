"""Experimental kernels that are measured (offline SASS, later on a GPU) before anything routes calls to them.

Nothing here is imported by the backend: ``flashattn.backends.triton`` keeps dispatching to its ``tl`` kernels.
"""
