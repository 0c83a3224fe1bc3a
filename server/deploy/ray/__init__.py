"""`pdserve launch CONFIG.yaml --ray ADDRESS`: the same deployment, placed, supervised and stopped by Ray.

The processes are the one-host launcher's, started by its `Supervisor`; Ray places and restarts them:
- `placement.py`: one STRICT_PACK placement group per server (a bundle per tensor-parallel rank)
  and one for the router; servers without `urls` get a free port on their node;
- `actors.py`: one actor per server (`<deployment>/<server>`) that owns its process and ends when
  it dies, so that Ray restarts both (the new process has a new epoch);
- `launch.py`: waits for health and handshakes, starts the router, reports deaths, stops it all;
- `manage.py`: `pdserve ray status|down NAME`.
Ray is an optional extra (`pip install 'pdserve[ray]'`); nothing outside this package imports it."""

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
