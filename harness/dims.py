"""ParallelDims: the one source of truth for parallel degrees, rank placement and device meshes.

Ranks are placed tp innermost, then cp, then dp, then pp (Megatron's and torchtitan's order): a tp
group is adjacent ranks, so it stays inside a node where NVLink is fastest; cp next (its K/V
all-gathers are per layer, like tp's, but fewer and larger); pp groups stride furthest and cross
nodes first.

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

Data parallel may be hybrid (HSDP): dp = dp_replicate x dp_shard, dp_shard inner, so a shard group
is neighbouring dp ranks (one node) and replicas of it stride across nodes:
    dp_rank = dp_replicate_rank * dp_shard + dp_shard_rank.
Expert parallelism shares ranks with dp: the dp axis is split into (dp / ep) replicas of an ep
group, ep innermost, so an expert all-to-all stays among neighbouring dp ranks.
This module imports torch only inside build_mesh().
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Imports inside functions: torch and what imports it, which the parent process never loads.


@dataclass(frozen=True)
class Axis:
    """One parallel degree a config sets (`parallel.<name>`), as every table, label and record shows it."""
    name: str  # the config key, the ParallelDims field and the key in a record's `dims`
    short: str  # its degree in a label: dp4, dprep2
    title: str  # what the report calls it
    role: str  # "mesh": a strategy sets it and ranks form groups along it; "split": a split of dp with
    #            traffic of its own (HSDP's replicas); "stages": pipeline stages per rank, no group of ranks


# The one enumeration of axes (torchtitan keeps its MeshAxisName the same way), in the order labels show them.
AXES = (Axis("dp", "dp", "data parallel", "mesh"), Axis("dp_replicate", "dprep", "HSDP replicas", "split"),
        Axis("cp", "cp", "context parallel", "mesh"), Axis("tp", "tp", "tensor parallel", "mesh"),
        Axis("pp", "pp", "pipeline parallel", "mesh"), Axis("vpp", "vpp", "virtual stages per rank", "stages"),
        Axis("ep", "ep", "expert parallel", "mesh"))
DEGREES = tuple(a.name for a in AXES)
MESH_AXES = tuple(a.name for a in AXES if a.role == "mesh")  # what a strategy may set > 1
COMM_AXES = tuple(a.name for a in AXES if a.role != "stages")  # each with its own traffic (comm_<axis>_bytes)
PLACEMENT = ("pp", "dp", "cp", "tp")  # outermost first: the rank order above


def world_size(degrees: dict) -> int:
    """The ranks a layout takes: the product of PLACEMENT's degrees (ep and dp_replicate split the dp ranks,
    vpp is stages per rank), from a record's, a config's or ParallelDims' degrees."""
    return math.prod(int(degrees.get(a) or 1) for a in PLACEMENT)


def degrees(dims: dict, sep: str = " ") -> str:
    """`dp2 cp2 tp2 pp2 vpp2` from a record's or a config's degrees; "1" for a one-device run."""
    return sep.join(f"{a.short}{dims[a.name]}" for a in AXES if (dims.get(a.name) or 1) > 1) or "1"


FAMILY_AXES = ("tp", "pp", "cp", "ep")  # the axes a layout family names; data parallelism alone is `dp`


def family(degrees: dict, ranks_per_node: int) -> str:
    """The layout family validation errors are kept by (harness/costmodel/family_errors.json): which of tp, pp,
    cp and ep are over 1 (`dp` where none is), tp as `tp>node` where a TP group spans nodes, then `in node` or
    `across nodes` as the layout's ranks fit one node or not (data parallel and pipeline groups cross first,
    PLACEMENT). degrees: a record's, a config's or ParallelDims' degrees, dp among them."""
    tp = int(degrees.get("tp") or 1)
    axes = [("tp>node" if tp > ranks_per_node else "tp") if a == "tp" else a
            for a in FAMILY_AXES if int(degrees.get(a) or 1) > 1]
    return f"{'+'.join(axes) or 'dp'} {'across nodes' if world_size(degrees) > ranks_per_node else 'in node'}"


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
    cp: int = 1
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        for name in (*DEGREES, "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        product = world_size(self.as_dict())
        if product != self.world_size:
            cp = f" * cp({self.cp})" if self.cp > 1 else ""
            raise ConfigError(f"dp({self.dp}){cp} * tp({self.tp}) * pp({self.pp}) = {product} "
                              f"!= world size {self.world_size}")
        if self.dp % self.ep:
            raise ConfigError(f"dp {self.dp} not divisible by ep {self.ep} (expert parallel shares the dp ranks)")
        if self.dp % self.dp_replicate:
            raise ConfigError(f"dp {self.dp} not divisible by dp_replicate {self.dp_replicate} "
                              f"(dp = dp_replicate x dp_shard; {self.dp} % {self.dp_replicate} = "
                              f"{self.dp % self.dp_replicate})")
        if self.ep > 1 and (self.dp_replicate > 1 or self.cp > 1):
            raise ConfigError(f"ep {self.ep} with dp_replicate {self.dp_replicate} / cp {self.cp}: expert parallel "
                              f"splits the dp axis into (dp/ep, ep) itself; HSDP and context parallel are not "
                              f"combined with it here")

    @classmethod
    def from_config(cls, parallel, launcher=None) -> "ParallelDims":
        cp, rep = getattr(parallel, "cp", 1), getattr(parallel, "dp_replicate", 1)
        world = world_size({"dp": parallel.dp, "cp": cp, "tp": parallel.tp, "pp": parallel.pp})
        if launcher is not None and launcher.nproc_per_node > 0:
            world = launcher.nodes * launcher.nproc_per_node
        return cls(dp=parallel.dp, tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp, ep=parallel.ep, world_size=world,
                   cp=cp, dp_replicate=rep)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    # -- placement (pure) ---------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its index along each axis."""
        dp = (rank // (self.cp * self.tp)) % self.dp
        return {"pp": rank // (self.dp * self.cp * self.tp), "dp": dp, "tp": rank % self.tp,
                "ep": dp % self.ep, "cp": (rank // self.tp) % self.cp,
                "dp_replicate": dp // self.dp_shard, "dp_shard": dp % self.dp_shard}

    def groups(self, axis: str) -> list[list[int]]:
        """The rank groups that communicate along one axis (e.g. every tp group). `dp_cp` is the
        gradient-sync group of data and context parallel together (FSDP/DDP reduce over it); `ep_dp`
        the expert-data-parallel group that reduces expert gradients (dp / ep ranks)."""
        derived = {"dp", "ep", "dp_replicate", "dp_shard"}  # coordinates that are functions of dp
        varying = {"dp": derived, "dp_cp": derived | {"cp"}, "dp_replicate": derived - {"dp_shard"},
                   "dp_shard": derived - {"dp_replicate"}}.get(axis, {axis})
        out: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            if axis == "ep":
                key = (c["pp"], c["dp"] // self.ep, c["cp"], c["tp"])
            elif axis == "ep_dp":  # expert data parallel: the dp ranks that hold the same experts
                key = (c["pp"], c["dp"] % self.ep, c["cp"], c["tp"])
            else:
                key = tuple(v for k, v in c.items() if k not in varying)
            out.setdefault(key, []).append(r)
        return list(out.values())

    def grid(self, rank: int) -> tuple[int, int, int]:
        """Where a rank sits when the mesh is drawn stage by stage, each stage a dp x (cp x tp) grid:
        (pipeline stage, dp row, column), its row's ranks consecutive (PLACEMENT: tp innermost, then cp)."""
        c = self.coords(rank)
        return c["pp"], c["dp"], c["cp"] * self.tp + c["tp"]

    def grid_shape(self) -> tuple[int, int, int]:
        """(stages, rows, columns) of that drawing: pp, dp, cp x tp."""
        return self.pp, self.dp, self.cp * self.tp

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def as_dict(self) -> dict[str, int]:
        return {**{name: getattr(self, name) for name in DEGREES}, "world_size": self.world_size}

    def label(self) -> str:
        return degrees(self.as_dict(), sep="-")

    # -- meshes (torch) -------------------------------------------------------------------------
    def build_mesh(self, device_type: str):
        """The world DeviceMesh with named axes ("pp", "dp", "tp"); with ep > 1 the dp axis is
        ("dp_rep", "ep") and "dp" is their flattening; with cp > 1 or dp_replicate > 1 the axes are
        ("pp", "dp_replicate", "dp_shard", "cp", "tp") with the flattenings "dp" (dp_replicate,
        dp_shard), "dp_cp" (the gradient-sync group) and "dp_shard_cp" (what FSDP shards over).
        Every axis a strategy indexes exists, size 1 or not, so strategies index mesh[axis]
        without special cases."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.ep > 1:
            mesh = init_device_mesh(device_type, (self.pp, self.dp // self.ep, self.ep, self.tp),
                                    mesh_dim_names=("pp", "dp_rep", "ep", "tp"))
            mesh["dp_rep", "ep"]._flatten("dp")
            return mesh
        if self.cp > 1 or self.dp_replicate > 1:
            mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                    mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
            mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            return mesh
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
