"""ParallelDims: the one source of truth for parallel degrees, rank placement and device meshes.

Ranks are placed tp innermost, then dp, then pp (Megatron's order): a tp group is adjacent ranks,
so it stays inside a node where NVLink is fastest; pp groups stride furthest and cross nodes first.

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

Expert parallelism shares ranks with dp: the dp axis is split into (dp / ep) replicas of an ep
group, ep innermost, so an expert all-to-all stays among neighbouring dp ranks.
This module imports torch only inside build_mesh().
"""
from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A config that cannot run. The message shows the arithmetic."""


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "vpp", "ep", "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        product = self.dp * self.tp * self.pp
        if product != self.world_size:
            raise ConfigError(
                f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {product} != world size {self.world_size}")
        if self.dp % self.ep:
            raise ConfigError(f"dp {self.dp} not divisible by ep {self.ep} (expert parallel shares the dp ranks)")

    @classmethod
    def from_config(cls, parallel, launcher=None) -> "ParallelDims":
        world = parallel.dp * parallel.tp * parallel.pp
        if launcher is not None and launcher.nproc_per_node > 0:
            world = launcher.nodes * launcher.nproc_per_node
        return cls(dp=parallel.dp, tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp, ep=parallel.ep, world_size=world)

    # -- placement (pure) ---------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its index along each axis."""
        return {"pp": rank // (self.dp * self.tp), "dp": (rank // self.tp) % self.dp, "tp": rank % self.tp,
                "ep": ((rank // self.tp) % self.dp) % self.ep}

    def groups(self, axis: str) -> list[list[int]]:
        """The rank groups that communicate along one axis (e.g. every tp group)."""
        out: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            if axis == "ep":
                key = (c["pp"], c["dp"] // self.ep, c["tp"])
            else:
                key = tuple(v for k, v in c.items() if k not in (axis, "ep"))
            out.setdefault(key, []).append(r)
        return list(out.values())

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep,
                "world_size": self.world_size}

    def label(self) -> str:
        parts = [f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("vpp", self.vpp),
                                        ("ep", self.ep)) if v > 1]
        return "-".join(parts) or "1"

    # -- meshes (torch) -------------------------------------------------------------------------
    def build_mesh(self, device_type: str):
        """The world DeviceMesh with named axes ("pp", "dp", "tp"); with ep > 1 the dp axis is
        ("dp_rep", "ep") and "dp" is their flattening. Every axis exists, size 1 or not, so
        strategies index mesh[axis] without special cases."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.ep > 1:
            mesh = init_device_mesh(device_type, (self.pp, self.dp // self.ep, self.ep, self.tp),
                                    mesh_dim_names=("pp", "dp_rep", "ep", "tp"))
            mesh["dp_rep", "ep"]._flatten("dp")
            return mesh
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
