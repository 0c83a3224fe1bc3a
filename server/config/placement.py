"""`ray_actor_options`: where `pdserve launch --ray` places a section's servers (Ray Serve's key:
num_cpus, num_gpus per rank, resources, runtime_env; docs/DEPLOY.md). Declared here without
importing Ray: the one-host launcher reads the same file and ignores the key."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

Amount = Annotated[float, Meta(ge=0)]
DEFAULT_NUM_CPUS = 1.0  # Ray Serve's default for a replica's actor


class RayActorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The resources of one actor (one rank of a tensor-parallel server), and its runtime env."""

    num_cpus: Amount = DEFAULT_NUM_CPUS
    num_gpus: Amount = 0.0
    resources: dict[str, Any] = {}  # checked by __post_init__ (msgspec's path of a dict value names no key)
    runtime_env: dict[str, Any] = {}

    def __post_init__(self) -> None:
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"resources.{name}: give it as num_{name.lower()}s")
            if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
                raise ValueError(f"resources.{name}: must be a number >= 0, got {amount!r}")
        if not (self.num_cpus or self.num_gpus or any(self.resources.values())):
            raise ValueError("num_cpus: an actor must ask for some resource (num_cpus, num_gpus or resources)")

    def bundle(self) -> dict[str, float]:
        """One placement group bundle: the resources of one actor."""
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in out.items() if v}


ROUTER = "router"  # the router's key in DeploymentConfig.ray_actor_options
