"""`pdserve launch CONFIG.yaml --ray ADDRESS`: the one-host launcher's processes, placed, restarted and
stopped by Ray (docs/structure.md, docs/DEPLOY.md). Ray is an optional extra (`pip install
'pdserve[ray]'`); nothing outside this package imports it."""

from __future__ import annotations

INSTALL_HINT = "pdserve --ray needs Ray: pip install 'pdserve[ray]'"
NAMESPACE = "pdserve"


class RayMissing(RuntimeError):
    pass


def require_ray():
    """The `ray` module, or RayMissing saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RayMissing(f"{INSTALL_HINT} ({exc})") from None
    return ray
