"""Which devices a collective in HLO text talks to (its replica groups, in every form XLA prints), and
which mesh axes those groups span."""

from __future__ import annotations

import math
import re


def balanced_end(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def replica_groups(attrs: str, devices: int) -> list[list[int]]:
    """The device groups of a collective's attributes, as lists of partition ids, in every form XLA
    prints: explicit `{{0,1,2,3},{4,5,6,7}}`; iota `[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)` (ids
    arange(prod(dims)).reshape(dims).transpose(perm).reshape(groups, size)); mesh
    `mesh['data'=2,'fsdp'=4] {'fsdp'}` (row-major over the named axes, a sub-axis written
    `'x':(pre)size`); a collective-permute's `source_target_pairs`, each pair a group; `{}` or
    absent: one group of every device."""
    import numpy as np

    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = [int(d) for d in m.group(1).split(",")]
        ids = np.arange(math.prod(int(d) for d in m.group(2).split(","))).reshape(
            [int(d) for d in m.group(2).split(",")]
        )
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))}
        # split every axis into (before, sub, after) so a sub-axis is one dimension of the grid
        dims, names = [], []
        picked = {
            a: (int(pre) if pre else 1, int(sub) if sub else None)
            for a, pre, sub in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", m.group(2))
        }
        for axis, n in sizes.items():
            pre, sub = picked.get(axis, (1, None))
            sub = n // pre if sub is None else sub
            for part, size in (("pre", pre), ("in", sub), ("post", n // (pre * sub))):
                dims.append(size)
                names.append(axis in picked and part == "in")
        ids = np.arange(math.prod(dims)).reshape(dims)
        inner = [i for i, keep in enumerate(names) if keep]
        outer = [i for i, keep in enumerate(names) if not keep]
        return ids.transpose(outer + inner).reshape(-1, math.prod(dims[i] for i in inner) if inner else 1).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{\{", attrs)
    if m:
        body = attrs[m.end() - 2 : balanced_end(attrs, m.end() - 2)]
        return [[int(d) for d in g.split(",") if d.strip()] for g in re.findall(r"\{([^{}]*)\}", body)]
    return [list(range(devices))]


def axes_spanned(groups: list[list[int]], mesh_shape: dict[str, int]) -> str:
    """The mesh axes a collective's groups span: the axes along which the devices of a group differ,
    in mesh order, joined by "+" ("fsdp", "data", "data+fsdp"); "none" when no group has two devices.
    Partition id i sits at row-major position i of the mesh's device grid (`mesh.devices.flat[i]`)."""
    import numpy as np

    names, sizes = list(mesh_shape), list(mesh_shape.values())
    spanned = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group) % math.prod(sizes), sizes)).T
        spanned |= {names[a] for a in range(len(names)) if len(set(coords[:, a].tolist())) > 1}
    return "+".join(n for n in names if n in spanned) or "none"
