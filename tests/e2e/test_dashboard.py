"""The dashboard at /ui in headless Chromium against a real `opfuse serve` (API + worker process,
CPU interpreter): sign in with a key, upload a model (one .onnx, and an .onnx with its .data file
packed into a zip by the page), start jobs, watch them finish, sort and filter, open a report,
compare two jobs, download a bundle; no console message, no request to another host. A second
tenant's key sees nothing of the first's. /docs renders offline. Screenshots go to
OPFUSE_SCREENSHOT_DIR (default: the test's tmp dir), for people to look at."""

from __future__ import annotations

import base64
import hashlib
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import onnx
import pytest

from tests.browser import chromium, console_problems, full_page_screenshot, requested_urls, screenshot_dir
from tests.builders import residual_mlp
from tests.e2e.test_e2e import Served, served  # noqa: F401 (the fixture: a real server and worker)

pytestmark = pytest.mark.e2e

JOB_SECONDS = 300
# A file dropped on the drop zone, as the browser hands it to the page (WebDriver cannot drag files
# from the desktop): a DataTransfer holding the file, in a drop event.
DROP = """
var bytes = Uint8Array.from(atob(arguments[0]), function (c) { return c.charCodeAt(0); });
var data = new DataTransfer();
data.items.add(new File([bytes], arguments[1]));
var zone = document.getElementById("drop");
zone.dispatchEvent(new DragEvent("dragover", {dataTransfer: data, bubbles: true, cancelable: true}));
zone.dispatchEvent(new DragEvent("drop", {dataTransfer: data, bubbles: true, cancelable: true}));
"""  # a tiny model's job in the interpreter, on a shared machine


def _wait(
    what: str, condition: Callable[[], Any], timeout: float = 30, describe: Callable[[], Any] | None = None
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what} ({describe() if describe else ''})"
        time.sleep(0.25)


def _key(server: Served, tenant: str) -> str:
    platform = (server.home / "api_key").read_text().strip()
    made = httpx.post(
        f"{server.url}/v1/admin/api-keys",
        json={"scope": "user", "tenant": tenant},
        headers={"Authorization": f"Bearer {platform}"},
        timeout=10,
    )
    assert made.status_code in (200, 201), made.text
    key: str = made.json()["key"]
    return key


def _by_id(driver: Any, element_id: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def _rows(driver: Any, table: str) -> list[dict[str, str]]:
    """The table's rows, read in one go (the page redraws the jobs table as it polls)."""
    script = (
        "return Array.from(document.querySelectorAll('#' + arguments[0] + ' tbody tr')).map(function (tr) {"
        " var s = tr.querySelector('td.speedup');"
        " return {job: tr.getAttribute('data-job'), model: tr.getAttribute('data-model'),"
        " status: tr.getAttribute('data-status'), speedup: s ? s.textContent : ''}; });"
    )
    return list(driver.execute_script(script, table))


def _click(driver: Any, css: str) -> None:
    """Click the element `css` finds, again if the page redrew it in between."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(20):
        try:
            driver.find_element(By.CSS_SELECTOR, css).click()
            return
        except StaleElementReferenceException:
            time.sleep(0.1)
    raise AssertionError(f"{css} kept being redrawn")


def _sign_in(driver: Any, key: str) -> None:
    _by_id(driver, "key").send_keys(key)
    _by_id(driver, "signin-button").click()
    _wait("the signed-in view", lambda: _by_id(driver, "app").is_displayed())


def _upload(driver: Any, paths: list[Path], models_before: int) -> dict[str, str]:
    _by_id(driver, "files").send_keys("\n".join(str(p) for p in paths))
    _wait("the model's row", lambda: len(_rows(driver, "models-table")) == models_before + 1)
    notice = _by_id(driver, "notice")
    assert "error" not in (notice.get_attribute("class") or ""), notice.text
    return {"id": _by_id(driver, "job-model").get_attribute("value"), "notice": notice.text}


def _start_job(driver: Any, model_id: str, shape: str) -> str:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(_by_id(driver, "job-model")).select_by_value(model_id)
    field = driver.find_element(By.CSS_SELECTOR, '#job-shapes input[data-input="x"]')
    field.clear()
    field.send_keys(shape)
    Select(_by_id(driver, "job-precision")).select_by_visible_text("fp32")
    before = _by_id(driver, "notice").text
    _by_id(driver, "job-start").click()

    def queued() -> str | None:
        text = str(_by_id(driver, "notice").text)
        return text if text != before and text.endswith(" queued") else None

    text = _wait("the job's notice", queued)
    return str(text.split()[1])


def _status(driver: Any, job_id: str) -> str | None:
    return next((r["status"] for r in _rows(driver, "jobs-table") if r["job"] == job_id), None)


def _api(server: Served, key: str, path: str) -> Any:
    answer = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_dashboard_from_sign_in_to_download(served: Served, tmp_path: Path) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    shots = screenshot_dir(tmp_path)
    user, other = _key(served, "default"), _key(served, "dash-other")
    single = tmp_path / "mlp_a.onnx"
    onnx.save(residual_mlp(hidden=16, ffn=32, seed=11), single)
    external_dir = tmp_path / "external"
    external_dir.mkdir()
    external = external_dir / "mlp_b.onnx"
    onnx.save(
        residual_mlp(hidden=16, ffn=32, seed=12),
        external,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="mlp_b.onnx.data",
        size_threshold=0,
    )
    downloads = tmp_path / "downloads"
    with chromium(tmp_path, downloads=downloads) as driver:
        driver.get("about:blank")
        requested_urls(driver), console_problems(driver)  # the browser's own start page
        driver.get(f"{served.url}/ui/")
        full_page_screenshot(driver, shots / "dashboard_1_sign_in.png")
        _sign_in(driver, user)
        before = len(_rows(driver, "models-table"))
        a = _upload(driver, [single], before)
        assert a["notice"].startswith("uploaded mlp_a.onnx")
        b = _upload(driver, [external, external_dir / "mlp_b.onnx.data"], before + 1)
        assert a["id"] != b["id"]
        # Dropped on the drop zone: a zip of a model with its external data, as a person packs it.
        dropped_dir = tmp_path / "dropped"
        dropped_dir.mkdir()
        onnx.save(
            residual_mlp(hidden=16, ffn=32, seed=13),
            dropped_dir / "mlp_c.onnx",
            save_as_external_data=True,
            location="weights.bin",
            size_threshold=0,
        )
        packed = tmp_path / "mlp_c.zip"
        with zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as z:
            for member in ("mlp_c.onnx", "weights.bin"):
                z.write(dropped_dir / member, member)
        _by_id(driver, "model-name").send_keys("dropped")
        driver.execute_script(DROP, base64.b64encode(packed.read_bytes()).decode(), packed.name)
        _wait(
            "the dropped model's row",
            lambda: len(_rows(driver, "models-table")) == before + 3,
            describe=lambda: _by_id(driver, "notice").text,
        )
        assert _by_id(driver, "notice").text.startswith("uploaded dropped (")
        _by_id(driver, "model-name").clear()
        job_a = _start_job(driver, a["id"], "2x16")
        job_b = _start_job(driver, b["id"], "3x16")
        _wait("a job row", lambda: _status(driver, job_b) is not None, 10)
        full_page_screenshot(driver, shots / "dashboard_2_jobs_queued.png")
        _wait(
            "both jobs to finish",
            lambda: (
                _status(driver, job_a) in ("succeeded", "failed")
                and _status(driver, job_b) in ("succeeded", "failed")
            ),
            JOB_SECONDS,
        )
        assert (_status(driver, job_a), _status(driver, job_b)) == ("succeeded", "succeeded")
        full_page_screenshot(driver, shots / "dashboard_3_jobs_done.png")

        # Sort and filter go to the API (order_by, status, model_id); the table shows its order.
        # (A CPU job measures no speedup: the column reads "—" and those rows come last.)
        for order in ("-speedup", "speedup", "-created_at"):
            Select(_by_id(driver, "sort")).select_by_value(order)
            expected = [j["id"] for j in _api(served, user, f"/v1/jobs?order_by={order}&limit=100")["items"]]
            _wait(
                f"rows in {order} order",
                lambda e=expected: [r["job"] for r in _rows(driver, "jobs-table")] == e,
            )
        Select(_by_id(driver, "filter-model")).select_by_value(b["id"])
        _wait(
            "one model's jobs",
            lambda: [r["job"] for r in _rows(driver, "jobs-table")] == [job_b],
            describe=lambda: _rows(driver, "jobs-table"),
        )
        Select(_by_id(driver, "filter-model")).select_by_value("")
        Select(_by_id(driver, "filter-status")).select_by_value("failed")
        _wait("no failed job", lambda: _rows(driver, "jobs-table") == [])
        Select(_by_id(driver, "filter-status")).select_by_value("succeeded")
        _wait(
            "the succeeded jobs",
            lambda: {job_a, job_b} <= {r["job"] for r in _rows(driver, "jobs-table")},
        )

        # The report: the API's page, in a sandboxed frame, its sort script running under the CSP.
        _click(driver, f'button[data-action="report"][data-job="{job_a}"]')
        frame = _wait(
            "the report frame",
            lambda: _by_id(driver, "report").is_displayed() and _by_id(driver, "report-frame"),
        )
        driver.switch_to.frame(frame)
        _wait("the report's verdict", lambda: driver.find_elements(By.ID, "verdict"))
        assert "opfuse report: job " + job_a in driver.find_element(By.TAG_NAME, "h1").text
        assert driver.find_element(By.ID, "time-chart").tag_name == "svg"
        # Its sort script runs in the frame: the dashboard's CSP allows it by hash.
        driver.execute_script("document.querySelectorAll('details').forEach(function (d) { d.open = true; })")
        header = driver.find_element(By.CSS_SELECTOR, "table.sortable th:nth-child(3)")
        header.click()
        assert header.get_attribute("data-dir") == "desc"
        driver.switch_to.default_content()
        full_page_screenshot(driver, shots / "dashboard_4_report.png")

        # Compare the two jobs side by side.
        for job in (job_a, job_b):
            _click(driver, f'input[type="checkbox"][data-job="{job}"]')
            ticked = f'return document.querySelector(\'input[type="checkbox"][data-job="{job}"]\').checked'
            _wait("the tick", lambda t=ticked: driver.execute_script(t))
        _wait("the compare button", lambda: _by_id(driver, "compare-button").is_enabled())
        _by_id(driver, "compare-button").click()
        table = _wait(
            "the comparison",
            lambda: _by_id(driver, "compare").is_displayed() and _by_id(driver, "compare-table"),
        )
        text = _wait("the comparison's rows", lambda: "speedup" in table.text and table.text)
        assert job_a[:12] in text and job_b[:12] in text and "mlp_a.onnx" in text and "mlp_b.onnx" in text
        assert "verification passed passed" in text and "reference onnxruntime-cpu onnxruntime-cpu" in text
        full_page_screenshot(driver, shots / "dashboard_5_compare.png")

        # Download the bundle: the same bytes the API serves.
        _click(driver, f'button[data-action="download"][data-job="{job_a}"]')
        bundle = downloads / f"{job_a}.opfuse.zip"
        _wait("the download", lambda: bundle.is_file() and not list(downloads.glob("*.crdownload")), 60)
        served_bundle = httpx.get(
            f"{served.url}/v1/jobs/{job_a}/artifact", headers={"Authorization": f"Bearer {user}"}, timeout=30
        )
        assert hashlib.sha256(bundle.read_bytes()).hexdigest() == served_bundle.headers["etag"].strip('"')
        with zipfile.ZipFile(bundle) as z:
            assert {"manifest.json", "model.onnx", "report.json"} <= set(z.namelist())

        assert console_problems(driver) == []
        urls = requested_urls(driver)
        assert urls and all(u.startswith(f"{served.url}/") or u.startswith("blob:") for u in urls), urls

        # Another tenant's key: none of these models or jobs, and no way to open them.
        _by_id(driver, "signout").click()
        _sign_in(driver, other)
        time.sleep(2)  # a poll of the jobs list or two
        assert _rows(driver, "models-table") == [] and _rows(driver, "jobs-table") == []
        full_page_screenshot(driver, shots / "dashboard_6_other_tenant.png")
        for path in (f"/v1/jobs/{job_a}", f"/v1/jobs/{job_a}/report.html", f"/v1/models/{a['id']}"):
            seen = httpx.get(f"{served.url}{path}", headers={"Authorization": f"Bearer {other}"}, timeout=10)
            assert seen.status_code == 404, (path, seen.status_code)
        assert console_problems(driver) == []

        # /docs: the API page, nothing from another host.
        requested_urls(driver)
        driver.get(f"{served.url}/docs")
        assert "opfuse 1 API" in driver.find_element(By.TAG_NAME, "h1").text
        assert driver.find_elements(By.CSS_SELECTOR, "section.op")
        assert all(u.startswith(f"{served.url}/") for u in requested_urls(driver))
        assert console_problems(driver) == []
        full_page_screenshot(driver, shots / "docs.png")
