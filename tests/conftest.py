import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton decides at kernel definition whether a kernel runs compiled (CUDA) or interpreted (CPU
# tensors), so this is set before any test module imports a kernel: without a GPU, the kernels'
# tests run through the interpreter (tests/unit/test_triton_kernels.py).
# Under pytest-xdist each worker shares the machine's cores with the others: one torch thread per
# worker (and per process it starts) instead of one per core in each, which oversubscribes the CPU
# and makes torch's spinning thread pool many times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
except ImportError:
    pass


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """pdserve runs on asyncio (uvicorn); anyio would also try trio, which selenium installs."""
    return "asyncio"


@pytest.fixture
def no_env_overrides(monkeypatch) -> None:
    """The deployment's auth token and hostname as its YAML says: their environment overrides unset.
    Config tests take it for every test (`pytestmark = pytest.mark.usefixtures("no_env_overrides")`)."""
    from server.config.schema import AUTH_TOKEN_ENV, HOSTNAME_ENV

    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    monkeypatch.delenv(HOSTNAME_ENV, raising=False)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh folder with a short path, for tests whose files hold Unix sockets (the CUDA MPS pipe
    directory must stay under 80 characters; pytest's tmp_path grows longer under pytest-xdist)."""
    path = Path(tempfile.mkdtemp(prefix="pd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
