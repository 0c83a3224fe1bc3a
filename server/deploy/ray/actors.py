"""The actors of a deployment on Ray: one pdserve process each, and the other ranks' bundles.

`ProcessActor` runs one server (or the router) through the launcher's `Supervisor`; its
constructor starts the process and a watcher thread ends the actor when the process dies, which is
how Ray learns of the death. Files go to `<log dir>/<deployment>/` (0700) on the actor's node.
The server runs at its raylet's niceness, not Ray's worker niceness 15 (needs CAP_SYS_NICE; else
the launcher says so)."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from server.config.schema import RestartPolicy
from server.deploy.gpu_share import VISIBLE_DEVICES
from server.deploy.launcher import pdserve_command, write_private
from server.deploy.supervisor import Child, Running, Supervisor, log_tail
from server.exit import exit_text
from transceiver.wire import NODE_ID_ENV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActorSpec:
    deployment: str
    # its env: the token, torch threads, the section's `env`; its health_url as the launcher reaches it;
    # its config_path is replaced on the node
    child: Child
    config_yaml: str  # the placed deployment file, without the token
    node_id: str  # where its placement group is: on another node it does not start (that node was lost)
    rank_gpus: tuple[str, ...] = ()  # the GPUs Ray gave ranks 1..N-1 of a tensor-parallel server
    log_dir: str | None = None  # None: <tmp>/pdserve-ray
    backoff_s: float = 1.0  # a restarted actor waits this long before starting its process
    stop_wait_s: float = 40.0  # after SIGTERM, the process's drain; then SIGKILL


class ProcessActor:
    def __init__(self, spec: ActorSpec) -> None:
        import ray

        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        if self.node_id != spec.node_id:  # the placement group moved: this server's address was on the lost node
            ray.actor.exit_actor()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.restarted = bool(context.was_current_actor_reconstructed)
        if self.restarted:
            time.sleep(spec.backoff_s)
        self.spec, self.stopping = spec, False
        self.gpus = [str(g) for g in ray.get_gpu_ids()]
        self.node_ip = ray.util.get_node_ip_address()
        self.niceness = normal_priority()  # before the fork: the process inherits this thread's
        self.run = self._start(spec)
        threading.Thread(target=self._watch, name="pdserve-ray-watch", daemon=True).start()

    def _start(self, spec: ActorSpec) -> Running:
        root = Path(spec.log_dir) if spec.log_dir else Path(tempfile.gettempdir()) / "pdserve-ray"
        folder = root / spec.deployment
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        config = write_private(folder / f"{spec.child.name}.yaml", spec.config_yaml)
        env = {**spec.child.env, NODE_ID_ENV: self.node_id}
        if self.gpus:  # rank r of the server uses cuda:r: the GPU Ray gave rank r's bundle
            env[VISIBLE_DEVICES] = ",".join([*self.gpus, *spec.rank_gpus])
        self.group = Supervisor(pdserve_command, dict(os.environ), folder, RestartPolicy(max_quick_deaths=0), 0.5,
                                lambda line: log.info("%s", line))
        return self.group.start(replace(spec.child, config_path=config, env=env))

    def _watch(self) -> None:
        code = self.run.popen.wait()
        if not self.stopping:  # Ray restarts the actor, which starts the process again
            log.error("%s exited with %s: ending the actor", self.spec.child.name, exit_text(code))
            os._exit(1)

    def info(self) -> dict:
        return {"name": self.spec.child.name, "role": self.spec.child.role, "node_id": self.node_id,
                "node_ip": self.node_ip, "gpus": [*self.gpus, *self.spec.rank_gpus], "pid": self.run.popen.pid,
                "health_url": self.spec.child.health_url, "log": str(self.run.log_path), "restarted": self.restarted,
                "exited": self.run.exited(), "niceness": self.niceness, "stop_wait_s": self.spec.stop_wait_s}

    def tail(self) -> str:
        return log_tail(self.run.log_path)

    def stop(self) -> str | None:
        """SIGTERM (the process drains), SIGKILL after `stop_wait_s`; how it ended."""
        self.stopping = True
        self.group.stop_all([([self.spec.child.name], self.spec.stop_wait_s)])
        return self.run.exited()


def normal_priority() -> int:
    """Give this thread (and so the process it starts) its raylet's niceness, if allowed; the
    niceness it has then."""
    try:
        target = os.getpriority(os.PRIO_PROCESS, os.getppid())
        if os.getpriority(os.PRIO_PROCESS, 0) > target:
            os.setpriority(os.PRIO_PROCESS, 0, target)  # Linux: the calling thread
    except OSError as exc:  # EPERM without CAP_SYS_NICE
        log.warning("cannot lower the niceness Ray gives its workers (%s): the server runs at it", exc)
    return os.getpriority(os.PRIO_PROCESS, 0)


class RankActor:
    """Holds rank r's bundle of a tensor-parallel server (its GPU, which the server's process uses)."""

    def __init__(self) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.gpus = [str(g) for g in ray.get_gpu_ids()]

    def info(self) -> dict:
        return {"node_id": self.node_id, "gpus": self.gpus}
