"""Lab: the status page in a real browser.

A lab appliance (XDP, a static pool of three backends with a TCP probe) serves
the REST API and its status page on its management address; Debian's headless
Chromium, driven by chromedriver through selenium (``page_driver.py``), runs
in the client's network namespace and opens the page there as an operator on
another host would. The page must list every backend up, show a backend whose
link goes down as down, drain a backend and pin a weight with a write token,
refuse to write with a read token, keep updating when it polls instead of
listening to events, and load only the appliance's own files. The page's load
time and size are measured and written to a JSON file, never asserted.

Under ``CI`` a missing browser fails this module with the reason; elsewhere it
is skipped with it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance
from hpclb.lab.topology import Lab, default_pass_obj

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="lab tests need root (network namespaces, veth, XDP)")

DRIVER = Path(__file__).with_name("page_driver.py")
STATIC = (Path(__file__).parents[2] / "control" / "hpclb" / "faces" / "api" / "static")
WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 2.0}
# The fault suites' probe: b2 is down within fall x interval (+ a timeout) of its link going.
PROBE: dict[str, Any] = {"kind": "tcp", "port": LAB_PORT, "interval_s": 0.5, "timeout_s": 0.5,
                         "rise": 2, "fall": 3, "damping": {"enabled": False}}
# The probe's fall time plus the page's update path (events each second, polling every
# 2 s) and slack for a loaded 2-core host.
DOWN_WITHIN_S = PROBE["fall"] * PROBE["interval_s"] + PROBE["timeout_s"] + 15.0
STEP_TIMEOUT_S = 15.0


def _browser_missing() -> str | None:
    """Why the browser cannot run here, or None."""
    missing = [p for p in ("/usr/bin/chromium", "/usr/bin/chromedriver")
               if shutil.which(p) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed (Debian packages chromium and "
                "chromium-driver; bootstrap installs them)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed in this interpreter's environment"
    return None


@pytest.fixture(scope="module")
def browser_available() -> None:
    """Checked before the lab is built: a skip costs nothing, and CI never skips."""
    reason = _browser_missing()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the status page test needs a browser under CI: {reason}", pytrace=False)
    pytest.skip(reason)


class PageError(AssertionError):
    pass


class Page:
    """``page_driver.py`` in a lab namespace: one JSON command a line, one answer each."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc, self.log = proc, log
        self.ready = self._answer(60.0)

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if readable else ""
        if not line:
            self.proc.kill()
            raise PageError(f"the page driver gave no answer within {timeout}s "
                            f"(exit {self.proc.poll()}):\n{self._log_tail()}")
        answer: dict[str, Any] = json.loads(line)
        if not answer.get("ok"):
            raise PageError(f"page driver: {answer.get('error')}")
        return answer

    def _log_tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except OSError:
            return "(no driver log)"

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._answer(float(args.get("timeout", 0)) + 60.0)

    def wait(self, css: str, text: str | None = None, has_class: str | None = None,
             timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        return self("wait", css=css, text=text, has_class=has_class, timeout=timeout)

    def read(self, css: str) -> dict[str, Any]:
        return self("read", css=css)

    def cell(self, backend: str, field: str) -> str:
        return f'tr[data-backend="{backend}"] [data-field="{field}"]'

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self("quit")
                self.proc.wait(timeout=15)
        except (PageError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def lab(browser_available: None) -> Iterator[Lab]:
    with Lab(prefix=f"p{uuid.uuid4().hex[:6]}", backends=3,
             peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT)
        yield lab


@pytest.fixture(scope="module")
def appliance(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabAppliance]:
    with LabAppliance(lab, tmp_path_factory.mktemp("page-appliance"), WEIGHTS,
                      dataplane="xdp", probe=PROBE, api=True) as appliance:
        appliance.wait_status(lambda s: all((s.get("health") or {}).get(b, {}).get("up")
                                            for b in WEIGHTS), what="every backend up")
        yield appliance


@pytest.fixture(scope="module")
def page(lab: Lab, appliance: LabAppliance,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    """The browser in the client's namespace, the page loaded with the write token."""
    log = tmp_path_factory.mktemp("page-driver") / "driver.log"
    with open(log, "w") as err:
        proc = lab.popen("cli", [sys.executable, str(DRIVER)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=err)
    driver = Page(proc, log)
    try:
        print(f"browser: {driver.ready['ready']}")
        driver("open", url=f"{appliance.api_url}/")
        driver("token", token=appliance.write_token)
        driver.wait("body[data-ready='true']")
        yield driver
    finally:
        driver.close()


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    """Figures the tests measure on the way, written out by the last one."""
    return {}


def api(appliance: LabAppliance, method: str, path: str) -> Any:
    """The API's JSON answer to one request with the write token."""
    response = appliance.api(method, path)
    assert response.status_code == 200, f"{method} {path}: {response.text}"
    return response.json()


def wait_api(appliance: LabAppliance, path: str, predicate: Callable[[Any], bool],
             what: str, timeout: float = STEP_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        answer = api(appliance, "GET", path)
        if predicate(answer):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"API {path}: no {what} within {timeout}s; last: {answer}")
        time.sleep(0.2)


def state_is(backend: str, state: str, admin: str) -> str:
    """The state cell of ``backend`` once it shows that state and admin state."""
    return (f'tr[data-backend="{backend}"] [data-field="state"]'
            f'[data-state="{state}"][data-admin="{admin}"]')


def reload(page: Page, appliance: LabAppliance, query: str = "") -> None:
    """Load the page again; the token stays in the tab's sessionStorage."""
    page("open", url=f"{appliance.api_url}/{query}")
    page.wait("body[data-ready='true']")


def test_the_page_lists_the_vips_and_every_backend_up(page: Page,
                                                      appliance: LabAppliance) -> None:
    reload(page, appliance)
    for name in WEIGHTS:
        assert page.wait(page.cell(name, "health"), text="up")["text"] == "up"
        assert page.read(page.cell(name, "state"))["text"] == "up"
        assert "down" not in page.read(f'tr[data-backend="{name}"]')["classes"]
    assert page.read(page.cell("b3", "weight"))["text"].endswith(" / 2")  # live / configured
    vip = page.wait('tr[data-vip="lab-tcp"] [data-field="address"]')
    assert vip["text"] == f"{LAB_VIP}:{LAB_PORT}/tcp"
    assert page.read('tr[data-vip="lab-tcp"] [data-field="up"]')["text"] == "3 of 3"
    assert page.read("#appliance")["text"] == appliance.name
    assert page.wait("#transport", text="server-sent events")["found"]
    # A write token: the buttons are there.
    assert page.read('tr[data-backend="b1"] button[data-action="drain"]')["displayed"]
    errors = [m for m in page("console")["messages"] if m.get("level") == "SEVERE"]
    assert errors == []


def test_a_backend_whose_link_goes_down_is_shown_down(lab: Lab, page: Page,
                                                      appliance: LabAppliance,
                                                      figures: dict[str, Any]) -> None:
    reload(page, appliance)
    page.wait(page.cell("b2", "health"), text="up")
    lab.set_backend_link(2, up=False)
    try:
        shown = page.wait(page.cell("b2", "health"), text="down", has_class="down",
                          timeout=DOWN_WITHIN_S)
        figures["shown_down_after_link_down_s"] = shown["waited_s"]
        print(f"b2 shown down {shown['waited_s']} s after its link went down")
        assert shown["text"].startswith("down")
        assert "down" in page.read('tr[data-backend="b2"]')["classes"]
        assert page.wait(page.cell("b2", "state"), text="down")["found"]
        assert page.wait("#backends-up", text="2 of 3")["found"]
        backend = api(appliance, "GET", "/api/v1/backends/b2")
        assert backend["health"]["up"] is False and backend["state"] == "down"
        assert page.read(page.cell("b1", "health"))["text"] == "up"
    finally:
        lab.set_backend_link(2, up=True)
    # Back up, as the page shows it: the next tests start from three backends up.
    page.wait(page.cell("b2", "health"), text="up", timeout=DOWN_WITHIN_S)
    assert "down" not in page.read(page.cell("b2", "health"))["classes"]


def test_the_drain_button_drains_the_backend(page: Page, appliance: LabAppliance) -> None:
    reload(page, appliance)
    page("click", css='tr[data-backend="b1"] button[data-action="drain"]')
    try:
        # The page's own word first: a refusal shows here with the API's message.
        assert page.wait("#message", text="b1: drain done")["found"]
        wait_api(appliance, "/api/v1/backends/b1",
                 lambda b: b["admin_state"] == "draining" and b["state"] == "draining",
                 "b1 draining")
        assert page.wait(state_is("b1", "draining", "draining"))["text"] == "draining"
        assert page.read(
            'tr[data-backend="b1"] button[data-action="undrain"]')["displayed"]
        # Persisted: the configuration file says so.
        assert "draining" in appliance.config_path.read_text()
        page("click", css='tr[data-backend="b1"] button[data-action="undrain"]')
        wait_api(appliance, "/api/v1/backends/b1", lambda b: b["admin_state"] == "up",
                 "b1 up again")
        assert page.wait(state_is("b1", "up", "up"))["text"] == "up"
    finally:
        if api(appliance, "GET", "/api/v1/backends/b1")["admin_state"] != "up":
            api(appliance, "POST", "/api/v1/backends/b1/undrain")


def test_the_pin_button_pins_and_unpins_a_weight(page: Page, appliance: LabAppliance) -> None:
    reload(page, appliance)
    try:
        page("click", css='tr[data-backend="b3"] button[data-action="pin"]')
        page("fill", css="#pin-weight", value="0.5")
        page("fill", css="#pin-minutes", value="2")
        page("click", css='#pin-dialog button[data-action="pin-apply"]')
        assert page.wait("#message", text="b3: weight pinned at 0.5")["found"]
        b3 = wait_api(appliance, "/api/v1/backends/b3",
                      lambda b: b["weight"]["pinned"] is not None, "a pin on b3")
        assert b3["weight"]["pinned"]["weight"] == 0.5
        assert 60 < b3["weight"]["pinned"]["until"] - time.time() <= 120
        assert page.wait(page.cell("b3", "pin"), text="0.5 until",
                         has_class="pinned")["found"]
        assert page.wait(page.cell("b3", "weight"), text="0.5 / 2")["found"]
        page("click", css='tr[data-backend="b3"] button[data-action="pin"]')
        page("click", css='#pin-dialog button[data-action="unpin"]')
        wait_api(appliance, "/api/v1/backends/b3", lambda b: b["weight"]["pinned"] is None,
                 "b3 unpinned")
        assert page.wait(page.cell("b3", "pin"), text="\u2013")["found"]  # the page's "none"
    finally:
        if api(appliance, "GET", "/api/v1/backends/b3")["weight"]["pinned"] is not None:
            api(appliance, "DELETE", "/api/v1/backends/b3/pin")


def test_a_read_token_sees_the_page_and_cannot_drain(page: Page,
                                                     appliance: LabAppliance) -> None:
    reload(page, appliance)
    page("click", css="#forget")
    page("token", token=appliance.read_token)
    try:
        page.wait(page.cell("b3", "health"), text="up")
        drain = 'tr[data-backend="b3"] button[data-action="drain"]'
        if page.read(drain)["displayed"]:  # the role is learnt from the refusal
            page("click", css=drain)
            message = page.wait("#message", text="403")["text"]
            assert "write token" in message
        assert not page.read(drain)["displayed"]
        assert page.read("#role")["text"] == "read-only token"
        assert api(appliance, "GET", "/api/v1/backends/b3")["admin_state"] == "up"
    finally:
        page("click", css="#forget")
        page("token", token=appliance.write_token)
        page.wait("body[data-role='unknown'], body[data-role='write']")


# The text alternative of every plot on the page: {"<vip or backend>:<column>": label}.
PLOT_LABELS_JS = """
const out = {};
for (const c of document.querySelectorAll("canvas.plot")) {
  const tr = c.closest("tr");
  out[`${tr.dataset.vip || tr.dataset.backend}:${c.closest("td").dataset.field}`] =
    c.getAttribute("aria-label");
}
return out;
"""


def plot_peaks(page: Page) -> dict[str, str]:
    """Each plot's peak over its window, as its label words it ("0", "523", "1.2k", "40%")."""
    labels: dict[str, str] = page("script", js=PLOT_LABELS_JS)["result"]
    return {key: label.rsplit("peak ", 1)[-1] for key, label in labels.items()}


def test_new_flows_show_in_the_plots(lab: Lab, page: Page, appliance: LabAppliance) -> None:
    """Connections through the VIP: its packet rate and each serving backend's packet
    rate and share of new flows rise in the plots."""
    reload(page, appliance)
    report = lab.run_client(LAB_VIP, LAB_PORT, connections=300)
    assert report["failures"] == 0, report["errors"]
    wanted = ["lab-tcp:pps", *(f"{b}:{col}" for b in report["counts"] for col in ("pps", "share"))]
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        peaks = plot_peaks(page)
        flat = [k for k in wanted if peaks.get(k) in (None, "0", "0%")]
        if not flat:
            break
        assert time.monotonic() < deadline, f"plots still flat: {flat} of {peaks}"
        time.sleep(0.5)
    print(f"plot peaks after {report['counts']}: {peaks}")
    assert peaks["lab-udp:pps"] == "0"  # no UDP was sent


def test_the_page_keeps_updating_when_it_polls(page: Page, appliance: LabAppliance) -> None:
    """The fallback without server-sent events: a read every 2 s."""
    reload(page, appliance, "?transport=poll")
    assert page.wait("#transport", text="polling")["found"]
    first = page.read("#updated")["text"]
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while (now := page.read("#updated")["text"]) == first:
        assert time.monotonic() < deadline, f"the page's time stayed at {first}"
        time.sleep(0.5)
    assert now != first
    for name in WEIGHTS:
        assert page.read(page.cell(name, "health"))["text"] == "up"


def test_page_load_time_and_size_are_reported(page: Page, appliance: LabAppliance,
                                              tmp_path: Path, figures: dict[str, Any]) -> None:
    """Figures, not assertions: a cold load (HTTP cache off) with the token kept in
    the session, until the tables are filled. Every file comes from the appliance."""
    reload(page, appliance)
    time.sleep(1.0)  # the load event has passed: navigation timing is complete
    timing = page("timing")["timing"]
    resources = timing["resources"]
    assert all(r["name"].startswith(f"{appliance.api_url}/") for r in resources), resources
    assets = {Path(r["name"].split("?")[0]).name: r for r in resources
              if "/static/" in r["name"]}
    assert set(assets) == {"page.js", "page.css"}
    nav = timing["navigation"]
    files = {p.name: p.stat().st_size for p in sorted(STATIC.iterdir()) if p.is_file()}
    figures |= {
        "conditions": "headless Chromium in the lab's client namespace, the API on the "
                      "appliance's management address across the lab bridge (veth), "
                      "HTTP cache off, 3 backends, XDP data plane",
        "browser": page.ready["ready"],
        "load_event_end_ms": nav["load_event_end_ms"],
        "dom_content_loaded_ms": nav["dom_content_loaded_ms"],
        "tables_filled_ms": timing["first_render_ms"],
        "transfer_bytes": {"index.html": nav["transfer_bytes"],
                           **{name: r["transfer_bytes"] for name, r in assets.items()}},
        "body_bytes": {"index.html": nav["encoded_bytes"],
                       **{name: r["encoded_bytes"] for name, r in assets.items()}},
        "page_files_bytes": files,
        "page_files_total_bytes": sum(files.values()),
        "probe": PROBE,
    }
    figures["transfer_total_bytes"] = sum(figures["transfer_bytes"].values())
    out = tmp_path / "status_page.json"
    out.write_text(json.dumps(figures, indent=2))
    page("screenshot", path=str(tmp_path / "status_page.png"))  # for a human to look at
    print(f"status page figures ({out}):\n{json.dumps(figures, indent=2)}")
    assert figures["tables_filled_ms"] is not None and nav["load_event_end_ms"] > 0
