"""Griffe extension for the docs build: read distopt's Sphinx-flavoured docstrings.

distopt's docstrings are Google style, but cross-references use Sphinx
roles (``:class:`~distopt.errors.BackendUnavailableError```, ``:meth:`flush```)
and a few module constants are documented with ``#:`` comments. mkdocstrings
renders Markdown and knows neither, so this extension (loaded from
``mkdocs.yml``; the source files are read, never imported):

* turns each role into an *optional* autorefs link: a link when the target
  is rendered somewhere in the reference, plain code otherwise, never a
  build warning. Relative targets (``flush``, ``BACKENDS``) are resolved in
  the scope of the object whose docstring holds them; ``~`` keeps only the
  last component as the text, as in Sphinx;
* makes the ``#:`` comment block above a module or class attribute its
  docstring, when it has none;
* rewrites reStructuredText "simple tables" (columns under runs of ``=``)
  as Markdown tables, and ``.. [1]`` footnotes as plain ``[1]`` notes.
"""
from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|attr|mod|data|exc|obj|const):`(?P<target>[^`]+)`")


def _resolve(obj: Any, target: str) -> str | None:
    """Full path of ``target`` as seen from ``obj``'s docstring, or None."""
    if target.startswith("distopt."):
        return target
    head, _, rest = target.partition(".")
    scope = obj
    while scope is not None:
        try:
            path = scope.resolve(head)
        except (griffe.NameResolutionError, Exception):  # noqa: BLE001 - any failure: try the parent scope
            path = None
        if path:
            return f"{path}.{rest}" if rest else path
        scope = scope.parent
    return None


def _link(obj: Any, match: re.Match) -> str:
    target = match["target"].strip()
    short = target.startswith("~")
    target = target.lstrip("~")
    text = target.rsplit(".", 1)[-1] if short else target
    if match["role"] in ("func", "meth"):
        text += "()"
    path = _resolve(obj, target)
    code = f"<code>{html.escape(text)}</code>"
    if path is None:
        return code
    return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'


_RULE = re.compile(r"^(?P<indent>\s*)=+(?: +=+)+\s*$")


def _columns(rule: str) -> list[int]:
    """Start offsets of the ``=`` runs of a simple-table rule line."""
    return [m.start() for m in re.finditer(r"=+", rule)]


def _rst_tables(text: str) -> str:
    """Rewrite reStructuredText simple tables as Markdown pipe tables."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not _RULE.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        starts = _columns(lines[i])
        rows: list[list[str]] = []
        rules = 1
        j = i + 1
        while j < len(lines) and rules < 3:
            if _RULE.match(lines[j]):
                rules += 1
            elif lines[j].strip():
                cells = [lines[j][a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
                rows.append([re.sub(r"\[(\w+)\]_", r"[\1]", c) for c in cells])
            j += 1
        if rules < 3 or not rows:  # not a complete table: leave the text alone
            out.append(lines[i])
            i += 1
            continue
        out.append("| " + " | ".join(rows[0]) + " |")
        out.append("|" + "---|" * len(starts))
        out.extend("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows[1:])
        i = j
    text = "\n".join(out)
    return re.sub(r"^(\s*)\.\. \[(\w+)\]", r"\1[\2]", text, flags=re.M)


def _comment_docstring(attr: Any) -> str | None:
    """The ``#:`` lines right above ``attr``'s assignment, joined, or None."""
    try:
        lines = attr.lines_collection[attr.filepath]
    except Exception:  # noqa: BLE001 - no source: nothing to read
        return None
    i = attr.lineno - 2  # 0-based index of the line above
    found: list[str] = []
    while i >= 0 and lines[i].strip().startswith("#:"):
        found.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    return " ".join(found) or None


class SphinxRoles(griffe.Extension):
    """Convert Sphinx roles to optional autorefs links; ``#:`` comments to docstrings."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:  # noqa: ARG002
        seen: set[int] = set()
        stack: list[Any] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.is_alias or id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.is_attribute and obj.docstring is None:
                text = _comment_docstring(obj)
                if text:
                    obj.docstring = griffe.Docstring(text, parent=obj)
            if obj.docstring is not None:
                value = _ROLE.sub(lambda m, o=obj: _link(o, m), obj.docstring.value)
                obj.docstring.value = _rst_tables(value)
            stack.extend(member for member in obj.members.values() if not member.is_alias)
