"""The router process imports neither torch nor the engine: it needs the wire contract
(server/openai/), the block hashing and `Level` of kvcache, and nothing that holds tensors."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import server.router.app
HEAVY = ("torch", "server.engine", "server.models", "server.api", "kvcache.manager", "kvcache.pool")
heavy = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith(HEAVY))
print(",".join(heavy))
"""


def test_importing_the_router_app_imports_no_torch_no_engine_and_no_server_api():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == ""


def test_the_kvcache_package_still_offers_its_names_on_first_use():
    probe = "import sys, kvcache; from kvcache import Level, block_hashes; print('torch' in sys.modules); " \
            "from kvcache import KVCacheManager; print('torch' in sys.modules, KVCacheManager.__module__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "True", "kvcache.manager"]


def test_the_deployment_config_imports_no_router_machinery():
    """Every server and the launcher read the deployment YAML: that needs the router's settings
    (server/config/router.py), not its HTTP client, backends, policies or queue."""
    probe = "import sys, server.config.schema; heavy = ('aiohttp', 'server.router.backends', " \
            "'server.router.policies', 'server.router.queue'); print(sorted(m for m in heavy if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
