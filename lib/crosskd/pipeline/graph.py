"""A picture of a compiled KFP pipeline (``crosskd pipeline graph``): :func:`pipeline_svg`."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import yaml

CHAR, PAD, BOX_H = 8, 12, 30  # monospace 12 px: at most 8 px a character; a task box's height
GAP_X, GAP_Y, LANE = 20, 36, 8  # between the items of a layer; between layers; a passing edge
FRAME, LABEL_H, MARGIN = 12, 24, 16  # a frame's padding and label band; the picture's margin

Shape = tuple[str, str, str, int, int, int, int]
"""``(kind, task name, label, x, y, width, height)``; kind ``task`` or ``loop`` (a frame)."""


@dataclass
class _Block:
    """A laid-out DAG or task: its size, shapes and edges (point lists), from its top left."""

    w: int
    h: int
    shapes: list[Shape] = field(default_factory=list)
    edges: list[list[tuple[int, int]]] = field(default_factory=list)

    def moved(self, dx: int, dy: int) -> _Block:
        return _Block(
            self.w,
            self.h,
            [(k, n, t, x + dx, y + dy, w, h) for k, n, t, x, y, w, h in self.shapes],
            [[(x + dx, y + dy) for x, y in edge] for edge in self.edges],
        )


def pipeline_svg(package: str) -> str:
    """A self-contained SVG of the compiled pipeline ``package`` (KFP YAML; its first document,
    the ``PipelineSpec``): one box per task named as in the spec, a dashed frame per loop
    (``parameterIterator``; any sub-DAG) around its own tasks, labelled ``<name>: for each item
    of <producer or parameter>`` (``, N at a time`` with a parallelism limit), and an arrow per
    ``dependentTasks`` entry (from a loop's frame for a task that depends on the loop).
    Top to bottom in longest-path layers (each task one layer below its latest dependency); an
    edge that skips layers runs down a lane of its own, shared by its source's other long edges.
    The same file gives the same bytes."""
    spec = next(yaml.safe_load_all(Path(package).read_text(encoding="utf-8")))
    body = _layout_dag(spec["root"]["dag"]["tasks"], spec.get("components") or {})
    title = str((spec.get("pipelineInfo") or {}).get("name", Path(package).stem))
    width = max(body.w, len(title) * CHAR) + 2 * MARGIN
    body = body.moved(MARGIN + (width - 2 * MARGIN - body.w) // 2, MARGIN + LABEL_H)
    height = body.h + 2 * MARGIN + LABEL_H
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="12">',
        '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="8" refY="4" '
        'orient="auto" markerUnits="userSpaceOnUse"><path d="M0,0 L8,4 L0,8 z" fill="#555"/>'
        "</marker></defs>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{MARGIN}" y="{MARGIN + 12}" font-weight="bold">{escape(title)}</text>',
    ]
    for kind, name, label, x, y, w, h in body.shapes:
        if kind == "loop":
            out.append(
                f'<g data-loop="{escape(name)}"><rect x="{x}" y="{y}" width="{w}" '
                f'height="{h}" rx="6" fill="#f6f6f0" stroke="#8a8a8a" '
                f'stroke-dasharray="5 3"/><text x="{x + FRAME}" y="{y + 17}" '
                f'fill="#444">{escape(label)}</text></g>'
            )
    out += [
        f'<path d="{_path(edge)}" fill="none" stroke="#555" stroke-width="1.2" '
        f'marker-end="url(#arrow)"/>'
        for edge in body.edges
    ]
    for kind, name, label, x, y, w, h in body.shapes:
        if kind == "task":
            out.append(
                f'<g data-task="{escape(name)}"><rect x="{x}" y="{y}" width="{w}" '
                f'height="{h}" rx="4" fill="#e8f0fa" stroke="#3a6ea5"/><text '
                f'x="{x + w // 2}" y="{y + h // 2 + 4}" text-anchor="middle">'
                f"{escape(label)}</text></g>"
            )
    return "\n".join([*out, "</svg>"]) + "\n"


def _layout_dag(tasks: dict[str, Any], components: dict[str, Any]) -> _Block:
    """Longest-path layers top to bottom; within a layer, items ordered by the mean x of what
    they depend on (then by name) and placed as near it as their widths allow; a source's edges
    that skip a layer share a lane item (a narrow slot) in it."""
    blocks = {name: _layout_task(name, task, components) for name, task in tasks.items()}
    deps = {
        n: sorted(d for d in t.get("dependentTasks") or [] if d in tasks) for n, t in tasks.items()
    }
    layer: dict[str, int] = {}

    def depth(name: str) -> int:
        if name not in layer:
            layer[name] = 1 + max((depth(d) for d in deps[name]), default=-1)
        return layer[name]

    for name in tasks:
        depth(name)
    reach: dict[str, int] = {}  # source -> the deepest layer one of its edges reaches
    for name in tasks:
        for d in deps[name]:
            reach[d] = max(reach.get(d, 0), layer[name])

    def above(source: str, row: int) -> Any:  # the item of ``source``'s edges in row - 1
        return source if layer[source] == row - 1 else (source, row - 1)

    x: dict[Any, int] = {}  # an item's centre; items: a task name, or (source, row) for a lane
    tops, heights, lefts = [0], [], {}
    for row in range(max(layer.values(), default=-1) + 1):
        items: list[Any] = [n for n in tasks if layer[n] == row]
        items += [(s, row) for s in sorted(reach) if layer[s] < row < reach[s]]
        preds = {
            i: [above(i[0], row)] if isinstance(i, tuple) else [above(d, row) for d in deps[i]]
            for i in items
        }
        want = {i: sum(x[p] for p in preds[i]) // len(preds[i]) if preds[i] else 0 for i in items}
        items.sort(key=lambda i: (want[i], isinstance(i, tuple), str(i)))
        size = {i: LANE if isinstance(i, tuple) else blocks[i].w for i in items}
        # each item as near its wanted centre as the others allow: the mean of pushing right
        # from the left and left from the right keeps the gaps and the symmetry
        push, back = [want[i] - size[i] // 2 for i in items], [0] * len(items)
        for k in range(1, len(items)):
            push[k] = max(push[k], push[k - 1] + size[items[k - 1]] + GAP_X)
        for k in range(len(items) - 1, -1, -1):
            back[k] = want[items[k]] - size[items[k]] // 2
            if k + 1 < len(items):
                back[k] = min(back[k], back[k + 1] - size[items[k]] - GAP_X)
        for k, item in enumerate(items):
            lefts[item] = (push[k] + back[k]) // 2
            x[item] = lefts[item] + size[item] // 2
        heights.append(max(blocks[i].h for i in items if not isinstance(i, tuple)))
        tops.append(tops[-1] + heights[-1] + GAP_Y)
    shift = -min(lefts.values(), default=0)
    right = max((lefts[i] + (blocks[i].w if i in blocks else LANE) for i in lefts), default=0)
    out = _Block(right + shift, tops[-1] - GAP_Y if heights else 0)
    for name in tasks:
        inner = blocks[name].moved(lefts[name] + shift, tops[layer[name]])
        out.shapes += inner.shapes
        out.edges += inner.edges
    for name in tasks:  # incoming edges end side by side on the box, in the order they come
        ins = sorted(deps[name], key=lambda d, n=name: (x[above(d, layer[n])], d))
        for k, d in enumerate(ins):
            edge = [(x[d], tops[layer[d]] + blocks[d].h)]
            for row in range(layer[d] + 1, layer[name]):
                edge += [(x[(d, row)], tops[row]), (x[(d, row)], tops[row] + heights[row])]
            port = lefts[name] + (k + 1) * blocks[name].w // (len(ins) + 1)
            out.edges.append([(px + shift, py) for px, py in [*edge, (port, tops[layer[name]])]])
    return out


def _layout_task(name: str, task: dict[str, Any], components: dict[str, Any]) -> _Block:
    """A box for a task; a labelled frame around its laid-out DAG for a loop (or sub-DAG)."""
    component = components.get((task.get("componentRef") or {}).get("name"), {})
    if "dag" not in component:
        w = len(name) * CHAR + 2 * PAD
        return _Block(w, BOX_H, [("task", name, name, 0, 0, w, BOX_H)])
    inner = _layout_dag(component["dag"].get("tasks") or {}, components)
    label = _loop_label(name, task)
    w = max(inner.w, len(label) * CHAR) + 2 * FRAME
    h = LABEL_H + inner.h + FRAME
    inner = inner.moved((w - inner.w) // 2, LABEL_H)
    return _Block(w, h, [("loop", name, label, 0, 0, w, h), *inner.shapes], inner.edges)


def _loop_label(name: str, task: dict[str, Any]) -> str:
    """``<display name>: for each item of <what it iterates>`` (a sub-DAG: its display name)."""
    title = str((task.get("taskInfo") or {}).get("name") or name)
    iterator = task.get("parameterIterator") or task.get("artifactIterator")
    if not iterator:
        return title
    items = iterator.get("items") or {}
    if "raw" in items:
        what = f"of {len(json.loads(items['raw']))} items"
    else:
        key = items.get("inputParameter") or items.get("inputArtifact") or "?"
        inputs = task.get("inputs") or {}
        source = {**(inputs.get("parameters") or {}), **(inputs.get("artifacts") or {})}.get(key)
        producer = (
            (source or {}).get("taskOutputParameter")
            or (source or {}).get("taskOutputArtifact")
            or {}
        )
        what = "item of " + str(
            producer.get("producerTask") or (source or {}).get("componentInputParameter") or key
        ).removeprefix("pipelinechannel--")
    limit = (task.get("iteratorPolicy") or {}).get("parallelismLimit")
    return f"{title}: for each {what}" + (f", {limit} at a time" if limit else "")


def _path(points: list[tuple[int, int]]) -> str:
    """An SVG path through ``points``: straight down where x stays, else an S-curve."""
    d = f"M{points[0][0]},{points[0][1]}"
    for (x1, y1), (x2, y2) in itertools.pairwise(points):
        mid = (y1 + y2) // 2
        d += f" L{x2},{y2}" if x1 == x2 else f" C{x1},{mid} {x2},{mid} {x2},{y2}"
    return d
