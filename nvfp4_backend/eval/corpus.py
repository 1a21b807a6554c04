"""The default evaluation text: English prose from the Python standard library's docstrings.

It is available offline on every machine that runs Python, with no download and no data file.
What it is, exactly (``stdlib_prose()``):

1. The modules in ``MODULES`` are imported in that order (a module that fails to import on this
   platform is skipped and listed in the metadata).
2. From each module: the module docstring, then, for every public name in ``sorted(vars(module))``
   that is a class or function *defined in that module* (``__module__`` matches), its docstring,
   and for a class the docstrings of its public methods and properties defined in that module
   (so methods other packages patch in are ignored), also in sorted order.  Raw ``__doc__``
   strings only (``inspect.cleandoc``), no inherited ones.
3. Each docstring is split into paragraphs at blank lines.  A paragraph is kept when it reads as
   prose: at least ``MIN_WORDS`` words, no line that looks like code (doctest prompts, indented
   blocks, reST directives/tables), and at least 90% of its characters letters, spaces or common
   punctuation.  Lines inside a paragraph are joined with single spaces.
4. Exact duplicate paragraphs are dropped (first occurrence wins); paragraphs are joined with
   blank lines.

The text depends on the Python version (docstrings change between releases), so the eval
records the Python version, the character count and a SHA-256 of the text next to its numbers.
Under ``python -OO`` docstrings are stripped and the text is empty: ``stdlib_prose`` then raises.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import sys
import warnings
from dataclasses import dataclass

MODULES = (
    "argparse", "asyncio", "bisect", "calendar", "cmd", "codecs", "collections", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "doctest", "email.message", "enum", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client", "http.cookiejar", "http.server",
    "imaplib", "inspect", "ipaddress", "json", "locale", "logging", "logging.handlers", "mailbox",
    "multiprocessing.pool", "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle",
    "pkgutil", "platform", "poplib", "pprint", "pydoc", "queue", "random", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "types", "typing", "unittest.case", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "webbrowser", "xml.dom.minidom", "zipfile",
)
"""Modules read, in this order."""

MIN_WORDS = 12
_PROSE_CHARS = re.compile(r"[A-Za-z \t\n.,;:'\"()\-?!]")
_CODE_LINE = re.compile(r"^(\s{2,}\S|>>>|\.\.\. |\.\. |[=\-~^*+#|]{3,}|\$ |%)")


@dataclass(frozen=True)
class Corpus:
    text: str
    modules: tuple[str, ...]
    skipped_modules: tuple[str, ...]
    paragraphs: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def metadata(self) -> dict:
        return {"name": "stdlib-docstring-prose", "python": sys.version.split()[0], "chars": len(self.text),
                "paragraphs": self.paragraphs, "sha256": self.sha256, "modules_read": len(self.modules),
                "modules_skipped": list(self.skipped_modules)}


def _docstrings(module) -> list[str]:
    out = [module.__doc__]
    name = module.__name__
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        obj = vars(module)[attr]
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) or getattr(obj, "__module__", None) != name:
            continue
        out.append(obj.__doc__)
        if inspect.isclass(obj):
            for meth in sorted(vars(obj)):
                if meth.startswith("_"):
                    continue
                member = vars(obj)[meth]
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                func = member.fget if isinstance(member, property) else member
                # only methods defined in this module (other packages monkeypatch stdlib classes)
                if inspect.isfunction(func) and getattr(func, "__module__", None) == name:
                    out.append(member.__doc__)
    return [d for d in out if isinstance(d, str) and d.strip()]


def is_prose(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    if any(_CODE_LINE.match(line) for line in lines):
        return False
    flat = " ".join(line.strip() for line in lines)
    if len(flat.split()) < MIN_WORDS:
        return False
    prose = len(_PROSE_CHARS.findall(flat))
    return prose >= 0.9 * len(flat)


def stdlib_prose(modules: tuple[str, ...] = MODULES) -> Corpus:
    """The default evaluation text (see the module docstring for exactly what it is)."""
    seen: set[str] = set()
    paragraphs: list[str] = []
    read, skipped = [], []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception:  # not on this platform (e.g. a missing C extension): say so in the metadata
            skipped.append(name)
            continue
        read.append(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. typing.io's deprecation warning on attribute access
            docs = _docstrings(module)
        for doc in docs:
            for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
                if not is_prose(para):
                    continue
                flat = " ".join(line.strip() for line in para.splitlines())
                if flat not in seen:
                    seen.add(flat)
                    paragraphs.append(flat)
    text = "\n\n".join(paragraphs)
    if not text:
        raise RuntimeError("the standard library has no docstrings here (python -OO?): pass --text-file")
    return Corpus(text, tuple(read), tuple(skipped), len(paragraphs))
