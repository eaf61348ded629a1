import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


HAS_TRITON = _has_triton()
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])


@pytest.fixture
def seed():
    """A fresh seed per test, printed on failure so a failing case can be replayed."""
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
