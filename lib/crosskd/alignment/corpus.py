"""A mixed benchmark corpus built at run time from text already on the machine.

:func:`benchmark_corpus` returns about ``target_bytes`` bytes (UTF-8) of documents of a few KB
each, from three deterministic streams, interleaved round robin (one document of each in turn,
so any prefix of the list is mixed):

* **code**: Python standard-library sources (``*.py`` under ``sysconfig.get_paths()["stdlib"]``,
  ``site-packages`` and caches excluded), windows of whole lines from the start of each file;
* **prose**: the docstrings of those files (module, class, function; via :mod:`ast`), one
  after another;
* **translations**: non-English message catalogues of the system and of installed packages
  (``*.mo`` read with :class:`gettext.GNUTranslations`, ``*.po`` by their ``msgstr`` lines)
  under ``/usr/share/locale``, ``/usr/local/share/locale``, ``/usr/share/i18n`` and the
  site-packages folders; English locales are skipped; a document is a run of messages of one
  language, and languages take turns, the most translated first.

For an out-of-domain held-out set, :func:`licence_documents` returns text of another kind: the
licence texts of ``/usr/share/common-licenses`` (legal English prose, absent from the streams
above).

Files are visited in an order fixed by a hash of their path (spread over the whole stdlib and
every language rather than the alphabetically first few), so the corpus is the same on every run
on one machine. Every document is NFC-normalised, as data preparation does before any tokenizer
sees text (spec section 2). A stream with no sources is skipped with a warning, and the sources
found are logged. Units: bytes are UTF-8 bytes of the text.
"""

from __future__ import annotations

import ast
import gettext
import hashlib
import itertools
import logging
import re
import sysconfig
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

from crosskd.errors import DataError

log = logging.getLogger(__name__)

CATALOGUE_ROOTS = ("/usr/share/locale", "/usr/local/share/locale", "/usr/share/i18n")
LICENCES = Path("/usr/share/common-licenses")
"""Debian's licence texts (package ``base-files``): the out-of-domain text."""
STDLIB_TEXTS = "machine:stdlib"
"""The data reference that means this machine's Python standard-library text
(:func:`benchmark_corpus`), in ``TransplantConfig.tune_data``."""
LICENCE_TEXTS = "machine:licences"
"""The data reference that means this machine's licence texts (:func:`licence_documents`), in
``RunConfig.ood_data`` and ``TransplantConfig.heldout``."""
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def benchmark_corpus(target_bytes: int = 1_000_000, *, document_bytes: int = 4096) -> list[str]:
    """About ``target_bytes`` UTF-8 bytes of mixed documents (module docstring), each at most
    about ``document_bytes`` bytes; stops at the first document that reaches the target."""
    sources = _stdlib_files()
    streams = {
        "code": _stdlib_code(sources, document_bytes),
        "prose": _stdlib_docstrings(sources, document_bytes),
        "translations": _catalogue_documents(document_bytes),
    }
    documents: list[str] = []
    counts = dict.fromkeys(streams, 0)
    sizes = dict.fromkeys(streams, 0)
    total = 0
    active = dict(streams)
    while active and total < target_bytes:
        for name, stream in list(active.items()):
            document = next(stream, None)
            if document is None:
                del active[name]
                continue
            size = len(document.encode("utf-8"))
            documents.append(document)
            counts[name] += 1
            sizes[name] += size
            total += size
            if total >= target_bytes:
                break
    for name in streams:
        if counts[name] == 0:
            log.warning("benchmark corpus: no %s documents found on this machine", name)
    log.info(
        "benchmark corpus: %d documents, %d bytes (%s)",
        len(documents),
        total,
        ", ".join(f"{name} {counts[name]} docs / {sizes[name]} B" for name in streams),
    )
    return documents


def licence_documents(
    target_bytes: int, *, document_bytes: int = 4096, folder: Path = LICENCES
) -> list[str]:
    """About ``target_bytes`` UTF-8 bytes of the licence texts under ``folder`` (files in name
    order, symbolic links skipped), in NFC documents of whole lines of at most about
    ``document_bytes`` bytes; stops at the first document that reaches the target. A missing
    or empty ``folder`` is a :class:`crosskd.errors.DataError`."""
    files = (
        sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink())
        if folder.is_dir()
        else []
    )
    if not files:
        raise DataError(
            f"{folder}: no licence texts there (Debian's base-files installs "
            f"them); give ood_data as a file of rows instead."
        )
    lines = (
        line
        for path in files
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines(True)
    )
    documents, total = [], 0
    for document in _windows(lines, document_bytes):
        if not document.strip():
            continue
        documents.append(document)
        total += len(document.encode("utf-8"))
        if total >= target_bytes:
            break
    log.info(
        "licence texts: %d documents, %d bytes from %d files", len(documents), total, len(files)
    )
    return documents


def _stable_order(paths: Iterable[Path]) -> list[Path]:
    """Paths ordered by a hash of their string (deterministic, spread over folders)."""
    return sorted(paths, key=lambda p: hashlib.sha1(str(p).encode()).hexdigest())


def docstring_paragraphs(min_chars: int, max_chars: int) -> Iterator[str]:
    """The first paragraph of every standard-library docstring (the corpus's stable file
    order), whitespace runs made single spaces, NFC, kept when it has ``min_chars`` to
    ``max_chars`` characters; each distinct paragraph once."""
    seen: set[str] = set()
    for doc in _docstrings(_stdlib_files()):
        paragraph = unicodedata.normalize("NFC", " ".join(doc.split("\n\n")[0].split()))
        if min_chars <= len(paragraph) <= max_chars and paragraph not in seen:
            seen.add(paragraph)
            yield paragraph


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.parts)]
    log.info("benchmark corpus: %d Python sources under %s", len(files), root)
    return _stable_order(files)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _windows(pieces: Iterable[str], document_bytes: int) -> Iterator[str]:
    """Join consecutive pieces into documents of at most about ``document_bytes`` bytes."""
    current: list[str] = []
    size = 0
    for piece in pieces:
        piece_size = len(piece.encode("utf-8"))
        if current and size + piece_size > document_bytes:
            yield unicodedata.normalize("NFC", "".join(current))
            current, size = [], 0
        current.append(piece)
        size += piece_size
    if current:
        yield unicodedata.normalize("NFC", "".join(current))


def _stdlib_code(sources: list[Path], document_bytes: int) -> Iterator[str]:
    """The first window of whole lines of each stdlib source."""
    for path in sources:
        text = _read_text(path)
        if text and text.strip():
            yield next(_windows(text.splitlines(keepends=True), document_bytes))


def _stdlib_docstrings(sources: list[Path], document_bytes: int) -> Iterator[str]:
    """The docstrings of the stdlib sources, one after another, in windows."""
    return _windows((doc + "\n\n" for doc in _docstrings(sources)), document_bytes)


def _docstrings(sources: list[Path]) -> Iterator[str]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for path in sources:
        text = _read_text(path)
        if not text:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
        yield from (doc for doc in docs if doc and len(doc) > 40)


def _catalogue_files() -> dict[str, list[Path]]:
    """Non-English ``.mo``/``.po`` files by language, each list in stable order."""
    roots = [Path(r) for r in CATALOGUE_ROOTS]
    paths = sysconfig.get_paths()
    roots += [Path(paths[key]) for key in ("purelib", "platlib")]
    by_language: dict[str, list[Path]] = {}
    seen: set[Path] = set()
    for root in roots:
        if not root.is_dir() or root in seen:
            continue
        seen.add(root)
        for path in itertools.chain(root.rglob("*.mo"), root.rglob("*.po")):
            language = _language_of(path)
            if language is not None and not language.startswith("en"):
                by_language.setdefault(language, []).append(path)
    found = sum(len(v) for v in by_language.values())
    log.info(
        "benchmark corpus: %d translation catalogues in %d languages under %s",
        found,
        len(by_language),
        ", ".join(str(r) for r in sorted(seen)) or "(no folder found)",
    )
    return {lang: _stable_order(files) for lang, files in sorted(by_language.items())}


def _language_of(path: Path) -> str | None:
    """``de`` for ``.../de/LC_MESSAGES/x.mo`` or ``.../de.po``; None when unclear."""
    if path.parent.name == "LC_MESSAGES":
        return path.parent.parent.name.split(".")[0].split("@")[0]
    stem = path.stem.split(".")[0]
    return stem if re.fullmatch(r"[a-z]{2,3}(_[A-Z]{2})?", stem) else None


def _catalogue_messages(path: Path) -> list[str]:
    """The translated strings of one catalogue (empty when it cannot be read)."""
    try:
        if path.suffix == ".mo":
            with path.open("rb") as handle:
                translations = gettext.GNUTranslations(handle)
            # GNUTranslations keeps the parsed catalogue in ``_catalog``: msgid -> msgstr.
            catalog = getattr(translations, "_catalog", {})
            return [v for k, v in catalog.items() if k and isinstance(v, str) and v.strip()]
        return _po_messages(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, LookupError):
        return []


def _po_messages(text: str) -> list[str]:
    """The translated strings of a ``.po`` file: every ``msgstr`` / ``msgstr[k]`` of an entry
    with a non-empty ``msgid`` (the header's is empty), continuation lines joined and escapes
    undone."""
    entries: list[tuple[list[str], list[str]]] = []  # (msgid pieces, msgstr strings)
    field = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("msgid "):
            entries.append(([], []))
            field, line = "id", line[len("msgid ") :]
        elif line.startswith("msgstr") and entries:
            entries[-1][1].append("")
            field, line = "str", line.partition(" ")[2]
        elif not line.startswith('"'):
            field = None
        if field is None or not (line.startswith('"') and line.endswith('"') and len(line) > 1):
            continue
        value = line[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
        if field == "id":
            entries[-1][0].append(value)
        else:
            entries[-1][1][-1] += value
    return [m for msgid, strs in entries if "".join(msgid) for m in strs if m.strip()]


def _catalogue_documents(document_bytes: int) -> Iterator[str]:
    """Windows of each language's messages; languages take turns, the language with the most
    catalogues first (ties by name)."""
    by_language = _catalogue_files()
    order = sorted(by_language, key=lambda lang: (-len(by_language[lang]), lang))
    queues = [_windows(_language_messages(by_language[lang]), document_bytes) for lang in order]
    while queues:
        remaining = []
        for queue in queues:
            document = next(queue, None)
            if document is not None:
                yield document
                remaining.append(queue)
        queues = remaining


def _language_messages(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield from (message + "\n" for message in _catalogue_messages(path))
