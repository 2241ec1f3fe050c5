import os

import torch

# pytest-xdist runs one worker per core; torch's own thread pool on top of that oversubscribes the cores and
# makes small ops many times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
