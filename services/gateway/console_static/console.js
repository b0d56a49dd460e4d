"use strict";
// Shared helpers of the console pages. Everything is built with textContent: no HTML from
// the data (messages, ids, errors) is ever interpreted.

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else if (key.startsWith("data-")) node.setAttribute(key, String(value));
    else if (key === "title") node.title = String(value);
    // Through the CSSOM: the pages' CSP forbids inline style attributes, not this.
    else if (key === "style") node.style.cssText = value;
    else node[key] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmtTime(unix) {
  if (!unix) return "–";
  return new Date(unix * 1000).toLocaleTimeString();
}

function fmtAge(seconds) {
  if (seconds === null || seconds === undefined || seconds <= 0) return "–";
  if (seconds < 60) return seconds.toFixed(1) + " s";
  if (seconds < 3600) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function fmtNum(value, digits) {
  if (value === null || value === undefined) return "–";
  const n = Number(value);
  if (!Number.isFinite(n)) return "–";
  return digits === undefined ? String(Math.round(n)) : n.toFixed(digits);
}

// GET a console API; a 401 means the login ended: back to the login page.
async function api(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (response.status === 401) {
    window.location.assign("/console/login");
    throw new Error("logged out");
  }
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

function fillTable(id, rows, emptyText) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren();
  if (!rows.length) {
    const cols = document.querySelectorAll("#" + id + " thead th").length;
    body.append(el("tr", {}, el("td", { class: "none", colSpan: cols, text: emptyText })));
    return;
  }
  for (const cells of rows) {
    body.append(el("tr", {}, ...cells.map((c) => (c instanceof Node ? c : el("td", { text: c })))));
  }
}

// A line chart in an <svg viewBox="0 0 400 120">: series of [x, y] (y null: a gap).
function lineChart(svgId, series, options) {
  const svg = document.getElementById(svgId);
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const all = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined));
  if (all.length === 0) {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", "200"); t.setAttribute("y", "60"); t.setAttribute("text-anchor", "middle");
    t.setAttribute("class", "empty"); t.textContent = (options && options.empty) || "no data yet";
    svg.append(t);
    return;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = Math.min(0, ...ys), y1 = Math.max(...ys);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y1 = y0 + 1; }
  const px = (x) => 30 + ((x - x0) / (x1 - x0)) * 360;
  const py = (y) => 105 - ((y - y0) / (y1 - y0)) * 95;
  const axis = document.createElementNS(ns, "path");
  axis.setAttribute("d", `M30 10 V105 H390`); axis.setAttribute("class", "axis");
  svg.append(axis);
  for (const [y, anchor] of [[y1, 14], [y0, 105]]) {
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", "2"); label.setAttribute("y", String(anchor));
    label.setAttribute("class", "label"); label.textContent = fmtNum(y, Math.abs(y) < 10 ? 2 : 0);
    svg.append(label);
  }
  const tl = document.createElementNS(ns, "text");
  tl.setAttribute("x", "390"); tl.setAttribute("y", "118"); tl.setAttribute("text-anchor", "end");
  tl.setAttribute("class", "label"); tl.textContent = fmtTime(x1);
  svg.append(tl);
  for (const s of series) {
    if (s.dots) {
      for (const [x, y] of s.points) {
        if (y === null || y === undefined) continue;
        const c = document.createElementNS(ns, "circle");
        c.setAttribute("cx", px(x).toFixed(1)); c.setAttribute("cy", py(y).toFixed(1));
        c.setAttribute("r", "2.2"); c.setAttribute("class", "dot");
        svg.append(c);
      }
      continue;
    }
    let d = "", pen = "M";
    for (const [x, y] of s.points) {
      if (y === null || y === undefined) { pen = "M"; continue; }
      d += `${pen}${px(x).toFixed(1)} ${py(y).toFixed(1)} `;
      pen = "L";
    }
    const path = document.createElementNS(ns, "path");
    path.setAttribute("d", d.trim()); path.setAttribute("class", s.cls || "line");
    svg.append(path);
  }
}
