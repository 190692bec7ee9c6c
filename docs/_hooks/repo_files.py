"""MkDocs hook: the docs link to the repository's own files, and include some of its Markdown.

Pages are written to read well on GitHub too, so they link to repository files by relative path
(``../examples/train_plain.py``). MkDocs only knows the files under ``docs/``; this hook

- expands ``--8<-- "path"`` lines (a path from the repository root, optionally followed by ``+N`` to
  demote the included headings by N levels): ``ARCHITECTURE.md``, ``benchmarks/README.md`` and the
  deploy READMEs are shown in the site without being copied, and their relative links are rebased
  onto the page that includes them;
- copies every repository file a page links to into the site under ``_source/`` (a folder gets a
  generated listing page) and points the link there, so the built site has no dangling link;
- logs a warning for a link to a repository path that does not exist, which fails
  ``mkdocs build --strict``.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.repo_files")

INCLUDE = re.compile(r'^--8<-- "([^"]+)"(?: \+(\d))?[ \t]*$', re.M)
LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
SOURCE = "_source"
INCLUDED: dict[Path, Path] = {}
"""Each included repository file -> the docs page that includes it (filled by :func:`on_files`)."""


def _roots(config) -> tuple[Path, Path]:
    docs = Path(config["docs_dir"]).resolve()
    return docs, docs.parent


def _outside_fences(text: str, change) -> str:
    """``change`` applied to every stretch of ``text`` outside its code fences."""
    pieces, last = [], 0
    for fence in FENCE.finditer(text):
        pieces += [change(text[last:fence.start()]), fence.group(0)]
        last = fence.end()
    return "".join(pieces + [change(text[last:])])


def _demote(text: str, levels: int) -> str:
    """Move every heading outside code fences down by ``levels``."""
    prefix = "#" * levels
    heading = re.compile(r"^#{1,5} ", re.M)
    return _outside_fences(text, lambda part: heading.sub(lambda m: prefix + m.group(0), part))


def _relink(text: str, source: Path, page: Path, docs: Path, repo: Path,
            found: dict[Path, str]) -> str:
    """Rewrite the relative links of ``text``, written in file ``source``, for the page ``page``.

    A target under ``docs/`` is left for MkDocs to check; one elsewhere in the repository is noted
    in ``found`` (absolute path -> its path in the site) and pointed there.
    """
    def fix(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve()
        if resolved in INCLUDED:
            resolved = INCLUDED[resolved]
        if resolved.is_relative_to(docs):
            new = os.path.relpath(resolved, page.parent)
        elif not resolved.is_relative_to(repo) or not resolved.exists():
            log.warning("%s links to %s, which is not in the repository",
                        page.relative_to(docs), target)
            return match.group(0)
        else:
            rel = resolved.relative_to(repo).as_posix()
            site = f"{SOURCE}/{rel}" + ("/index.md" if resolved.is_dir() else "")
            found[resolved] = site
            new = os.path.relpath(docs / site, page.parent)
        new = Path(new).as_posix() + ("#" + anchor if anchor else "")
        return match.group(1) + new + match.group(3)

    return _outside_fences(text, lambda part: LINK.sub(fix, part))


def _expand(text: str, page: Path, docs: Path, repo: Path, found: dict[Path, str]) -> str:
    """The page's Markdown, its includes expanded and every relative link pointed into the site."""
    out, last = [], 0
    for match in INCLUDE.finditer(text):
        out.append(_relink(text[last:match.start()], page, page, docs, repo, found))
        included = repo / match.group(1)
        if not included.is_file():
            log.warning("%s includes %s, which is not in the repository",
                        page.relative_to(docs), match.group(1))
            body = ""
        else:
            body = _relink(included.read_text(), included, page, docs, repo, found)
        out.append(_demote(body, int(match.group(2) or 0)))
        last = match.end()
    out.append(_relink(text[last:], page, page, docs, repo, found))
    return "".join(out)


def _listing(folder: Path, repo: Path, found: dict[Path, str]) -> str:
    """A generated page listing a linked folder's files (each copied into the site beside it)."""
    rel = folder.relative_to(repo).as_posix()
    lines = [f"# `{rel}/`", ""]
    for child in sorted(p for p in folder.iterdir() if p.is_file()):
        found.setdefault(child, f"{SOURCE}/{rel}/{child.name}")
        lines.append(f"- [`{child.name}`]({child.name})")
    return "\n".join(lines) + "\n"


def on_files(files: Files, config) -> Files:
    """Add the repository files that any page links to (and its includes link to) to the site."""
    docs, repo = _roots(config)
    found: dict[Path, str] = {}
    pages = [Path(file.abs_src_path) for file in files.documentation_pages()]
    INCLUDED.clear()
    for page in pages:
        for match in INCLUDE.finditer(page.read_text()):
            INCLUDED[(repo / match.group(1)).resolve()] = page
    for page in pages:
        _expand(page.read_text(), page, docs, repo, found)
    added: set[str] = set()
    pending = dict(found)
    while pending:
        path, site = pending.popitem()
        if site in added:
            continue
        added.add(site)
        if path.is_dir():
            more: dict[Path, str] = {}
            files.append(File.generated(config, site, content=_listing(path, repo, more)))
            pending.update({p: s for p, s in more.items() if s not in added})
        else:
            files.append(File.generated(config, site, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Expand includes and point repository links into the site."""
    docs, repo = _roots(config)
    if page.file.abs_src_path is None or not Path(page.file.abs_src_path).is_relative_to(docs):
        return markdown
    return _expand(markdown, Path(page.file.abs_src_path), docs, repo, {})
