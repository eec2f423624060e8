"""Bytes per device by memory space ("device" or "host", `zero.offload`) of a compiled step's
arguments (a state's shards: `zerojax.core.offload.split_bytes`)."""

from __future__ import annotations

import re

from zerojax.accounting.hlo import shape_bytes

ARGUMENT = re.compile(r"\b([a-z][a-z0-9]*\[[\d,]*\])(?:\{([^}]*)\})?")  # dtype[dims]{layout}
HOST_SPACE = "S(5)"  # the layout's memory space of an argument in host memory


def compiled_argument_bytes(compiled) -> dict[str, int]:
    """{"device": bytes, "host": bytes} of the compiled step's per-device arguments, read off the
    entry computation layout of its HLO: an argument in host memory carries memory space S(5).

    XLA:CPU's `memory_analysis()` counts host arguments in `argument_size_in_bytes` and leaves its
    `host_argument_size_in_bytes` at 0, so the layout is where the compiled program says which space
    each argument is in."""
    text = compiled.as_text()
    m = re.search(r"entry_computation_layout=\{\((.*?)\)->", text)
    out = {"device": 0, "host": 0}
    if m is None:
        return out
    for shape, layout in ARGUMENT.findall(m.group(1)):
        out["host" if HOST_SPACE in layout else "device"] += shape_bytes(shape)
    return out
