"""Read back what the HTML report shows: module counts, the timeline status, embedded data."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from typing import Any


class TreeCounts(HTMLParser):
    """``counts[fqn][phase][op]``: the text of each count in the module tree's lines."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, dict[str, dict[str, str]]] = {}
        self.modules: list[str] = []
        self._fqn: str | None = None
        self._phase: str | None = None
        self._op: str | None = None
        self._spans: list[str] = []  # role of each open span
        self._capture = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in ("details", "div") and a.get("data-fqn") and self._in_tree:
            self._fqn = a["data-fqn"]
            self.modules.append(self._fqn)
            self.counts.setdefault(self._fqn, {})
        if tag == "div" and a.get("class") == "tree":
            self._in_tree = True
        if tag != "span":
            return
        role = ""
        if a.get("data-phase") is not None:
            role, self._phase = "phase", a["data-phase"]
        elif a.get("data-op") is not None and self._phase is not None:
            role, self._op = "op", a["data-op"]
        elif "n" in (a.get("class") or "").split() and self._op is not None:
            role, self._capture = "n", True
        self._spans.append(role)

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self._in_tree = False
        if tag != "span" or not self._spans:
            return
        role = self._spans.pop()
        if role == "phase":
            self._phase = None
        elif role == "op":
            self._op = None
        elif role == "n":
            self._capture = False

    def handle_data(self, data: str) -> None:
        if self._capture and self._fqn and self._phase and self._op:
            slot = self.counts[self._fqn].setdefault(self._phase, {})
            slot[self._op] = slot.get(self._op, "") + data

    _in_tree = False


def tree_counts(page: str) -> TreeCounts:
    """Parse the module tree of a report page (as written, or as a browser dumped it)."""
    parser = TreeCounts()
    parser.feed(page)
    return parser


def embedded_data(page: str) -> dict[str, Any]:
    """The timeline data the page embeds."""
    found = re.search(r'<script type="application/json" id="cs-data">(.*?)</script>', page, re.S)
    assert found, "no embedded data"
    return json.loads(found.group(1))


def status(dom: str) -> dict[str, str]:
    """Attributes of the timeline's status element, written by the page's script."""
    found = re.search(r"<output id=\"cs-status\"([^>]*)>", dom)
    assert found, "no status element"
    return dict(re.findall(r'([\w-]+)="([^"]*)"', found.group(1)))


class TreeNesting(HTMLParser):
    """``levels[fqn]``: how many ``<details>`` of the module tree hold each module's row
    (as the document nests its elements, which a browser's parser may change), and
    ``depths[fqn]``: the nesting depth a row shown flat says (``data-depth``)."""

    def __init__(self) -> None:
        super().__init__()
        self.levels: dict[str, int] = {}
        self.depths: dict[str, int] = {}
        self._open = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        fqn = a.get("data-fqn")
        if fqn is not None and tag in ("details", "div"):
            assert fqn not in self.levels, f"{fqn} twice"
            self.levels[fqn] = self._open
            if a.get("data-depth") is not None:
                self.depths[fqn] = int(a["data-depth"] or 0)
        if tag == "details":
            self._open += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "details":
            self._open -= 1


def tree_nesting(page: str) -> TreeNesting:
    """The nesting of the module tree of a report page (as written, or as dumped)."""
    parser = TreeNesting()
    parser.feed(page)
    return parser
