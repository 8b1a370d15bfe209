"""The pipeline's picture (``crosskd.pipeline.graph``): ``docs/pipeline.svg`` is fresh, names
every task of the compiled spec, and the layering puts a task below what it depends on."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import yaml

from crosskd.pipeline.graph import pipeline_svg

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipelines" / "distill.yaml"
PICTURE = ROOT / "docs" / "pipeline.svg"
SVG = "{http://www.w3.org/2000/svg}"

TINY = """\
pipelineInfo: {name: tiny}
root:
  dag:
    tasks:
      first: {componentRef: {name: comp-first}, taskInfo: {name: first}}
      for-loop-1:
        componentRef: {name: comp-for-loop-1}
        dependentTasks: [first]
        inputs:
          parameters:
            pipelinechannel--first-Output:
              taskOutputParameter: {outputParameterKey: Output, producerTask: first}
        parameterIterator:
          itemInput: pipelinechannel--first-Output-loop-item
          items: {inputParameter: pipelinechannel--first-Output}
        taskInfo: {name: each}
      last: {componentRef: {name: comp-last}, dependentTasks: [for-loop-1],
             taskInfo: {name: last}}
components:
  comp-first: {executorLabel: exec-first}
  comp-body: {executorLabel: exec-body}
  comp-last: {executorLabel: exec-last}
  comp-for-loop-1:
    dag:
      tasks:
        body: {componentRef: {name: comp-body}, taskInfo: {name: body}}
"""


def _boxes(svg: str) -> dict[str, tuple[int, int, int, int]]:
    """``task name`` or ``loop:<task name>`` -> its rect's (x, y, width, height)."""
    boxes = {}
    for group in ET.fromstring(svg).iter(f"{SVG}g"):
        name = group.get("data-task") or f"loop:{group.get('data-loop')}"
        rect = group.find(f"{SVG}rect")
        assert rect is not None
        boxes[name] = tuple(int(rect.get(k)) for k in ("x", "y", "width", "height"))
    return boxes


def _spec_tasks(spec: dict[str, Any], dag: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(executor task names, loop task names) of ``dag`` and the DAGs inside it."""
    tasks, loops = set(), set()
    for name, task in dag["tasks"].items():
        component = spec["components"][task["componentRef"]["name"]]
        if "dag" in component:
            loops.add(name)
            inner_tasks, inner_loops = _spec_tasks(spec, component["dag"])
            tasks |= inner_tasks
            loops |= inner_loops
        else:
            tasks.add(name)
    return tasks, loops


def test_docs_picture_is_fresh() -> None:
    assert PICTURE.read_text(encoding="utf-8") == pipeline_svg(str(PACKAGE)), (
        "docs/pipeline.svg is stale (pipelines/distill.yaml changed); regenerate it with: "
        "crosskd pipeline graph"
    )


def test_picture_parses_and_names_every_task() -> None:
    svg = pipeline_svg(str(PACKAGE))
    spec = next(yaml.safe_load_all(PACKAGE.read_text(encoding="utf-8")))
    tasks, loops = _spec_tasks(spec, spec["root"]["dag"])
    assert {"validate-inputs", "build-tables", "score-teacher", "train", "report"} <= tasks
    assert len(loops) == 3
    root = ET.fromstring(svg)
    texts = {t.text for t in root.iter(f"{SVG}text")}
    assert tasks <= texts
    boxes = _boxes(svg)
    assert set(boxes) == tasks | {f"loop:{name}" for name in loops}
    labels = [
        t.text for g in root.iter(f"{SVG}g") if g.get("data-loop") for t in g.iter(f"{SVG}text")
    ]
    assert "teachers: for each item of plan-tables" in labels
    assert svg == pipeline_svg(str(PACKAGE))  # byte-identical on every call


def test_layers_of_a_tiny_spec(tmp_path: Path) -> None:
    package = tmp_path / "tiny.yaml"
    package.write_text(TINY, encoding="utf-8")
    svg = pipeline_svg(str(package))
    # By hand (CHAR 8, PAD 12, BOX_H 30, GAP_Y 36, FRAME 12, LABEL_H 24, MARGIN 16): boxes are
    # 8 * len(name) + 24 wide: first 64, body 56, last 56. The frame's label "each: for each
    # item of first" (28 characters, 224 px) is wider than body: 224 + 2 * 12 = 248 wide,
    # 24 + 30 + 12 = 66 high. Layers: first 0, the loop 1, last 2; rows start at 0, 30 + 36 = 66,
    # 66 + 66 + 36 = 168, all centred on x = 124 (half the frame); the picture is 248 + 32 = 280
    # wide and starts 16 + 24 = 40 down (the title's band), 16 in.
    assert _boxes(svg) == {
        "first": (16 + 124 - 32, 40, 64, 30),
        "loop:for-loop-1": (16, 40 + 66, 248, 66),
        "body": (16 + (248 - 56) // 2, 40 + 66 + 24, 56, 30),
        "last": (16 + 124 - 28, 40 + 168, 56, 30),
    }
    root = ET.fromstring(svg)
    assert (root.get("width"), root.get("height")) == ("280", str(40 + 168 + 30 + 16))
    paths = [p.get("d") for p in root.iter(f"{SVG}path") if p.get("marker-end")]
    assert paths == ["M140,70 L140,106", "M140,172 L140,208"]  # first -> loop -> last
    label = next(t.text for t in root.iter(f"{SVG}text") if t.text and "for each" in t.text)
    assert label == "each: for each item of first"
    first, loop, last = (_boxes(svg)[n] for n in ("first", "loop:for-loop-1", "last"))
    assert first[1] + first[3] < loop[1] and loop[1] + loop[3] < last[1]
