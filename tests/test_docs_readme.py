"""The README as a front page: its commands run as written, its links lead somewhere.

Every command of its ``sh`` blocks is either run here, in order, or listed in :data:`NOT_RUN`
with the test that covers it instead: ``crosskd pipeline submit`` reaches FakeKfpApi
(``tests/kfp_fake.py``) through ``$KFP_HOST``, ``crosskd job manifests`` runs on a copy of
``manifests/``. Every relative link names a file of the checkout and, with a ``#``, a heading
of it (as the code host makes anchors: lower case, punctuation dropped, spaces to hyphens).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import doc_commands as doc
import yaml
from kfp_fake import FakeKfpApi

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
NOT_RUN = {
    "make demo": "the 9-minute demo; tests/test_pipeline.py runs the same pipeline under kfp.local",
    "make test": "this suite",
    "kubectl apply -k manifests/overlays/gpu-1x8 -n ml": "needs a cluster; tests/test_manifests.py "
    "builds every overlay with kubectl kustomize and validates it against the CRD schemas",
    "kubectl apply -k manifests/monitoring -n ml": "needs a cluster; "
    "tests/test_monitoring_manifests.py builds and validates it",
}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_command_runs_as_written_or_is_covered_elsewhere(tmp_path):
    lines = [c for _, b in doc.blocks(README, "sh") for c in doc.commands(b)]
    assert [c for c in lines if not c.startswith("crosskd ")] == list(NOT_RUN)
    inspect, compile_, submit, manifests = (c for c in lines if c.startswith("crosskd "))
    tree = tmp_path / "repo"
    shutil.copytree(ROOT / "manifests", tree / "manifests")
    home = tmp_path / "home"  # the kfp client keeps its context under ~/.config
    env = doc.env(HOME=str(home), KF_PIPELINES_SA_TOKEN_PATH=str(tmp_path / "no-token"))
    env.pop("KFP_TOKEN", None)

    assert inspect.startswith("crosskd inspect pair ")
    report = doc.run(inspect, tree, env).stdout
    assert "Common vocabulary" in report and "Chunk shapes" in report

    assert compile_.startswith("crosskd pipeline compile ")
    doc.run(compile_, tree, env)
    package = next(yaml.safe_load_all((tree / "distill.yaml").read_text()))
    assert {"steps", "teachers"} <= set(package["root"]["inputDefinitions"]["parameters"])

    assert submit.startswith("crosskd pipeline submit ")
    with FakeKfpApi() as fake:
        done = doc.run(submit, tree, {**env, "KFP_HOST": fake.host})
        assert fake.errors == []
        (run,) = fake.requests_to("POST", "/runs")
    parameters = run.body["runtime_config"]["parameters"]
    assert parameters["steps"] == 2000
    assert parameters["teachers"] == ["s3://bucket/models/Qwen3-8B"]
    assert fake.host in done.stdout  # the run's URL

    assert manifests == "crosskd job manifests"
    before = {p: p.read_bytes() for p in (tree / "manifests").rglob("*") if p.is_file()}
    doc.run(manifests, tree, env)
    assert {p: p.read_bytes() for p in before} == before  # the committed files are fresh


def test_links_lead_to_files_and_headings_of_the_checkout():
    links = LINK.findall(README)
    assert len(links) >= 10
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        assert target.is_file(), link
        if anchor:
            text = doc.BLOCK.sub("", target.read_text(encoding="utf-8"))  # no code comments
            headings = re.findall(r"^#+ (.+)$", text, re.M)
            assert anchor in {_anchor(h) for h in headings}, link


def test_the_readme_stays_a_front_page():
    assert README.startswith("# crosskd\n\n```sh\nmake demo")
    assert README.split("```")[1].count("\n") == 3  # the two commands, first
    assert len(README.splitlines()) <= 250


def _anchor(heading: str) -> str:
    """The anchor the code host gives a heading: lower case, every character that is not a
    letter, digit, space, hyphen or underscore dropped, spaces to hyphens."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")
