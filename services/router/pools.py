"""The router's fleets by role: one co-located fleet, or a disaggregated fleet's two pools.

Co-located: `{"": fleet}`. Disaggregated: `{"prefill": P, "decode": D}`, each a Fleet with its
own policy (--prefill-policy, --decode-policy), health checks, breakers and prefix tree; a
request takes one replica of each (services/router/pairing.py). The admin surface, GetLoad,
Ready and the model-admin fan-out see every replica of every pool.

The router is ready while every pool has a routable replica: a pair needs both. Each pool's
fleet keeps its own verdict in a `PoolGate` (the part of a Readiness a Fleet uses), and the
router's Readiness is their conjunction, with the reasons of the pools that are down.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from services.common.server import Readiness
from services.router.fleet import Fleet, Replica
from services.router.roles import COLOCATED, DECODE, PREFILL


class PoolGate:
    """One pool's readiness, as a Fleet sets it; pushes the conjunction into the router's."""

    def __init__(self, joint: "JointReadiness") -> None:
        self.joint = joint
        self.ready, self.reason = True, None

    def set(self, ready: bool, reason: str | None = None) -> None:
        self.ready, self.reason = ready, None if ready else reason
        self.joint.update()


class JointReadiness:
    """The router's Readiness = every pool's gate is ready."""

    def __init__(self, target: Readiness, roles: list[str]) -> None:
        self.target = target
        self.gates = {role: PoolGate(self) for role in roles}

    def update(self) -> None:
        down = [f"{role or 'fleet'}: {g.reason}" for role, g in self.gates.items() if not g.ready]
        if not down:
            if not self.target.ready:
                self.target.set(True)
        elif self.target.ready or self.target.reason != "; ".join(down):
            self.target.set(False, "; ".join(down))


@dataclass
class Pools:
    fleets: dict[str, Fleet]  # role -> its fleet, prefill before decode

    @classmethod
    def of(cls, fleet: "Fleet | Pools") -> "Pools":
        """A bare Fleet is the one pool of a co-located router."""
        return fleet if isinstance(fleet, Pools) else cls({fleet.role: fleet})

    @classmethod
    def build(cls, config, readiness: Readiness) -> "Pools":
        """The fleets `config` asks for, their health joined into `readiness`."""
        if not config.disaggregated:
            return cls({COLOCATED: Fleet(config, readiness)})
        joint = JointReadiness(readiness, [PREFILL, DECODE])
        return cls({PREFILL: Fleet(config, joint.gates[PREFILL], role=PREFILL, policy=config.prefill_policy),
                    DECODE: Fleet(config, joint.gates[DECODE], role=DECODE, policy=config.decode_policy)})

    @property
    def disaggregated(self) -> bool:
        return PREFILL in self.fleets

    @property
    def prefill(self) -> Fleet:
        return self.fleets[PREFILL]

    @property
    def decode(self) -> Fleet:
        return self.fleets[DECODE]

    @property
    def model_name(self) -> str:
        return next((f.model_name for f in self.fleets.values() if f.model_name), "")

    def replicas(self) -> Iterator[tuple[Fleet, Replica]]:
        """Every replica of every pool, with its fleet."""
        for fleet in self.fleets.values():
            for replica in list(fleet.replicas.values()):
                yield fleet, replica

    def find(self, address: str) -> tuple[Fleet, Replica] | None:
        for fleet, replica in self.replicas():
            if replica.address == address:
                return fleet, replica
        return None

    def policy_name(self, config) -> str:
        """What ListReplicas reports as the policy."""
        if not self.disaggregated:
            return config.policy
        return f"prefill: {config.prefill_policy}, decode: {config.decode_policy}"

    async def probe(self, address: str) -> tuple[Fleet | None, str | None]:
        """The pool `address` may join, or None and why none takes it (each pool's reason)."""
        whys = []
        for role, fleet in self.fleets.items():
            why = await fleet.probe(address)
            if why is None:
                return fleet, None
            whys.append((role, why))
        if len({why for _, why in whys}) == 1:  # e.g. its health service did not answer
            return None, whys[0][1]
        return None, "; ".join(f"{role} pool: {why}" for role, why in whys)

    def start(self) -> None:
        for fleet in self.fleets.values():
            fleet.start()

    async def stop(self) -> None:
        for fleet in self.fleets.values():
            await fleet.stop()

    def track_readiness(self) -> None:
        for fleet in self.fleets.values():
            fleet.track_readiness()
