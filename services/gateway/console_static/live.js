"use strict";
// The live page: reads /console/api/overview every 2 s and redraws. Every value is global
// (read from Redis), so every gateway replica shows the same page.

const REFRESH_MS = 2000;

function setText(id, value) {
  const node = document.getElementById(id);
  node.textContent = value;
  return node;
}

function render(data) {
  const c = data.counters;
  const live = data.workers === null ? null : data.workers.filter((w) => w.live);
  setText("c-in_flight", fmtNum(c.in_flight));
  setText("c-sessions", fmtNum(data.sessions_total));
  setText("c-sessions-detail", `${fmtNum(c.open_episodes)} open, ${fmtNum(c.awaiting_reward)} awaiting reward`);
  setText("c-workers", live === null ? "?" : String(live.length));
  setText("c-workers-detail", data.workers === null ? "router unreachable" : `${data.workers.length} registered`);
  setText("c-weight_version", fmtNum(c.weight_version));
  const paused = setText("c-paused", c.paused ? `paused ${fmtAge(data.now - c.paused_since_unix)}` : "submitting");
  paused.className = c.paused ? "paused" : "";
  setText("c-published", fmtNum(c.published));
  setText("c-published-detail", `${fmtNum(c.empty_episodes)} empty, ${fmtNum(c.interactions)} interactions`);
  setText("c-consumed", fmtNum(c.consumed));
  const backlog = data.groups.reduce((n, g) => n + Number(g.backlog), 0);
  setText("c-backlog-detail", `${backlog} undelivered over ${data.groups.length} group(s)`);
  setText("c-capacity", Number(c.capacity_left) < 0 ? "unlimited" : fmtNum(c.capacity_left));
  setText("c-capacity-detail", `${fmtNum(c.capacity_used)} used` +
    (Number(c.capacity_bound) >= 0 ? ` of bound ${fmtNum(c.capacity_bound)}` : "") +
    (Number(c.capacity_granted) >= 0 ? `, ${fmtNum(c.capacity_granted)} granted` : ""));
  setText("c-exact", c.interactions > 0 ? (100 * c.exact_token_ratio).toFixed(1) + " %" : "–");
  setText("c-exact-detail", `${fmtNum(c.length_mismatches)} length mismatches, join ${(100 * c.join_rate).toFixed(0)} %`);

  const h = data.history;
  const at = (key) => h.t.map((t, i) => [t, h[key][i]]);
  lineChart("chart-tokens", [{ points: at("tokens_per_s") }], { empty: "waiting for history (10 s)" });
  lineChart("chart-rewards", [
    { points: data.rewards.map((r) => [r.t, r.reward]), dots: true },
    { points: at("mean_reward"), cls: "line2" },
  ], { empty: "no trajectory published yet" });
  lineChart("chart-published", [
    { points: at("published_per_s") }, { points: at("acked_per_s"), cls: "line2" },
  ], { empty: "waiting for history (10 s)" });
  lineChart("chart-backlog", [
    { points: at("backlog") }, { points: at("pending"), cls: "line2" },
  ], { empty: "waiting for history (10 s)" });
  lineChart("chart-trainer", [
    { points: at("weight_version") }, { points: at("paused"), cls: "line2" },
  ], { empty: "waiting for history (10 s)" });
  lineChart("chart-load", [
    { points: at("in_flight") }, { points: at("errors_per_s"), cls: "line2" },
  ], { empty: "waiting for history (10 s)" });

  fillTable("groups", data.groups.map((g) => [
    g.name, el("td", { class: "num", text: g.consumers }), el("td", { class: "num", text: g.backlog }),
    el("td", { class: "num", text: g.pending }), fmtAge(g.oldest_undelivered_age_s), fmtAge(g.oldest_pending_age_s),
  ]), "no consumer group yet (no trainer has pulled)");
  fillTable("workers", (data.workers || []).map((w) => [
    w.worker_id, el("td", { class: w.live ? "live" : "stale", text: w.live ? "live" : "stale" }),
    el("td", { class: "num", text: w.in_flight }), el("td", { class: "num", text: w.sessions }),
    fmtAge(w.last_heartbeat_age_s) + " ago", (w.models || []).join(", ") || "any",
  ]), data.workers === null ? "the router did not answer" : "no worker registered");
  setText("sessions-note", data.sessions_total > data.sessions.length ? `(showing ${data.sessions.length} of ${data.sessions_total})` : "");
  fillTable("sessions", data.sessions.map((s) => [
    s.session_id, s.task_id, s.state, el("td", { class: "num", text: s.turns }),
    fmtTime(s.started_at_unix), fmtTime(s.last_active_at_unix), fmtTime(s.deadline_unix),
  ]), "no running session");
  fillTable("recent", data.recent.map((t) => [
    el("td", {}, el("a", { href: "/console/trajectories#" + encodeURIComponent(t.stream_id), text: fmtTime(t.ended_at_unix) })),
    t.session_id, el("td", { class: "num", text: t.turns }), el("td", { class: "num", text: fmtNum(t.final_reward, 3) }),
    el("td", { class: "num", text: t.output_tokens }), `${t.min_version}–${t.max_version}`,
  ]), "nothing published yet");
  fillTable("errors", data.errors.map((e) => [fmtTime(e.t_unix), e.method, e.code, e.message]), "no error recorded");
}

async function refresh() {
  try {
    render(await api("/console/api/overview?window=3600"));
    setText("status", "live · updated " + new Date().toLocaleTimeString());
    document.body.dataset.updated = String(Date.now());
  } catch (err) {
    setText("status", "update failed: " + err.message);
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
