"""The training text of `builtin:tiny-story`: English prose that ships with Python itself.

Nothing is downloaded. Three sources, all read from the running interpreter:
- `pydoc_data.topics`: the language reference topics behind `help("assert")` and friends;
- the docstrings of the standard library modules in `MODULES` and of the built-in types;
- the Zen of Python (`this`).

Only prose is kept: headings become titles, indented blocks (code, grammar) are dropped, wrapped
lines are joined, and every character is folded to ASCII. The same text is also cut into chat
turns ("What is the "assert" statement?" -> the topic's first paragraphs) so chat replies look like
answers. Output is deterministic for one Python version (sorted names, no randomness here).

scripts/train_tiny_story.py trains on it; the tests judge the model's readability by its words
(`from pdserve_bench import tiny_story_corpus`).
"""

from __future__ import annotations

import builtins
import codecs
import contextlib
import importlib
import inspect
import io
import re
import unicodedata
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

MODULES = (
    "abc", "argparse", "array", "asyncio", "base64", "bisect", "calendar", "cmath", "codecs", "collections",
    "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "doctest", "email", "enum", "fnmatch", "fractions", "functools", "getopt", "gettext", "glob",
    "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "http.server", "imaplib", "inspect", "io",
    "ipaddress", "itertools", "json", "locale", "logging", "math", "mimetypes", "operator", "os", "os.path",
    "pathlib", "pickle", "platform", "pprint", "queue", "random", "re", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "sqlite3", "statistics", "string", "struct",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "traceback",
    "types", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref",
    "xml.dom.minidom", "zipfile", "zlib",
)
# held back: standard library modules the model never saw, whose docstrings are text to measure it on
# (perplexity, pdserve_bench/fp8_accuracy.py): the same kind of prose, not one sentence of it trained on
HELD_OUT_MODULES = (
    "ast", "bdb", "bz2", "cmd", "code", "codeop", "colorsys", "compileall", "copyreg", "dis", "filecmp",
    "fileinput", "ftplib", "graphlib", "lzma", "netrc", "numbers", "pdb", "pkgutil", "poplib", "pstats",
    "py_compile", "quopri", "reprlib", "runpy", "sysconfig", "tabnanny", "trace", "tracemalloc", "zipapp",
)
BUILTIN_TYPES = (str, bytes, list, tuple, dict, set, frozenset, int, float, complex, range, object, type)
MIN_PARAGRAPH_WORDS = 6
ANSWER_CHARS = 600  # a chat answer: whole paragraphs up to about this many characters


@dataclass(frozen=True)
class Document:
    title: str  # what a user would ask about, e.g. 'the "assert" statement' or "json.dumps"
    kind: str  # "topic" | "function" | "class" | "module" | "zen"
    paragraphs: tuple[str, ...]  # prose, one paragraph per item, no newlines inside


def documents() -> list[Document]:
    """Every prose document of the corpus, in a fixed order."""
    with warnings.catch_warnings():  # reading typing.io/typing.re's docstrings warns of their removal
        warnings.simplefilter("ignore", DeprecationWarning)
        docs = [*topic_documents(), *docstring_documents(), zen_document()]
    return [d for d in docs if d.paragraphs]


def topic_documents() -> list[Document]:
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        lines = to_ascii(topics[key]).splitlines()
        title = lines[0].strip() if lines else key
        out.append(Document(_lower_first(title), "topic", tuple(prose_paragraphs("\n".join(lines[1:])))))
    return out


def held_out_documents() -> list[Document]:
    """Documents of HELD_OUT_MODULES, built as the training ones are, minus any paragraph that also
    appears in the training documents."""
    trained = {p for d in documents() for p in d.paragraphs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        docs = _module_documents(HELD_OUT_MODULES)
    kept = [Document(d.title, d.kind, tuple(p for p in d.paragraphs if p not in trained)) for d in docs]
    return [d for d in kept if d.paragraphs]


def docstring_documents() -> list[Document]:
    out = _module_documents(MODULES)
    for attr in sorted(vars(builtins)):
        obj = getattr(builtins, attr)
        if not attr.startswith("_") and (inspect.isbuiltin(obj) or inspect.isclass(obj)):
            out.append(Document(attr, "class" if inspect.isclass(obj) else "function",
                                tuple(prose_paragraphs(inspect.getdoc(obj)))))
    for cls in BUILTIN_TYPES:
        for attr in sorted(vars(cls)):
            if not attr.startswith("_"):
                doc = inspect.getdoc(getattr(cls, attr))
                out.append(Document(f"{cls.__name__}.{attr}", "function", tuple(prose_paragraphs(doc))))
    return out


def _module_documents(names: tuple[str, ...]) -> list[Document]:
    """Each module's docstring, then those of the classes and functions it defines, in name order."""
    out = []
    for name in names:
        module = importlib.import_module(name)
        out.append(Document(f"the {name} module", "module", tuple(prose_paragraphs(inspect.getdoc(module)))))
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                kind = "class" if inspect.isclass(obj) else "function"
                out.append(Document(f"{name}.{attr}", kind, tuple(prose_paragraphs(inspect.getdoc(obj)))))
    return out


def zen_document() -> Document:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        this = importlib.import_module("this")
    lines = codecs.decode(this.s, "rot13").splitlines()
    return Document("the Zen of Python", "zen", tuple(line.strip() for line in lines[2:] if line.strip()))


def prose_paragraphs(text: str | None) -> Iterator[str]:
    """Paragraphs of running text: blank-line separated, unindented, joined into one line each."""
    for block in re.split(r"\n\s*\n", to_ascii(text or "")):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or any(line.startswith((" ", "\t", ">>>", "*", "-", "+", "|")) for line in lines):
            continue  # code, grammar, tables, lists, doctests
        if all(set(line.strip()) <= set("*=-~^") for line in lines[1:]) and len(lines) <= 2:
            continue  # a heading and its underline
        para = " ".join(line.strip() for line in lines)
        if len(para.split()) >= MIN_PARAGRAPH_WORDS and para[-1] in ".:!?)":
            yield para


def to_ascii(text: str) -> str:
    folded = unicodedata.normalize("NFKD", text.replace("\u2019", "'").replace("\u201c", '"').replace("\u201d", '"'))
    return folded.encode("ascii", "ignore").decode("ascii")


def _lower_first(title: str) -> str:
    return title[:1].lower() + title[1:] if title[:2] != title[:2].upper() else title


# ---- the two shapes of training text -------------------------------------------------------------

QUESTIONS = {
    "topic": ("What is {t}?", "Tell me about {t}.", "Explain {t}.", "How does {t} work?"),
    "module": ("What is {t} for?", "Tell me about {t}.", "What does {t} provide?"),
    "function": ("What does {t} do?", "Explain {t}.", "How do I use {t}?"),
    "class": ("What is {t}?", "What does {t} do?", "Explain {t}."),
    "zen": ("What is {t}?", "Recite {t}.", "What are the principles of Python?"),
}
SYSTEM_PROMPT = "You are a helpful assistant."


def plain_text(doc: Document) -> str:
    """A document as running text: its paragraphs separated by blank lines."""
    return "\n\n".join(doc.paragraphs)


def answer_text(doc: Document) -> str:
    """The first paragraphs of `doc`, whole, up to about ANSWER_CHARS characters (at least one)."""
    kept: list[str] = []
    for para in doc.paragraphs:
        if kept and sum(len(p) for p in kept) + len(para) > ANSWER_CHARS:
            break
        kept.append(para)
    return "\n\n".join(kept) if doc.kind != "zen" else "\n".join(doc.paragraphs)


def chat_conversations(doc: Document) -> list[list[dict[str, str]]]:
    """One conversation per question form of `doc`'s kind; every other one opens with a system turn."""
    out = []
    for i, form in enumerate(QUESTIONS[doc.kind]):
        turns = [{"role": "user", "content": form.format(t=doc.title)},
                 {"role": "assistant", "content": answer_text(doc)}]
        out.append(([{"role": "system", "content": SYSTEM_PROMPT}] if i % 2 else []) + turns)
    return out


def corpus_words(docs: list[Document] | None = None) -> set[str]:
    """The lowercase words of the whole corpus (letters, digits, apostrophes), for readability checks."""
    words: set[str] = set()
    for doc in docs if docs is not None else documents():
        words.update(split_words(doc.title))
        for para in doc.paragraphs:
            words.update(split_words(para))
    for forms in QUESTIONS.values():
        for form in forms:
            words.update(split_words(form))
    return words


def split_words(text: str) -> list[str]:
    """Whitespace-separated words, lowercased, stripped of surrounding punctuation; empty ones dropped."""
    out = []
    for raw in text.split():
        word = raw.strip("\"'`()[]{}<>.,;:!?*").lower()
        if word:
            out.append(word)
    return out
