"""Bytes the collectives of a compiled program move, counted from its HLO text.

Per device, with ring algorithms: an all-gather sends (g-1)/g of its result, a reduce-scatter
(g-1) times its result, an all-reduce 2(g-1)/g of its operand, an all-to-all (g-1)/g of its
result, a collective-permute its whole result; g is the replica-group size. Given the mesh, the
bytes are also split by the mesh axes each collective's replica groups span (`axes_spanned`), so
the share that crosses a slow axis (`data`, between nodes) shows. Collectives inside
while loops count once per iteration, through every level of nesting and every computation a loop
body calls.

Count the HLO right after SPMD partitioning (`zerojax.accounting.partitioned`), not the final compiled HLO:
on CPU a later pass (float-normalization-bf16) upcasts bf16 collectives to f32, so the final
program shows twice the bytes a GPU moves (XLA:GPU's final program keeps them in bf16 and moves the
partitioned program's bytes, combined into fewer collectives: experiments/results/gpu_traffic.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from zerojax.accounting.groups import axes_spanned, balanced_end, replica_groups  # noqa: F401  (re-exported)

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "f4e2m1fn": 4,
    "f8e8m0fnu": 8,
    "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_CALLEE = re.compile(r"\b(to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape, tuples included: 'bf16[8,1024]{1,0}' -> 16384."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.get(dtype, 8 if dtype.startswith("f8") else None)  # the many fp8 variants
        if bits is None:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        numel = math.prod(int(re.sub(r"\D", "", d)) for d in dims.split(",") if d.strip())
        total += numel * bits
    return total // 8


@dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


@dataclass
class _Computation:
    name: str
    entry: bool
    instructions: dict[str, _Instruction] = field(default_factory=dict)
    root: str | None = None


def _split_top(text: str) -> list[str]:
    """Split on commas not nested in brackets."""
    parts: list = []
    depth, cur = 0, []  # type: ignore[var-annotated]
    for ch in text:
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _parse_instruction(line: str) -> _Instruction | None:
    m = _INSTRUCTION.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    end = balanced_end(rest, 0) if rest.startswith("(") else rest.find(" ")
    if end <= 0:
        return None
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = balanced_end(rest, op.end() - 1)
    # Operands print either as `%x` or, in newer XLA, as `f32[8] %x`: keep the last token.
    operands = tuple(o.split()[-1].lstrip("%") for o in _split_top(rest[op.end() : close - 1]))
    return _Instruction(name, shape, op.group(1), operands, rest[close:])


def parse(hlo_text: str) -> tuple[dict[str, _Computation], int]:
    """(the computations by name, each with its instructions; the number of devices)."""
    computations: dict[str, _Computation] = {}
    current = None
    header = hlo_text[: hlo_text.find("\n")] if "\n" in hlo_text else hlo_text
    partitions = re.search(r"num_partitions=(\d+)", header)
    replicas = re.search(r"replica_count=(\d+)", header)
    devices = int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = computations.setdefault(m.group(2), _Computation(m.group(2), bool(m.group(1))))
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instruction(line)
        if instr:
            current.instructions[instr.name] = instr
            if line.lstrip().startswith("ROOT"):
                current.root = instr.name
    return computations, devices


def _constant(comp: _Computation, name: str) -> int | None:
    instr = comp.instructions.get(name)
    if instr is None or instr.opcode != "constant":
        return None
    try:
        return int(instr.operands[0])
    except (ValueError, IndexError):
        return None


def _tuple_index(comp: _Computation, name: str) -> int | None:
    """k when `name` reads element k of a parameter tuple: `get-tuple-element(%p), index=k`, or,
    in the HLO text newer XLA prints (jax >= 0.12), the operand `%p#k` itself."""
    if "#" in name:
        base, k = name.rsplit("#", 1)
        src = comp.instructions.get(base)
        return int(k) if k.isdigit() and src is not None and src.opcode == "parameter" else None
    instr = comp.instructions.get(name)
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    src = comp.instructions.get(instr.operands[0])
    m = re.search(r"\bindex=(\d+)", instr.attrs)
    return int(m.group(1)) if m and src is not None and src.opcode == "parameter" else None


def _trip_count(while_: _Instruction, caller: _Computation, comps: dict[str, _Computation]) -> int | None:
    """known_trip_count when XLA has annotated it (only later passes do); else read the loop
    `for (i = c0; i < N; i += s)` off the condition, the init tuple and the body, the form JAX's
    scan and fori_loop emit. None when the loop has another form."""
    m = _TRIP_COUNT.search(while_.attrs)
    if m:
        return int(m.group(1))
    cond = comps.get(_attr(while_.attrs, "condition") or "")
    body = comps.get(_attr(while_.attrs, "body") or "")
    init = caller.instructions.get(while_.operands[0]) if while_.operands else None
    if not (cond and body and cond.root and body.root and init and init.opcode == "tuple"):
        return None
    cmp = cond.instructions[cond.root]
    direction = re.search(r"direction=(\w+)", cmp.attrs)
    if cmp.opcode != "compare" or not direction or len(cmp.operands) != 2:
        return None
    a, b, op = *cmp.operands, direction.group(1)
    if op in ("GT", "GE"):  # N > i is i < N
        a, b, op = b, a, {"GT": "LT", "GE": "LE"}[op]
    k, bound = _tuple_index(cond, a), _constant(cond, b)
    next_ = body.instructions[body.root]
    if op not in ("LT", "LE") or k is None or bound is None or next_.opcode != "tuple":
        return None
    start = _constant(caller, init.operands[k])
    update = body.instructions.get(next_.operands[k])
    if start is None or update is None or update.opcode != "add":
        return None
    steps = [_constant(body, o) for o in update.operands if _tuple_index(body, o) != k]
    if len(steps) != 1 or not steps[0] or steps[0] < 0:
        return None
    end = bound + (op == "LE")
    return max(0, -(-(end - start) // steps[0]))


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def _multipliers(comps: dict[str, _Computation]) -> tuple[dict[str, int], list[str], set[str]]:
    """How many times each computation runs per execution of the entry, the computations that run
    inside a while loop whose trip count could not be read (their multiplier is a lower bound), and
    those that run as (or inside) a conditional's branch, counted as if their branch always ran."""
    callers: dict[str, list[tuple[str, int, bool]]] = {name: [] for name in comps}
    branches: set[str] = set()
    for comp in comps.values():
        for instr in comp.instructions.values():
            # async-done / -update name the same computation as their async-start: count it once.
            if instr.opcode.endswith(("-done", "-update")):
                continue
            factor, known = 1, True
            if instr.opcode == "while":
                trips = _trip_count(instr, comp, comps)
                factor, known = (1, False) if trips is None else (trips, True)
            names = [n for _, n in _CALLEE.findall(instr.attrs)]
            for group in _CALLEE_LIST.findall(instr.attrs):
                names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
            if instr.opcode == "conditional":
                branches.update(names)
            for callee in names:
                if callee in callers:
                    callers[callee].append((comp.name, factor, known))
    entries = [c.name for c in comps.values() if c.entry] or [n for n, cs in callers.items() if not cs]
    memo: dict[str, tuple[int, bool]] = {n: (1, True) for n in entries}

    def mult(name: str) -> tuple[int, bool]:
        if name not in memo:
            memo[name] = (0, True)  # guards against a malformed cyclic graph
            runs = [(mult(c), f, k) for c, f, k in callers[name]]
            memo[name] = (sum(m * f for (m, _), f, _ in runs), all(ok and k for (_, ok), _, k in runs))
        return memo[name]

    def branched(name: str, seen: frozenset = frozenset()) -> bool:
        return name in branches or any(branched(c, seen | {name}) for c, _, _ in callers[name] if c not in seen)

    results = {name: mult(name) for name in comps}
    inside = {n for n in comps if branched(n)}
    return {n: m for n, (m, _) in results.items()}, [n for n, (_, ok) in results.items() if not ok], inside


def _moved_bytes(instr: _Instruction, devices: int) -> tuple[str, float, list[list[int]]] | None:
    """(kind, bytes each device sends, the device groups) of a collective; None for other ops."""
    opcode = instr.opcode[: -len("-start")] if instr.opcode.endswith("-start") else instr.opcode
    if opcode not in KINDS:
        return None
    result = shape_bytes(_async_result(opcode, instr.shape) if instr.opcode.endswith("-start") else instr.shape)
    groups = replica_groups(instr.attrs, devices)
    if opcode == "collective-permute":  # no pairs: it sends nothing
        return opcode, float(result), [] if "source_target_pairs={}" in instr.attrs else groups
    g = max(len(group) for group in groups)
    factor = {
        "all-gather": (g - 1) / g,
        "reduce-scatter": g - 1,
        "all-reduce": 2 * (g - 1) / g,
        "all-to-all": (g - 1) / g,
    }[opcode]
    return opcode, result * factor, groups


def _async_result(opcode: str, shape: str) -> str:
    """The results of an async collective's `-start` op. Its shape is `(operands, results, [context])`
    (XLA:GPU writes every kind so, all-reduce as `((operands), results)`), except the older
    all-reduce-start, whose shape is its results alone (operand and result shapes are the same)."""
    parts = _split_top(shape[1:-1]) if shape.startswith("(") else [shape]
    if opcode == "all-reduce" and not parts[0].startswith("("):
        return shape
    return parts[1]


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a program."""

    kind: str  # one of KINDS
    name: str
    computation: str
    runs: int  # executions per run of the entry (loop trip counts multiplied; a lower bound if unknown)
    sent: float  # bytes each device sends per execution (a collective-permute: each source)
    groups: list  # device groups (partition ids); a collective-permute's: [source, target] pairs
    known: bool  # False: inside a loop of unreadable trip count, or a conditional's branch not run


def collectives(hlo_text: str, runs: dict[str, int] | None = None) -> list[Collective]:
    """Every collective of the program that runs, with its executions per step and device groups.
    One inside a conditional's branch runs as often as `runs` (executions per step by instruction
    name, `zerojax.accounting.executed`) says; without its name there it is counted as if its
    branch always ran and marked unknown."""
    comps, devices = parse(hlo_text)
    mults, uncertain, branched = _multipliers(comps)
    runs = runs or {}
    found = []
    for comp in comps.values():
        for instr in comp.instructions.values():
            hit = _moved_bytes(instr, devices)
            if not (hit and mults[comp.name]):
                continue
            n, known = mults[comp.name], comp.name not in uncertain
            if comp.name in branched:
                n, known = runs.get(instr.name, n), instr.name in runs
            found.append(Collective(hit[0], instr.name, comp.name, n, hit[1], hit[2], known))
    return found


class UnknownTripCount(ValueError):
    """A collective runs inside a while loop whose trip count the counter cannot read."""


def collective_bytes(
    hlo_text: str, *, mesh=None, allow_unknown_trips: bool = False, runs: dict[str, int] | None = None
) -> dict:
    """{"bytes": {kind: per-device bytes}, "counts": {kind: executions}, "total": bytes,
    "unknown_trip_counts": collectives inside loops of unreadable trip count,
    "by_axis": {axes: bytes}, "by_kind_axis": {kind: {axes: bytes}}, "busiest_link": bytes}.

    Collective-permutes count for the device that sends the most by them (a pipeline's first stage
    sends no gradient back, its last no activation on); "busiest_link" is what they move between
    the pair of devices that exchange the most, both ways: a pipeline's stage boundary.

    `mesh` (a `jax.sharding.Mesh`, or its ordered `{axis: size}`) names the axes each collective's
    replica groups span (`axes_spanned`: "fsdp", "data", "data+fsdp", ...); without it the two
    per-axis maps are empty. A collective inside a loop of unreadable trip count would be counted
    once instead of once per iteration, and one inside a conditional's branch (without `runs`) as if
    its branch always ran, so by default this raises `UnknownTripCount` rather than report a
    total that is silently wrong; `allow_unknown_trips=True` returns it (the conditionals' share an
    upper bound). `runs`: see `collectives`."""
    shape = None if mesh is None else dict(getattr(mesh, "shape", mesh))
    moved = {k: 0.0 for k in KINDS}
    counts = {k: 0 for k in KINDS}
    by_kind_axis: dict[str, dict[str, float]] = {}
    found, unknown = collectives(hlo_text, runs), []
    for c in found:
        counts[c.kind] += c.runs
        if c.kind != "collective-permute":
            moved[c.kind] += c.sent * c.runs
            per = by_kind_axis.setdefault(c.kind, {})
            axes = "" if shape is None else axes_spanned(c.groups, shape)
            per[axes] = per.get(axes, 0.0) + c.sent * c.runs
        if not c.known:
            unknown.append(f"{c.kind} %{c.name} in %{c.computation}")
    if unknown and not allow_unknown_trips:
        raise UnknownTripCount(
            f"cannot count collective bytes: {len(unknown)} collective(s) run inside a while loop whose "
            "trip count this HLO text does not show in a form the counter reads, or inside a conditional "
            f"whose branch runs were not given ({'; '.join(unknown[:3])})"
        )
    busiest, link = _busiest([c for c in found if c.kind == "collective-permute"], shape)
    if busiest:
        moved["collective-permute"] = sum(busiest.values())
        by_kind_axis["collective-permute"] = busiest
    if shape is None:
        by_kind_axis = {}
    by_axis: dict[str, float] = {}
    for per in by_kind_axis.values():
        for axes, sent in per.items():
            by_axis[axes] = by_axis.get(axes, 0.0) + sent
    return {
        "bytes": moved,
        "counts": counts,
        "total": sum(moved.values()),
        "unknown_trip_counts": len(unknown),
        "by_axis": by_axis,
        "by_kind_axis": by_kind_axis,
        "busiest_link": link,
    }


def _busiest(permutes: list[Collective], shape: dict | None) -> tuple[dict[str, float], float]:
    """({axes: bytes} of the device that sends the most by `permutes`, the bytes they move between
    the pair of devices that exchange the most, both ways)."""
    sent: dict[int, dict[str, float]] = {}
    links: dict[frozenset, float] = {}
    for c in permutes:
        axes = "" if shape is None else axes_spanned(c.groups, shape)
        for source, target in (g for g in c.groups if len(g) == 2):
            mine = sent.setdefault(source, {})
            mine[axes] = mine.get(axes, 0.0) + c.sent * c.runs
            links[frozenset((source, target))] = links.get(frozenset((source, target)), 0.0) + c.sent * c.runs
    busiest = max(sent.values(), key=lambda per: sum(per.values()), default={})
    return dict(busiest), max(links.values(), default=0.0)
