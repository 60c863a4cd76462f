"""What the FX pass did, for ``qla_compile.explain`` and the logs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RegionReport:
    anchor: str                 # the anchor node's name
    status: str                 # "replaced" or "rejected"
    reason: str                 # why rejected, or the binding used
    nodes: int = 0              # size of the region that was tried last
    where: str = ""             # innermost user frame of the anchor, when dynamo recorded one


@dataclass
class GraphReport:
    index: int
    nodes_before: int
    nodes_after: int = 0
    front_door_calls: int = 0   # qla ops already in the graph (from dynamo substitutions)
    regions: list[RegionReport] = field(default_factory=list)
    short_convs: int = 0        # depthwise conv1d calls rewritten as shifted multiply-adds
    causal_masks: int = 0       # attention calls given is_causal=True for a materialised causal mask
    masks_kept: list[str] = field(default_factory=list)  # attention masks left as they are because of inputs
    pass_seconds: float = 0.0
    compile_seconds: float = 0.0

    @property
    def fused_calls(self) -> int:
        return self.front_door_calls + sum(r.status == "replaced" for r in self.regions)

    def summary(self) -> str:
        lines = [f"graph {self.index}: {self.nodes_before} -> {self.nodes_after} nodes, "
                 f"{self.front_door_calls} qla op(s) from the front door, "
                 f"{sum(r.status == 'replaced' for r in self.regions)} region(s) fused by the FX pass, "
                 f"{self.short_convs} short convolution(s) as shifted multiply-adds, "
                 f"{self.causal_masks} attention call(s) on a causal mask as is_causal; "
                 f"pass {self.pass_seconds:.3f} s of {self.compile_seconds:.3f} s compile"]
        for r in self.regions:
            where = f" [{r.where}]" if r.where else ""
            lines.append(f"  region at {r.anchor}{where}: {r.status} ({r.nodes} nodes): {r.reason}")
        lines += [f"  attention mask kept at {kept}" for kept in self.masks_kept]
        return "\n".join(lines)
