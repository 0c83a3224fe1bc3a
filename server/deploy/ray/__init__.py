"""`pdserve launch CONFIG.yaml --ray ADDRESS`: the same deployment, placed, supervised and stopped by Ray.

The servers are the one-host launcher's processes (`pdserve serve --config FILE --server NAME`,
`pdserve router --config FILE`), started the same way (server/deploy/supervisor.py `Supervisor`:
their environment, log, session and death signal, the SIGTERM drain and SIGKILL after it); what
differs is who places them and who restarts them:

1. `placement.py`: one placement group per server (STRICT_PACK: one bundle of the section's
   `ray_actor_options` per tensor-parallel rank, so every rank lands on one node) and one for the
   router. A request no node of the cluster can ever meet fails at once, naming the section; one
   that waits for busy resources fails after `placement_timeout_s`. Servers without `urls` get a
   free port on their node and the node's address; the launcher writes the resulting file (the
   token left out) and every actor runs from it.
2. `actors.py`: each server is an actor named `<deployment>/<server>` in the Ray namespace, whose
   constructor starts the server process (with its token, its GPUs and PDSERVE_NODE_ID) and whose
   watcher thread ends the actor when the process dies, so that Ray restarts both: the new process
   has a new epoch, the router fences the server meanwhile. Ranks 1..N-1 of a tensor-parallel
   server hold bundles 1..N-1 (`RankActor`: their GPUs go to the server's process, which spawns the
   ranks as on one host).
3. `launch.py`: the launcher itself: waits for health and KV handshakes as on one host, starts the
   router, then reports deaths and returns until a stop signal, when it drains the router, then the
   servers, and removes every actor and placement group; `--detach` returns at once instead.
4. `manage.py`: `pdserve ray status NAME` and `pdserve ray down NAME`.

Ray is an optional extra (`pip install 'pdserve[ray]'`); nothing outside this package imports it.
"""

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
