"use strict";
// The trajectory viewer: pick a published episode; see its turns, the messages, and each
// sampled output token coloured by its logprob, with its weight version and the exact-ids flag.

const PAGE = 50;
let offset = 0;

// exp(logprob) from 0 (red) to 1 (green).
function tokenColour(logprob) {
  if (logprob === null || logprob === undefined) return "hsl(0, 0%, 88%)";
  const p = Math.exp(logprob);
  return `hsl(${Math.round(120 * p)}, 75%, 82%)`;
}

function badge(text, kind) {
  return el("span", { class: "badge " + (kind || ""), text });
}

async function loadList() {
  const data = await api(`/console/api/trajectories?limit=${PAGE}&offset=${offset}`);
  const list = document.getElementById("list");
  for (const t of data.trajectories) {
    const item = el("li", { "data-stream-id": t.stream_id },
      el("b", { text: t.session_id || t.trajectory_id }),
      el("small", { text: `${fmtTime(t.ended_at_unix)} · ${t.turns} turn(s) · reward ${fmtNum(t.final_reward, 3)}` }),
      el("small", { text: `v${t.min_version}–${t.max_version} · ${t.output_tokens} tokens · ${t.exact_interactions}/${t.turns} exact` }));
    item.addEventListener("click", () => { window.location.hash = encodeURIComponent(t.stream_id); });
    list.append(item);
  }
  offset += data.trajectories.length;
  document.getElementById("more").hidden = data.trajectories.length < PAGE;
  return data.trajectories;
}

function renderTurn(turn) {
  const versions = turn.tokens.map((t) => t.version).filter((v) => v !== null);
  const low = versions.length ? Math.min(...versions) : null;
  const high = versions.length ? Math.max(...versions) : null;
  const head = el("h3", {}, `Turn ${turn.index}`, " ",
    badge(turn.exact_tokens ? "exact ids" : "re-tokenized ids", turn.exact_tokens ? "good" : "bad"),
    turn.length_mismatch ? badge("logprob/id length mismatch", "bad") : null,
    badge(turn.finish_reason || "?"),
    badge(`reward ${fmtNum(turn.reward, 3)}${turn.reward_set ? "" : " (unset)"}`, turn.reward_set ? "" : "warn"),
    badge(low === high ? `v${low}` : `v${low}→v${high}`, low === high ? "" : "warn"),
    turn.turn_type === "side" ? badge("side turn", "warn") : null);
  const meta = el("div", { class: "meta" },
    el("span", {}, "id ", el("b", { text: turn.interaction_id })),
    el("span", {}, "parent ", el("b", { text: turn.parent === null ? "none" : turn.parent })),
    el("span", {}, "model ", el("b", { text: turn.model })),
    el("span", {}, "latency ", el("b", { text: fmtNum(turn.latency_s, 3) + " s" })),
    el("span", {}, "first token ", el("b", { text: fmtNum(turn.ttft_s, 3) + " s" })),
    el("span", {}, "prompt ", el("b", { text: turn.prompt_tokens + " ids" })),
    el("span", {}, "versions ", el("b", { text: turn.output_versions_source })));
  const messages = el("details", {}, el("summary", { text: `${turn.messages.length} request message(s)` }),
    ...turn.messages.map((m) => el("div", { class: "msg" }, el("span", { class: "role", text: m.role }), m.content,
      m.tool_calls ? "\n" + JSON.stringify(m.tool_calls) : null)));
  const output = el("div", { class: "msg output" }, el("span", { class: "role", text: "assistant" }),
    turn.output.content || "", turn.output.reasoning_content ? "\n[reasoning] " + turn.output.reasoning_content : null,
    turn.output.tool_calls ? "\n" + JSON.stringify(turn.output.tool_calls) : null);
  const tokens = el("div", { class: "tokens" });
  let previous = null;
  for (const [i, t] of turn.tokens.entries()) {
    const prob = t.logprob === null ? null : Math.exp(t.logprob);
    const chip = el("span", {
      class: "tok" + (previous !== null && t.version !== previous ? " vchange" : ""),
      style: `background:${tokenColour(t.logprob)}`,
      text: t.id === null ? "?" : t.id,
      title: `#${i} · id ${t.id === null ? "none" : t.id} · logprob ${t.logprob === null ? "none" : t.logprob}` +
        (prob === null ? "" : ` (p ${prob.toFixed(3)})`) + ` · weight version ${t.version === null ? "?" : t.version}` +
        (turn.exact_tokens ? " · exact id" : " · re-tokenized"),
      "data-logprob": t.logprob, "data-version": t.version, "data-id": t.id,
    });
    tokens.append(chip);
    previous = t.version;
  }
  return el("section", { class: "turn", "data-index": turn.index }, head, meta, messages, output,
    el("div", { class: "legend" }, `${turn.tokens.length} sampled token(s): `, el("span", { style: `background:${tokenColour(Math.log(0.05))}`, text: "p≈0" }),
      el("span", { style: `background:${tokenColour(Math.log(0.5))}`, text: "0.5" }), el("span", { style: `background:${tokenColour(0)}`, text: "1" }),
      " · a black left edge: the weight version changed there · hover a token for id, logprob, version"),
    tokens);
}

async function show(streamId) {
  for (const li of document.querySelectorAll("#list li")) {
    li.classList.toggle("selected", li.dataset.streamId === streamId);
  }
  const box = document.getElementById("trajectory");
  box.replaceChildren(el("p", { class: "hint", text: "loading…" }));
  try {
    const t = await api("/console/api/trajectories/" + encodeURIComponent(streamId));
    const stats = t.stats || {};
    box.replaceChildren(
      el("h2", { text: `${t.session_id} · ${t.trajectory_id}` }),
      el("div", { class: "meta" },
        el("span", {}, "task ", el("b", { text: t.task_id })),
        el("span", {}, "final reward ", el("b", { id: "final-reward", text: fmtNum(t.final_reward, 3) })),
        el("span", {}, "versions ", el("b", { text: t.weight_versions.join(", ") || "–" })),
        el("span", {}, "ended ", el("b", { text: `${fmtTime(t.ended_at)} (${t.end_reason})` })),
        el("span", {}, "joined ", el("b", { text: `${stats.joined || 0}/${stats.interactions || t.turns.length}` })),
        el("span", {}, "stream id ", el("b", { text: t.stream_id }))),
      ...t.turns.map(renderTurn));
    document.body.dataset.shown = streamId;
  } catch (err) {
    box.replaceChildren(el("p", { class: "error", text: err.message }));
  }
}

async function start() {
  document.getElementById("more").addEventListener("click", () => loadList());
  window.addEventListener("hashchange", () => show(decodeURIComponent(window.location.hash.slice(1))));
  try {
    const first = await loadList();
    document.getElementById("status").textContent = `${offset} shown`;
    const wanted = decodeURIComponent(window.location.hash.slice(1));
    if (wanted) await show(wanted);
    else if (first.length) window.location.hash = encodeURIComponent(first[0].stream_id);
  } catch (err) {
    document.getElementById("status").textContent = "failed: " + err.message;
  }
}

start();
