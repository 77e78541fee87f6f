// The dashboard: signs in with an API key (kept in sessionStorage), then calls the REST API with
// `Authorization: Bearer` for everything it shows, so it sees exactly what the key's tenant may.
"use strict";
(function () {
  var V = window.opfuseViews, KEY = "opfuse.key", POLL_MS = 1500;
  var state = { models: [], jobs: [], ticked: [], timer: null, asked: 0 };
  function $(id) { return document.getElementById(id); }

  function notice(text, isError) {
    var box = $("notice");
    box.textContent = text;
    box.className = isError ? "error" : "";
    box.hidden = !text;
  }

  async function api(method, path, body, type) {
    var headers = { Authorization: "Bearer " + sessionStorage.getItem(KEY) };
    if (type) { headers["Content-Type"] = type; }
    var response = await fetch(path, { method: method, headers: headers, body: body, cache: "no-store" });
    if (!response.ok) {
      var detail = response.statusText;
      try { detail = (await response.json()).detail || detail; } catch (e) { /* not JSON */ }
      var err = new Error(response.status + ": " + detail);
      err.status = response.status;
      throw err;
    }
    return response;
  }
  async function json(method, path, body) {
    var response = await api(method, path, body === undefined ? undefined : JSON.stringify(body),
      body === undefined ? undefined : "application/json");
    return response.status === 204 ? null : response.json();
  }

  async function all(path) {
    var items = [], cursor = null;
    do {
      var page = await json("GET", path + (path.indexOf("?") < 0 ? "?" : "&") + "limit=100" +
        (cursor ? "&cursor=" + encodeURIComponent(cursor) : ""));
      items = items.concat(page.items);
      cursor = page.next_cursor;
    } while (cursor && items.length < 1000);
    return items;
  }

  // -- sign in ---------------------------------------------------------------------------------
  async function signIn(key) {
    sessionStorage.setItem(KEY, key);
    try {
      await refreshModels();
    } catch (e) {
      sessionStorage.removeItem(KEY);
      notice(e.status === 401 ? "That key was not accepted: check it, or ask an admin for a new one." : e.message, true);
      return;
    }
    $("signin").hidden = true;
    $("app").hidden = false;
    $("nav").hidden = false;
    $("whoami").textContent = "signed in with " + key.slice(0, 8) + "…";
    notice("");
    await refreshJobs();
    schedule();
  }

  function signOut() {
    sessionStorage.removeItem(KEY);
    clearTimeout(state.timer);
    state = { models: [], jobs: [], ticked: [], timer: null, asked: state.asked };
    $("app").hidden = true;
    $("nav").hidden = true;
    $("signin").hidden = false;
    $("key").value = "";
    // The next key starts from an unfiltered view, with nothing of this one's left on the page.
    ["filter-status", "filter-model"].forEach(function (id) { $(id).value = ""; });
    $("sort").value = "-created_at";
    ["models-table", "jobs-table", "compare-table"].forEach(function (id) { $(id).tBodies[0].replaceChildren(); });
    $("report-frame").removeAttribute("srcdoc");
    $("compare").hidden = true;
    $("report").hidden = true;
  }

  // -- models ----------------------------------------------------------------------------------
  async function refreshModels() {
    state.models = await all("/v1/models");
    V.modelRows($("models-table").tBodies[0], state.models);
    V.modelOptions($("job-model"), state.models);
    V.modelOptions($("filter-model"), state.models, "any");
    V.shapeFields($("job-shapes"), modelById($("job-model").value));
  }
  function modelById(id) { return state.models.find(function (m) { return m.id === id; }); }

  async function upload(fileList) {
    var files = Array.prototype.slice.call(fileList);
    var onnx = files.filter(function (f) { return /\.onnx$/i.test(f.name); });
    var body, type, name = $("model-name").value.trim();
    if (files.length === 1 && /\.zip$/i.test(files[0].name)) {
      body = files[0]; type = "application/zip";
    } else if (onnx.length !== 1) {
      notice("Drop one .onnx file (with its external data files, if it has them) or one .zip.", true);
      return;
    } else if (files.length === 1) {
      body = files[0]; type = "application/octet-stream";
    } else {
      body = await window.opfuseZip(files); type = "application/zip";
    }
    name = name || onnx.concat(files)[0].name;
    notice("uploading " + name + " …");
    try {
      var response = await api("POST", "/v1/models?name=" + encodeURIComponent(name), body, type);
      var model = await response.json();
      await refreshModels();
      $("job-model").value = model.id;
      V.shapeFields($("job-shapes"), model);
      notice((response.status === 201 ? "uploaded " : "already uploaded: ") + model.name + " (" + model.id + ")");
    } catch (e) {
      notice("upload failed: " + e.message, true);
    }
  }

  // -- jobs ------------------------------------------------------------------------------------
  function parseShape(text) {
    var dims = text.trim().split(/[x×,\s]+/).filter(Boolean).map(Number);
    return dims.length && dims.every(function (d) { return Number.isInteger(d) && d > 0; }) ? dims : null;
  }

  async function startJob() {
    var model = modelById($("job-model").value);
    if (!model) { notice("Upload a model first.", true); return; }
    var shapes = {}, bad = [];
    $("job-shapes").querySelectorAll("input[data-input]").forEach(function (input) {
      var dims = parseShape(input.value);
      if (dims) { shapes[input.getAttribute("data-input")] = dims; } else { bad.push(input.getAttribute("data-input")); }
    });
    if (bad.length) { notice("Give every dim of " + bad.join(", ") + " as positive integers, e.g. 2x32.", true); return; }
    try {
      var job = await json("POST", "/v1/jobs", { model_id: model.id, input_shapes: shapes,
        precision: $("job-precision").value });
      notice("job " + job.id + " queued");
      await refreshJobs();
    } catch (e) {
      notice("the job was not started: " + e.message, true);
    }
  }

  async function refreshJobs() {
    var query = "/v1/jobs?order_by=" + encodeURIComponent($("sort").value);
    if ($("filter-status").value) { query += "&status=" + encodeURIComponent($("filter-status").value); }
    if ($("filter-model").value) { query += "&model_id=" + encodeURIComponent($("filter-model").value); }
    // A poll and a change of filter can overlap: only the latest answer is drawn.
    var asked = ++state.asked;
    var jobs = await all(query);
    if (asked !== state.asked) { return; }
    state.jobs = jobs;
    var tbody = $("jobs-table").tBodies[0];
    tbody.replaceChildren.apply(tbody, state.jobs.map(function (job) {
      var model = modelById(job.model_id);
      return V.jobRow(job, model ? model.name : job.model_id.slice(0, 8), state.ticked.indexOf(job.id) >= 0, action);
    }));
    $("compare-button").disabled = state.ticked.length !== 2;
  }

  function schedule() {
    clearTimeout(state.timer);
    state.timer = setTimeout(async function () {
      try { await refreshJobs(); } catch (e) { notice("could not refresh the jobs: " + e.message, true); }
      if (sessionStorage.getItem(KEY)) { schedule(); }
    }, POLL_MS);
  }

  function action(kind, job) {
    var button = V.el("button", { type: "button", "data-action": kind, "data-job": job.id, text: kind });
    button.addEventListener("click", function () {
      ({ report: openReport, download: download, cancel: cancel })[kind](job).catch(function (e) {
        notice(kind + " failed: " + e.message, true);
      });
    });
    return button;
  }

  async function cancel(job) {
    await json("POST", "/v1/jobs/" + encodeURIComponent(job.id) + "/cancel");
    await refreshJobs();
  }

  function saveBlob(blob, filename) {
    var a = V.el("a", { href: URL.createObjectURL(blob), download: filename });
    document.body.appendChild(a);
    a.click();
    a.remove();
  }

  async function download(job) {
    var response = await api("GET", "/v1/jobs/" + encodeURIComponent(job.id) + "/artifact");
    saveBlob(await response.blob(), job.id + ".opfuse.zip");
    notice("downloaded " + job.id + ".opfuse.zip");
  }

  // The page comes from the API (rendered there from the stored report) and is shown in a sandboxed
  // frame with no access to this page or its key.
  async function openReport(job) {
    var page = await (await api("GET", "/v1/jobs/" + encodeURIComponent(job.id) + "/report.html")).text();
    $("report-frame").srcdoc = page;
    $("report-title").textContent = "Report of job " + job.id;
    var save = $("report-save");
    if (save.href) { URL.revokeObjectURL(save.href); }
    save.href = URL.createObjectURL(new Blob([page], { type: "text/html" }));
    save.setAttribute("download", job.id + ".report.html");
    $("report").hidden = false;
    $("report").scrollIntoView();
  }

  async function compare() {
    var sides = await Promise.all(state.ticked.map(async function (id) {
      var job = await json("GET", "/v1/jobs/" + encodeURIComponent(id));
      var report = job.status === "succeeded" ? await json("GET", "/v1/jobs/" + encodeURIComponent(id) + "/report") : {};
      var model = modelById(job.model_id), fusion = report.fusion || {};
      return { job: job, report: report, model: model ? model.name : job.model_id,
        groups: (fusion.groups || []).length, not_fused: (fusion.not_fused || []).length };
    }));
    V.compareRows($("compare-table").tBodies[0], sides);
    $("compare").hidden = false;
    $("compare").scrollIntoView();
  }

  // -- wiring ----------------------------------------------------------------------------------
  function wire() {
    $("signin-button").addEventListener("click", function () { signIn($("key").value.trim()); });
    $("key").addEventListener("keydown", function (e) { if (e.key === "Enter") { signIn($("key").value.trim()); } });
    $("signout").addEventListener("click", signOut);
    var drop = $("drop");
    ["dragenter", "dragover"].forEach(function (t) {
      drop.addEventListener(t, function (e) { e.preventDefault(); drop.classList.add("over"); });
    });
    drop.addEventListener("dragleave", function () { drop.classList.remove("over"); });
    drop.addEventListener("drop", function (e) {
      e.preventDefault();
      drop.classList.remove("over");
      upload(e.dataTransfer.files);
    });
    $("files").addEventListener("change", function () { upload($("files").files).then(function () { $("files").value = ""; }); });
    $("job-model").addEventListener("change", function () { V.shapeFields($("job-shapes"), modelById($("job-model").value)); });
    $("job-start").addEventListener("click", startJob);
    ["filter-status", "filter-model", "sort"].forEach(function (id) { $(id).addEventListener("change", refreshJobs); });
    $("jobs-table").addEventListener("change", function (e) {
      var id = e.target.getAttribute("data-job");
      if (!id) { return; }
      state.ticked = state.ticked.filter(function (t) { return t !== id; });
      if (e.target.checked) { state.ticked = state.ticked.concat([id]).slice(-2); }
      refreshJobs();
    });
    $("compare-button").addEventListener("click", function () {
      compare().catch(function (e) { notice("compare failed: " + e.message, true); });
    });
    document.querySelectorAll("button.close").forEach(function (b) {
      b.addEventListener("click", function () { $(b.getAttribute("data-close")).hidden = true; });
    });
    var key = sessionStorage.getItem(KEY);
    if (key) { signIn(key); }
  }

  wire();
})();
