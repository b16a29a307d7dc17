/* commspan HTML report: draws the timeline of one step as SVG from the embedded JSON.
   No library, no network. The data format is described in commspan/render/html.py
   (_timeline_data). URL hash: #step=N selects step N, #finding=I marks finding I's
   collective, #view=timeline shows the timeline alone. */
"use strict";
(function () {
  var status = document.getElementById("cs-status");
  var D = JSON.parse(document.getElementById("cs-data").textContent);
  var S = D.strings, TICK = D.tick_ns;
  var svg = document.getElementById("cs-svg");
  var scroller = document.getElementById("cs-scroll");
  var stepSel = document.getElementById("cs-step");
  var zoomSel = document.getElementById("cs-zoom");
  var info = document.getElementById("cs-stepinfo");
  var tip = document.getElementById("cs-tip");
  var GUTTER = 70, ROW = 18, COLL = 16, GAP = 10, AXIS = 24, PAD = 4;
  var items = [];
  var marked = null;
  var current = -1;

  Array.prototype.forEach.call(document.querySelectorAll("button[data-tree]"), function (b) {
    b.addEventListener("click", function () {
      var open = b.getAttribute("data-tree") === "open";
      Array.prototype.forEach.call(document.querySelectorAll("#modules details"), function (d) {
        d.open = open;
      });
    });
  });

  function esc(text) {
    return String(text).replace(/[&<>"]/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c];
    });
  }
  function fmtDur(ns) {
    if (ns < 1e3) return ns.toFixed(0) + " ns";
    if (ns < 1e6) return (ns / 1e3).toFixed(1) + " \u00b5s";
    if (ns < 1e9) return (ns / 1e6).toFixed(2) + " ms";
    return (ns / 1e9).toFixed(2) + " s";
  }
  function fmtBytes(b) {
    var units = ["B", "KiB", "MiB", "GiB"], i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
    return (i ? b.toFixed(1) : b.toFixed(0)) + " " + units[i];
  }
  function shortName(fqn) {
    var p = fqn.split("."), n = p[p.length - 1];
    if (p.length > 1 && /^\d+$/.test(n)) n = p[p.length - 2] + "." + n;
    return n;
  }
  function niceTick(ns) {
    var base = Math.pow(10, Math.floor(Math.log10(Math.max(ns, 1))));
    var steps = [1, 2, 5, 10];
    for (var i = 0; i < steps.length; i++) if (base * steps[i] >= ns) return base * steps[i];
    return base * 10;
  }
  function fmt(n) { return n.toFixed(1); }
  function fmtAxis(ns, stepNs) {
    var units = [[1e9, "s"], [1e6, "ms"], [1e3, "\u00b5s"], [1, "ns"]], u = units[3];
    for (var i = 0; i < units.length; i++) if (stepNs >= units[i][0]) { u = units[i]; break; }
    var digits = Math.max(0, -Math.floor(Math.log10(stepNs / u[0]) + 1e-9));
    return ns === 0 ? "0" : (ns / u[0]).toFixed(digits) + " " + u[1];
  }

  function draw(index) {
    var began = performance.now();
    current = index;
    var st = D.steps[index];
    stepSel.value = String(index);
    var width = Math.max(640, scroller.clientWidth - 2) * Number(zoomSel.value);
    var plotW = width - GUTTER - 12;
    var scale = plotW / Math.max(st.d, 1);
    var x = function (t) { return GUTTER + t * scale; };
    var back = [], out = [], grid = [], linkPts = {}, y = AXIS, nSpans = 0, nColls = 0;
    items = [];
    st.r.forEach(function (rk) {
      var rank = rk[0], rows = Math.max(rk[3], 1), sp = rk[4], co = rk[5];
      var bandH = PAD + rows * ROW + COLL + PAD;
      back.push('<rect class="band" x="0" y="' + y + '" width="' + width + '" height="' + bandH + '"/>');
      back.push('<rect class="extent" x="' + fmt(x(rk[1])) + '" y="' + (y + 1) + '" width="' +
        fmt(Math.max((rk[2] - rk[1]) * scale, 1)) + '" height="' + (bandH - 2) + '"/>');
      back.push('<text class="rank" x="10" y="' + (y + bandH / 2 + 4) + '">rank ' + rank + "</text>");
      for (var k = 0; k < sp.length; k += 5) {
        var fqn = S[sp[k]], ph = S[sp[k + 1]], ts = sp[k + 2], du = sp[k + 3], row = sp[k + 4];
        var rx = x(ts), rw = Math.max(du * scale, 1), ry = y + PAD + row * ROW;
        var id = items.length;
        items.push({ kind: "span", fqn: fqn, phase: ph, ts: ts, du: du, rank: rank });
        out.push('<rect class="span ph-' + esc(ph) + '" data-i="' + id + '" x="' + fmt(rx) +
          '" y="' + ry + '" width="' + fmt(rw) + '" height="' + (ROW - 2) + '"/>');
        nSpans++;
        if (rw > 28) {
          var name = shortName(fqn), fit = Math.floor((rw - 6) / 6.3);
          if (name.length > fit) name = name.slice(0, Math.max(fit - 1, 1)) + "\u2026";
          out.push('<text class="label" x="' + fmt(rx + 3) + '" y="' + (ry + 12) +
            '" pointer-events="none">' + esc(name) + "</text>");
        }
      }
      var cy = y + PAD + rows * ROW + 2;
      for (k = 0; k < co.length; k += 9) {
        var grp = S[co[k + 3]], seq = co[k + 4], ct = co[k + 6], cd = co[k + 7];
        var cx = x(ct), cw = cd >= 0 ? Math.max(cd * scale, 3) : 3;
        var key = grp + "#" + seq;
        var cid = items.length;
        items.push({ kind: "coll", op: S[co[k]], fqn: S[co[k + 1]], phase: S[co[k + 2]],
          group: grp, seq: seq, bytes: co[k + 5], ts: ct, du: cd, details: S[co[k + 8]], rank: rank });
        var cls = "coll";
        if (marked && marked.group === grp && marked.seq === seq) cls += " marked";
        var left = cd >= 0 ? cx : cx - 1.5;
        out.push('<rect class="' + cls + '" data-i="' + cid + '" data-k="' + esc(key) + '" x="' +
          fmt(left) + '" y="' + cy + '" width="' + fmt(cw) + '" height="' + (COLL - 4) + '"/>');
        nColls++;
        if (seq >= 0) (linkPts[key] = linkPts[key] || []).push(fmt(left + cw / 2) + "," + (cy + (COLL - 4) / 2));
      }
      y += bandH + GAP;
    });
    var height = y - GAP + 4;
    var step = niceTick((st.d * TICK) / Math.max(plotW / 110, 1)) / TICK;
    for (var t = 0; t <= st.d; t += step) {
      var gx = fmt(x(t));
      grid.push('<line class="grid" x1="' + gx + '" x2="' + gx + '" y1="' + (AXIS - 6) + '" y2="' + height + '"/>');
      grid.push('<text class="axis" x="' + gx + '" y="' + (AXIS - 9) + '" text-anchor="middle">' +
        fmtAxis(t * TICK, step * TICK) + "</text>");
    }
    var links = [];
    for (var lk in linkPts) {
      if (linkPts[lk].length > 1) {
        links.push('<polyline class="link" data-k="' + esc(lk) + '" points="' + linkPts[lk].join(" ") + '"/>');
      }
    }
    svg.setAttribute("width", String(width));
    svg.setAttribute("height", String(height));
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    // back to front: rank bands, time grid, links between ranks, spans and collectives
    svg.innerHTML = back.join("") + grid.join("") + links.join("") + out.join("");
    info.textContent = st.r.length + " ranks \u00b7 " + fmtDur(st.d * TICK) + " \u00b7 " +
      nSpans + " module spans \u00b7 " + nColls + " collectives" +
      (D.durations ? "" : " \u00b7 collective durations not recorded: marks show issue times");
    status.setAttribute("data-step", st.l);
    status.setAttribute("data-spans", String(svg.querySelectorAll("rect.span").length));
    status.setAttribute("data-collectives", String(svg.querySelectorAll("rect.coll").length));
    status.setAttribute("data-links", String(links.length));
    status.setAttribute("data-draw-ms", (performance.now() - began).toFixed(1));
    status.textContent = "drawn " + st.l;
  }

  function describe(it) {
    if (it.kind === "span") {
      return it.fqn + "\n" + it.phase + " \u00b7 rank " + it.rank + "\nstart " +
        fmtDur(it.ts * TICK) + " \u00b7 duration " + fmtDur(it.du * TICK);
    }
    return it.op + " \u00b7 group " + it.group + " \u00b7 seq " + it.seq + " \u00b7 rank " + it.rank +
      "\n" + fmtBytes(it.bytes) + (it.details ? " \u00b7 " + it.details : "") +
      "\nissued by " + it.fqn + " (" + it.phase + ")\nat " + fmtDur(it.ts * TICK) +
      (it.du >= 0 ? " \u00b7 duration " + fmtDur(it.du * TICK) : " \u00b7 duration not recorded");
  }
  function highlight(key, on) {
    // the key holds a group name, any text (a backslash, a newline): compared as is,
    // never put in a selector
    Array.prototype.forEach.call(svg.querySelectorAll("[data-k]"), function (el) {
      if (el.getAttribute("data-k") === key) el.classList.toggle("hl", on);
    });
  }
  var lastKey = null;
  svg.addEventListener("mousemove", function (ev) {
    var el = ev.target.closest ? ev.target.closest("[data-i]") : null;
    var key = el ? el.getAttribute("data-k") : null;
    if (key !== lastKey) {
      if (lastKey) highlight(lastKey, false);
      if (key) highlight(key, true);
      lastKey = key;
    }
    if (!el) { tip.hidden = true; return; }
    tip.textContent = describe(items[Number(el.getAttribute("data-i"))]);
    tip.hidden = false;
    var left = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    tip.style.left = left + "px";
    tip.style.top = (ev.clientY + 16) + "px";
  });
  svg.addEventListener("mouseleave", function () {
    tip.hidden = true;
    if (lastKey) highlight(lastKey, false);
    lastKey = null;
  });

  function fromHash() {
    var params = {};
    location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var i = kv.indexOf("=");
      if (i <= 0) return;
      try {
        params[decodeURIComponent(kv.slice(0, i))] = decodeURIComponent(kv.slice(i + 1));
      } catch (e) {  // a malformed escape (a link cut short): that parameter is ignored
      }
    });
    document.body.classList.toggle("only-timeline", params.view === "timeline");
    marked = null;
    Array.prototype.forEach.call(document.querySelectorAll("tr.finding"), function (tr, i) {
      tr.classList.toggle("active", params.finding === String(i));
    });
    if (params.finding !== undefined) {
      D.findings.forEach(function (f) {
        if (String(f.i) === params.finding) marked = { group: f.group, seq: f.seq };
      });
    }
    var index = -1;
    if (params.step !== undefined) {
      D.steps.forEach(function (s, i) { if (String(s.s) === params.step && index < 0) index = i; });
    }
    return index;
  }

  if (!D.steps.length) {
    info.textContent = "no step recorded";
    status.setAttribute("data-spans", "0");
    return;
  }
  D.steps.forEach(function (s, i) {
    var o = document.createElement("option");
    o.value = String(i);
    o.textContent = s.l + " \u00b7 " + fmtDur(s.d * TICK);
    stepSel.appendChild(o);
  });
  stepSel.addEventListener("change", function () { draw(Number(stepSel.value)); });
  zoomSel.addEventListener("change", function () { draw(current); });
  function go(delta) {
    var next = current + delta;
    if (next >= 0 && next < D.steps.length) draw(next);
  }
  document.getElementById("cs-prev").addEventListener("click", function () { go(-1); });
  document.getElementById("cs-next").addEventListener("click", function () { go(1); });
  document.addEventListener("keydown", function (ev) {
    var tag = ev.target && ev.target.tagName;
    if (tag === "INPUT" || tag === "SELECT" || tag === "TEXTAREA") return;
    if (ev.key === "ArrowLeft") go(-1);
    else if (ev.key === "ArrowRight") go(1);
  });
  window.addEventListener("hashchange", function () {
    var index = fromHash();
    draw(index >= 0 ? index : current);
    if (index >= 0) document.getElementById("timeline").scrollIntoView();
  });
  var resizeTimer = 0;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () { draw(current); }, 150);
  });
  var start = fromHash();
  draw(start >= 0 ? start : D.first);
  window.addEventListener("load", function () {
    status.setAttribute("data-load-ms", performance.now().toFixed(1));
  });
})();
