import os

# Without a GPU, the Triton kernels run under Triton's interpreter on CPU tensors. It must be switched on before
# triton is first imported, hence here, before torch (which may import triton).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# pytest-xdist runs one worker per core; torch's own thread pool on top of that oversubscribes the cores and
# makes small ops many times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
