import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """pdserve runs on asyncio (uvicorn); anyio would also try trio, which selenium installs."""
    return "asyncio"
