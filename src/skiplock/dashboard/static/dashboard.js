// skiplock dashboard: live counts on the queues page, confirmation before a delete.
// No framework and no build step; the page works without it (reload to refresh).
"use strict";

document.querySelectorAll("form.confirm").forEach(function (form) {
  form.addEventListener("submit", function (event) {
    if (!window.confirm(form.dataset.confirm)) event.preventDefault();
  });
});

(function () {
  var updated = document.getElementById("updated");
  if (!updated) return;
  var seconds = parseFloat(updated.dataset.refresh) || 2;
  var url = "/api/overview?range=" + encodeURIComponent(updated.dataset.range || "1h");

  // The shape of the table: queue names and paused flags.  When it changes (a new
  // queue, a pause from another tab) the page reloads, since the buttons change too.
  function shape(queues) {
    return queues.map(function (q) { return q.name + ":" + q.paused; }).join("|");
  }
  function pageShape() {
    var rows = document.querySelectorAll("#queues tbody tr");
    return Array.prototype.map.call(rows, function (tr) {
      return tr.dataset.queue + ":" + tr.dataset.paused;
    }).join("|");
  }
  function setText(el, text) {
    if (el && el.textContent !== String(text)) el.textContent = text;
  }

  function apply(data) {
    if (shape(data.queues) !== pageShape()) {
      window.location.reload();
      return;
    }
    data.queues.forEach(function (q) {
      var tr = document.querySelector('#queues tr[data-queue="' + CSS.escape(q.name) + '"]');
      if (!tr) return;
      Object.keys(q.counts).forEach(function (status) {
        var td = tr.querySelector('[data-count="' + status + '"]');
        if (!td) return;
        setText(td.querySelector("a"), q.counts[status]);
        td.classList.toggle("zero", q.counts[status] === 0);
      });
      setText(tr.querySelector('[data-field="oldest_pending"]'), q.oldest_pending);
      var leases = tr.querySelector('[data-field="expired_leases"]');
      setText(leases, q.expired_leases);
      if (leases) leases.classList.toggle("warn", q.expired_leases > 0);
    });
    Object.keys(data.totals).forEach(function (status) {
      setText(document.querySelector('[data-total="' + status + '"]'), data.totals[status]);
    });
    var chart = document.getElementById("chart");
    if (chart && chart.innerHTML !== data.chart_svg) chart.innerHTML = data.chart_svg;
    data.legend.forEach(function (item) {
      setText(document.querySelector('[data-legend="' + item.status + '"]'), item.jobs);
    });
    var at = new Date(data.generated_at * 1000);
    setText(updated, "live · " + at.toLocaleTimeString());
    updated.classList.remove("stale");
  }

  function poll() {
    fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" })
      .then(function (r) {
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      })
      .then(apply)
      .catch(function (err) {
        setText(updated, "not updating: " + err.message);
        updated.classList.add("stale");
      })
      .finally(function () { window.setTimeout(poll, seconds * 1000); });
  }
  window.setTimeout(poll, seconds * 1000);
})();
