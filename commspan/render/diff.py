"""Text of ``commspan diff``: what one run (or step) issues that the other does not.

Pure formatting of a :class:`commspan.analysis.diff.DiffResult` (its JSON form
is its ``to_dict()``). One block per module, one line per phase and op:
``-`` only in A, ``+`` only in B, ``~`` in both with another count, bytes,
placements or groups (``count 1 => 2``, ``groups tp x1 => dp x1``); where a
run uses several mesh dimensions or groups, each line names its own
(``on tp``)::

    --- A: sp-off (run sp-off, rank 0, step 0)
    +++ B: sp-on (run sp-on, rank 0, step 0)
    Transformer.layers.0.attention.wo
    - forward   all_reduce      x1  1,024 B  P(sum)->R
    + forward   reduce_scatter  x1  1,024 B  P(sum)->S(1)
    2 added, 1 removed, 0 changed, 14 same (per step)

Example:
    >>> from commspan.analysis.diff import diff, profile
    >>> print(format_diff(diff(profile([]), profile([])), "A: x", "B: y"))
    --- A: x
    +++ B: y
    no difference: 0 module/phase/op compared (per step)
"""

from __future__ import annotations

from commspan.analysis.diff import ADDED, REMOVED, DiffEntry, DiffResult, Usage
from commspan.render.details import format_bytes

__all__ = ["format_diff"]

_MARK = {ADDED: "+", REMOVED: "-"}


def _usage(u: Usage, where: bool) -> str:
    text = f"x{u.count}  {format_bytes(u.bytes)}"
    if u.placements:
        text += "  " + ", ".join(u.placements)
    if where and u.groups:  # all on one mesh dimension or group: its name alone
        text += "  on " + (u.group_totals[0][0] if len(u.group_totals) == 1
                           else ", ".join(u.groups))
    return text


def _one_group(result: DiffResult) -> bool:
    """Every collective of both sides ran on the same one mesh dimension or group
    (then naming it on each line says nothing)."""
    names = {g for profile in (result.a, result.b) for u in profile.usage.values()
             for g, _ in u.group_totals}
    return len(names) <= 1


def _totals(a: Usage, b: Usage, name: str) -> str:
    """`` (9001 in 9000 steps => 1000 in 1000 steps)`` when the per-step values
    shown are equal after rounding, though the exact ones differ."""
    if getattr(a, name) != getattr(b, name):
        return ""
    return (f" ({getattr(a, 'total_' + name):,} in {a.steps:,} steps => "
            f"{getattr(b, 'total_' + name):,} in {b.steps:,} steps)")


def _change(e: DiffEntry) -> str:
    assert e.a is not None and e.b is not None
    bits = []
    if "count" in e.fields:
        bits.append(f"count {e.a.count} => {e.b.count}{_totals(e.a, e.b, 'count')}")
    if "bytes" in e.fields:
        bits.append(f"bytes {format_bytes(e.a.bytes)} => {format_bytes(e.b.bytes)}"
                    f"{_totals(e.a, e.b, 'bytes')}")
    if "placements" in e.fields:
        bits.append(
            f"placements {', '.join(e.a.placements) or 'none'} => "
            f"{', '.join(e.b.placements) or 'none'}"
        )
    if "groups" in e.fields:
        bits.append(f"groups {', '.join(e.a.groups) or 'none'} => "
                    f"{', '.join(e.b.groups) or 'none'}")
    return "; ".join(bits)


def format_diff(result: DiffResult, a_label: str, b_label: str) -> str:
    """The differences as text, grouped by module; a last line counts them.

    Args:
        result: what :func:`commspan.analysis.diff.diff` returned.
        a_label: what side A is (``"A: runs/old (run 1a2b, steps 0-2)"``).
        b_label: what side B is.
    """
    lines = [f"--- {a_label}", f"+++ {b_label}"]
    if result.equal:
        lines.append(f"no difference: {result.same} module/phase/op compared (per step)")
        return "\n".join(lines)
    where = not _one_group(result)
    width_phase = max(len(e.phase) for e in result.entries)
    width_op = max(len(e.op) for e in result.entries)
    module = None
    for e in result.entries:
        if e.fqn != module:
            module = e.fqn
            lines.append(module)
        head = f"{e.phase:<{width_phase}}  {e.op:<{width_op}}"
        if e.status in _MARK:
            usage = e.b if e.status == ADDED else e.a
            assert usage is not None
            lines.append(f"{_MARK[e.status]} {head}  {_usage(usage, where)}")
        else:
            lines.append(f"~ {head}  {_change(e)}")
    c = result.counts()
    lines.append(
        f"{c['added']} added, {c['removed']} removed, {c['changed']} changed, "
        f"{c['same']} same (per step)"
    )
    return "\n".join(lines)
