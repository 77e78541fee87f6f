// How the dashboard draws what the API returns: tables of models and jobs, a job's start form,
// two jobs side by side. Text from the API goes in as textContent, never as markup.
"use strict";
(function () {
  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") { node.textContent = attrs[k]; } else if (k === "cls") { node.className = attrs[k]; }
      else { node.setAttribute(k, attrs[k]); }
    });
    (children || []).forEach(function (c) { node.appendChild(typeof c === "string" ? document.createTextNode(c) : c); });
    return node;
  }

  function shape(spec) { return spec.name + " " + spec.dtype + "[" + spec.shape.join(", ") + "]"; }
  function when(iso) { return iso ? new Date(iso).toLocaleString() : ""; }
  function num(v, digits) { return typeof v === "number" ? v.toFixed(digits === undefined ? 3 : digits) : "—"; }
  function bytes(v) {
    if (typeof v !== "number") { return "—"; }
    var units = ["B", "KiB", "MiB", "GiB"], i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(1) : v) + " " + units[i];
  }
  function speedup(job) { return job.summary && typeof job.summary.speedup === "number" ? job.summary.speedup : null; }

  function modelRows(tbody, models) {
    tbody.replaceChildren.apply(tbody, models.map(function (m) {
      return el("tr", { "data-model": m.id }, [
        el("td", { text: m.name }), el("td", {}, [el("code", { text: m.id })]),
        el("td", { text: m.inputs.map(shape).join("; ") }), el("td", { text: m.outputs.map(shape).join("; ") }),
        el("td", { cls: "num", text: bytes(m.size_bytes) }), el("td", { text: when(m.created_at) })]);
    }));
  }

  function modelOptions(select, models, blank) {
    var keep = select.value;
    var options = models.map(function (m) { return el("option", { value: m.id, text: m.name + " (" + m.id.slice(0, 8) + ")" }); });
    if (blank) { options.unshift(el("option", { value: "", text: blank })); }
    select.replaceChildren.apply(select, options);
    if (Array.prototype.some.call(select.options, function (o) { return o.value === keep; })) { select.value = keep; }
  }

  // One text field per input that has a dynamic dim, prefilled with its static dims.
  function shapeFields(box, model) {
    var fields = (model ? model.inputs : []).filter(function (i) {
      return i.shape.some(function (d) { return typeof d !== "number"; });
    }).map(function (i) {
      var hint = i.shape.map(function (d) { return typeof d === "number" ? String(d) : ""; }).join("x");
      return el("label", {}, [i.name + " [" + i.shape.join(", ") + "] shape ",
        el("input", { "data-input": i.name, value: hint, placeholder: "e.g. 2x32", size: "24" })]);
    });
    if (!fields.length && model) { fields = [el("p", { cls: "muted", text: "every input's shape is static" })]; }
    box.replaceChildren.apply(box, fields);
  }

  function jobRow(job, modelName, ticked, actions) {
    var s = job.summary || {};
    var check = el("input", { type: "checkbox", "data-job": job.id, "aria-label": "compare " + job.id });
    check.checked = ticked;
    var status = el("td", { cls: "status-" + job.status, text: job.status });
    if (job.error) { status.appendChild(el("div", { cls: "error-text", text: job.error })); }
    var progress = el("progress", { max: "1", value: String(job.progress || 0) });
    var buttons = el("td", { cls: "actions" });
    if (job.status === "succeeded") {
      buttons.append(actions("report", job), actions("download", job));
    } else if (job.status === "queued" || job.status === "running") {
      buttons.append(actions("cancel", job));
    }
    return el("tr", { "data-job": job.id, "data-status": job.status }, [
      el("td", {}, [check]), el("td", {}, [el("code", { text: job.id.slice(0, 12) })]),
      el("td", { text: modelName }), status, el("td", { text: job.stage || "" }),
      el("td", {}, [progress, " " + Math.round((job.progress || 0) * 100) + "%"]),
      el("td", { cls: "num speedup", text: speedup(job) === null ? "—" : num(speedup(job), 2) + "×" }),
      el("td", { cls: "num", text: num(s.latency_ms_before) + " → " + num(s.latency_ms_after) }),
      el("td", { cls: "num", text: s.kernels_before === undefined ? "—" : s.kernels_before + " → " + s.kernels_after }),
      el("td", { text: when(job.created_at) }), buttons]);
  }

  function get(obj, path) {
    return path.split(".").reduce(function (o, k) { return o && typeof o === "object" ? o[k] : undefined; }, obj);
  }

  // Rows of the comparison: [label, path into {job, report}, format, which is better].
  var COMPARE = [
    ["model", "model", String], ["status", "job.status", String],
    ["device", "report.device.name", String], ["device kind", "report.device.kind", String],
    ["precision", "report.precision", String],
    ["speedup", "report.speedup", function (v) { return num(v, 2) + "×"; }, "high"],
    ["p50 before (ms)", "report.before.latency_ms.p50", num, "low"],
    ["p50 after (ms)", "report.after.latency_ms.p50", num, "low"],
    ["p99 after (ms)", "report.after.latency_ms.p99", num, "low"],
    ["launches before", "report.kernels.before", String, "low"],
    ["launches after", "report.kernels.after", String, "low"],
    ["peak memory after", "report.after.peak_memory_bytes", bytes, "low"],
    ["fused groups", "groups", String], ["not fused", "not_fused", String],
    ["verification", "report.verification.passed", function (v) { return v ? "passed" : "failed"; }], ["reference", "report.verification.reference", String],
  ];

  function compareRows(tbody, sides) {
    var head = el("tr", {}, [el("th", { text: "" })].concat(sides.map(function (s) {
      return el("th", {}, [el("code", { text: s.job.id.slice(0, 12) })]);
    })));
    var rows = COMPARE.map(function (row) {
      var values = sides.map(function (s) { return get(s, row[1]); });
      var numbers = values.filter(function (v) { return typeof v === "number"; });
      var best = row[3] && numbers.length === values.length && values[0] !== values[1]
        ? (row[3] === "high" ? Math.max : Math.min).apply(null, numbers) : null;
      return el("tr", {}, [el("th", { text: row[0] })].concat(values.map(function (v) {
        return el("td", { cls: best !== null && v === best ? "num better" : "num", text: v === undefined || v === null ? "—" : row[2](v) });
      })));
    });
    tbody.replaceChildren.apply(tbody, [head].concat(rows));
  }

  window.opfuseViews = { el: el, modelRows: modelRows, modelOptions: modelOptions, shapeFields: shapeFields,
    jobRow: jobRow, compareRows: compareRows };
})();
