"""The HTML report in a real browser: headless Chromium loads the file, runs its script, draws.

Chromium comes from Debian's packages (`make browser`). Without it these tests
skip, except under CI (``CI`` set), where a missing browser is a failure: the
CI must install it. ``COMMSPAN_SCREENSHOTS_DIR=docs/images`` (``make
screenshots``) also stores the screenshots the documentation shows (report.png,
timeline.png, findings.png).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from _example_run import RANKS, example_run
from _report_dom import status, tree_counts

from commspan.analysis.timeline import build_timeline, load_records, match_collectives
from commspan.render.html import write_html_report

STEPS = 3
LONG_STEPS = 100
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
]

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def chromium() -> str:
    """Path of Debian's chromium; skip (fail under CI) when it is not installed."""
    found = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None
    )
    if found is None:
        message = "chromium is not installed: run `make browser` (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install it before the tests")
        pytest.skip(message)
    return found


def run_chromium(
    chromium: str, url: str, profile: Path, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [chromium, *FLAGS, f"--user-data-dir={profile}", *args, url],
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def dump_dom(chromium: str, page: Path, fragment: str, profile: Path) -> str:
    """The document after its scripts ran, as Chromium serialises it."""
    return run_chromium(chromium, page.as_uri() + fragment, profile, "--dump-dom").stdout


def screenshot(chromium: str, page: Path, fragment: str, profile: Path, out: Path,
               size: tuple[int, int]) -> Path:
    run_chromium(chromium, page.as_uri() + fragment, profile,
                 f"--window-size={size[0]},{size[1]}", f"--screenshot={out}")
    return out


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    run = example_run(tmp_path_factory, STEPS)
    out = tmp_path_factory.mktemp("report") / "report.html"
    write_html_report(run, out)
    return run, out


def test_report_draws_the_timeline_in_chromium(
    chromium: str, report: tuple[Path, Path], tmp_path: Path
) -> None:
    """Chromium runs the page's script: every span and collective of step 0 becomes a rect."""
    run, page = report
    dom = dump_dom(chromium, page, "", tmp_path / "profile")
    timeline = build_timeline(load_records(run))
    drawn = status(dom)
    assert drawn["data-step"] == "step 0"
    assert int(drawn["data-spans"]) == sum(1 for s in timeline.slices if s.window == 0) > 0
    assert int(drawn["data-collectives"]) == sum(1 for c in timeline.collectives if c.window == 0)
    linked = [m for m in match_collectives(timeline.collectives).values() if m[0].window == 0]
    assert int(drawn["data-links"]) == len(linked) > 0
    svg = dom.split('<svg id="cs-svg"', 1)[1].split("</svg>", 1)[0]
    assert svg.count('<rect class="span ph-') == int(drawn["data-spans"])
    assert svg.count('<polyline class="link"') == len(linked)
    assert "data-load-ms" in drawn
    # the module tree survives the round trip with its names and counts
    shown = tree_counts(dom)
    assert "Transformer.layers.1.feed_forward.w2" in shown.modules
    assert shown.counts["Transformer.layers.1.attention.wo"]["recompute"] == {
        "all_reduce": str(STEPS)
    }
    assert f"{len(timeline.steps)} steps (0-{STEPS - 1})" in dom


def test_step_and_finding_from_the_url(
    chromium: str, report: tuple[Path, Path], tmp_path: Path
) -> None:
    """#step=N draws step N; #finding=I marks that finding's collective on every rank."""
    run, _ = report
    timeline = build_timeline(load_records(run))
    target = next(m for m in match_collectives(timeline.collectives).values() if m[0].window == 2)
    finding = {"kind": "mismatch", "group": target[0].group, "seq": target[0].seq, "step": 2,
               "ranks": {c.rank: {"op": c.op, "fqn": c.fqn} for c in target},
               "message": "example finding"}
    page = write_html_report(run, tmp_path / "with-finding.html", findings=[finding])
    dom = dump_dom(chromium, page, "#step=2&finding=0", tmp_path / "profile")
    assert status(dom)["data-step"] == "step 2"
    assert dom.count('class="coll marked"') == RANKS
    assert 'class="finding active"' in dom
    dom = dump_dom(chromium, page, "#view=timeline", tmp_path / "profile")
    assert 'class="only-timeline"' in dom and status(dom)["data-step"] == "step 0"
    # a malformed escape (a link cut short) is ignored: the page still draws (it threw)
    dom = dump_dom(chromium, page, "#step=%E0%A4%A", tmp_path / "profile")
    assert status(dom)["data-step"] == "step 0"


def test_a_hang_findings_link_outlines_the_stuck_collective(
    chromium: str, tmp_path: Path
) -> None:
    """A hang: ranks 0, 2, 3 wait in an all_reduce inside spans never written, which
    only their hang records list. The finding's link outlines it on those three ranks
    (nothing was outlined: the timeline did not read hang records)."""
    from test_analysis_check import hang_scenario

    from commspan.analysis import build_run, check

    records = hang_scenario(rank1_record=True).spans()
    findings = check(build_run(records)).to_dict()["findings"]
    assert [f["kind"] for f in findings] == ["hang"]
    page = write_html_report(records, tmp_path / "hang.html", findings=findings)
    dom = dump_dom(chromium, page, f"#step={findings[0]['step']}&finding=0",
                   tmp_path / "profile")
    assert dom.count('class="coll marked"') == 3


def test_screenshots(chromium: str, report: tuple[Path, Path], tmp_path: Path) -> None:
    """The report and its timeline render to screenshots of the requested size."""
    _, page = report
    shots = {
        "report.png": screenshot(chromium, page, "", tmp_path / "p1", tmp_path / "report.png",
                                 (1400, 1500)),
        "timeline.png": screenshot(chromium, page, "#view=timeline&step=1", tmp_path / "p2",
                                   tmp_path / "timeline.png", (1400, 900)),
    }
    for path in shots.values():
        assert png_size(path) == (1400, 1500) or png_size(path) == (1400, 900)
        assert path.stat().st_size > 20_000  # drawn, not blank
    keep = os.environ.get("COMMSPAN_SCREENSHOTS_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for name, path in shots.items():
            shutil.copyfile(path, Path(keep) / name)


@pytest.fixture(scope="module")
def hang_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of examples/hang_and_straggler.py's hang (4 gloo ranks; rank 1 never
    issues an all_reduce), with the findings of ``commspan check``."""
    from commspan.analysis import check_run

    out = tmp_path_factory.mktemp("hang-example")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parent.parent / "examples"
                             / "hang_and_straggler.py"), "--only", "hang", "--out", str(out)],
        capture_output=True, text=True, timeout=400, env=env, cwd=out, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    findings = check_run(out / "hang").to_dict()
    assert [f["kind"] for f in findings["findings"]] == ["hang"]
    return write_html_report(out / "hang", out / "hang.html", findings=findings)


def test_screenshots_of_findings(chromium: str, hang_report: Path, tmp_path: Path) -> None:
    """The hang's finding, drawn: each rank's part in `commspan check`'s words (the
    rank that never issued the all_reduce, the others waiting in it), in rank order;
    its screenshot (docs/images/findings.png) shows the page's top: header and
    findings."""
    dom = dump_dom(chromium, hang_report, "", tmp_path / "profile")
    section = dom.split('id="findings"', 1)[1].split("</section>", 1)[0]
    assert re.findall(r"<th>rank (\d+)</th>", section) == ["0", "1", "2", "3"]
    assert "state not issued" in section and "waited_ns" not in section
    assert re.search(r"<th>rank 0</th><td>all_reduce  in `Net.blocks.2` forward  seq 9  "
                     r"state issued  waited \d", section), section[:2000]
    shot = screenshot(chromium, hang_report, "", tmp_path / "p1", tmp_path / "findings.png",
                      (1400, 900))
    assert png_size(shot) == (1400, 900) and shot.stat().st_size > 20_000
    keep = os.environ.get("COMMSPAN_SCREENSHOTS_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, Path(keep) / "findings.png")


def test_hundred_step_report_size_and_load(
    chromium: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A 4-rank, 100-step run of the example: the report stays small and draws any step."""
    run = example_run(tmp_path_factory, LONG_STEPS)
    page = write_html_report(run, tmp_path / "report-100.html", step=LONG_STEPS - 1)
    size = page.stat().st_size
    jsonl = sum(p.stat().st_size for p in run.glob("*.jsonl"))
    dom = dump_dom(chromium, page, "", tmp_path / "profile")
    drawn = status(dom)
    print(f"\n100-step report: {size / 1e6:.2f} MB (JSONL {jsonl / 1e6:.1f} MB), "
          f"page load {drawn.get('data-load-ms')} ms, step drawn in {drawn['data-draw-ms']} ms")
    assert drawn["data-step"] == f"step {LONG_STEPS - 1}"
    assert int(drawn["data-spans"]) > 0
    assert dom.count("<option") >= LONG_STEPS  # every step can be chosen
    assert size < 5_000_000  # measured 0.83 MB: 100 steps x 4 ranks stay a small file


HOVER_PROBE = """<script>
window.hoverErrors = [];
window.addEventListener("error", function (e) { window.hoverErrors.push(String(e.message)); });
setTimeout(function () {
  var svg = document.getElementById("cs-svg"), tip = document.getElementById("cs-tip");
  var res = {tips: 0, lit: [], errors: window.hoverErrors};
  Array.prototype.forEach.call(svg.querySelectorAll("rect.coll"), function (el) {
    tip.hidden = true;
    var r = el.getBoundingClientRect();
    try {
      el.dispatchEvent(new MouseEvent("mousemove",
        {bubbles: true, clientX: r.x + 1, clientY: r.y + 1}));
    } catch (e) { res.errors.push(String(e)); }
    if (!tip.hidden) res.tips++;
    res.lit.push(svg.querySelectorAll("rect.coll.hl").length);
    svg.dispatchEvent(new MouseEvent("mouseleave"));
  });
  var out = document.createElement("pre");
  out.id = "hover-result";
  out.textContent = JSON.stringify(res);
  document.body.appendChild(out);
}, 300);
</script></body>"""


@pytest.mark.parametrize("group", ["plain", "tp\\dim", "line\nbreak", 'q"uote'])
def test_hovering_a_collective_lights_it_on_every_rank_whatever_its_group_name(
    chromium: str, tmp_path: Path, group: str
) -> None:
    """Two ranks all-reduce twice on a group whose name holds a backslash, a newline or
    a quote: hovering each mark shows its tooltip and lights the marks of the
    collective on both ranks (a backslash lit none, a newline threw a SyntaxError)."""
    import json
    import re

    from _analysis_builder import SpanBuilder

    b = SpanBuilder(2)
    for r in range(2):
        s = b.rank(r, 0)
        for _ in range(2):
            s.coll("all_reduce", fqn="Net", group=group, ranks=[0, 1])
    records = b.spans()
    marks = sum(1 for r in records for _, a in r.events if "commspan.collective.op" in a)
    page = write_html_report(records, tmp_path / "report.html")
    page.write_text(page.read_text("utf-8").replace("</body>", HOVER_PROBE), "utf-8")
    dom = run_chromium(chromium, page.as_uri(), tmp_path / "profile",
                       "--virtual-time-budget=3000", "--dump-dom").stdout
    found = re.search(r'<pre id="hover-result">([^<]*)</pre>', dom)
    assert found, dom[-2000:]
    res = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert res["errors"] == []
    assert res["tips"] == marks > 0
    assert res["lit"] == [2] * marks  # this collective, on each of the 2 ranks


TREE_PROBE = """<script>
window.treeErrors = [];
window.addEventListener("error", function (e) { window.treeErrors.push(String(e.message)); });
setTimeout(function () {
  document.querySelector('button[data-tree="open"]').click();
  var all = document.querySelectorAll("#modules details"), open = 0;
  Array.prototype.forEach.call(all, function (d) { if (d.open) open++; });
  var rows = document.querySelectorAll("#modules [data-fqn]");
  var last = rows[rows.length - 1].getBoundingClientRect();
  var out = document.createElement("pre");
  out.id = "tree-result";
  out.textContent = JSON.stringify({errors: window.treeErrors, details: all.length,
    open: open, rows: rows.length, width: last.width, height: last.height});
  document.body.appendChild(out);
}, 300);
</script></body>"""


def test_a_model_1000_modules_deep_keeps_its_tree_in_chromium(
    chromium: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`commspan html` of a model 1000 modules deep (nn.Sequential in nn.Sequential ...):
    the CLI writes the page, and Chromium keeps the module tree as the page nests it
    (its HTML parser nests at most 512 elements: the modules past about 500 levels were
    moved side by side, each row under the wrong module). Rows past the nesting the
    page keeps are listed in order, flat, each saying its depth (checked against the
    module names: `Sequential.0.0` is 3 deep); 'expand all' opens every module without
    a script error, and the deepest row is laid out."""
    import json
    import re
    import sys

    import torch
    from _report_dom import tree_nesting
    from torch import nn

    from commspan import CommSpanMode
    from commspan.cli import main
    from commspan.exporters import JsonlSpanExporter

    depth = 1000
    run = tmp_path / "run"
    model: nn.Module = nn.Linear(2, 2)
    for _ in range(depth - 1):
        model = nn.Sequential(model)
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(8 * depth)  # the model itself needs it, traced or not
    try:
        mode = CommSpanMode(exporters=[JsonlSpanExporter(run)])
        with mode, mode.step(0):
            model(torch.randn(1, 2, requires_grad=True)).sum().backward()
        mode.shutdown()
    finally:
        sys.setrecursionlimit(before)
    page = tmp_path / "deep.html"
    assert main(["html", str(run), "-o", str(page)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    written = tree_nesting(page.read_text("utf-8"))
    names = ["Global"] + ["Sequential" + ".0" * i for i in range(depth)]
    assert sorted(written.levels) == sorted(names)
    # each flat row's depth is its module's: Global 0, Sequential 1, Sequential.0 2, ...
    assert written.depths and all(d == names.index(f) for f, d in written.depths.items())
    assert max(written.levels.values()) < 100  # (the parsers' limits are 200 and more)
    for fqn, level in written.levels.items():  # nested to the limit, flat after it
        assert fqn in written.depths or level == names.index(fqn), fqn

    page.write_text(page.read_text("utf-8").replace("</body>", TREE_PROBE), "utf-8")
    dom = run_chromium(chromium, page.as_uri(), tmp_path / "profile",
                       "--virtual-time-budget=5000", "--dump-dom").stdout
    shown = tree_nesting(dom.split('<pre id="tree-result">', 1)[0])
    assert shown.levels == written.levels  # the browser kept the page's nesting
    assert shown.depths == written.depths
    found = re.search(r'<pre id="tree-result">([^<]*)</pre>', dom)
    assert found, dom[-2000:]
    res = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert res["errors"] == []
    assert res["open"] == res["details"] > 0 and res["rows"] == depth + 1
    assert res["width"] > 0 and res["height"] > 0
    assert status(dom)["data-step"] == "step 0"
