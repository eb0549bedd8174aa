"""The web dashboard in a real headless Chromium (Debian's), against a real daemon and real jobs.

Root watches an urgent job preempt its long job, then pauses and resumes that job by clicking,
and sees the page report a daemon restart and recover from it.
`nobody`, in a second browser context with its own token, sees root's job but has no buttons for
it, is refused its job page, and is refused a hand-made pause request. Screenshots of each step
land in the test's tmp dir (printed at the end; kept by pytest under its basetemp).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from webtools import CHROMIUM, CHROMIUM_ARGS, Web, start_web, why_no_browser

from gpuswap_testing import Gate, forever

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a token for a second user")


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    why = why_no_browser(CHROMIUM)
    if why:
        pytest.skip(f"BROWSER TESTS NOT RUN: {why}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class Page:
    """One signed-in browser tab, with screenshots numbered in the order they are taken."""

    def __init__(self, browser: Any, web: Web, token: str, shots: Path, who: str):
        self.ctx = browser.new_context(viewport={"width": 1400, "height": 900})
        self.page = self.ctx.new_page()
        self.page.set_default_timeout(30_000)
        self.shots, self.who, self.n = shots, who, 0
        self.page.goto(f"{web.url}/ui/#token={token}")

    def row(self, job_id: int) -> Any:
        return self.page.locator(f'#jobs tr[data-job-id="{job_id}"]')

    def expect_state(self, job_id: int, text: str) -> None:
        from playwright.sync_api import expect

        expect(self.row(job_id).locator(".state")).to_contain_text(text, timeout=60_000)

    def record_flashes(self) -> None:
        """From now on, keep every message #flash shows (until the page is left). An action's
        message fades after FADE_MS (5 s, app.js); a loaded machine's browser can look later than
        that, so the test asks whether it was shown, not whether it is still there."""
        self.page.evaluate("""() => {
            const f = document.querySelector("#flash");
            window.gsFlashes = [];
            new MutationObserver(() => { if (f.textContent) window.gsFlashes.push({text: f.textContent, cls: f.className}); })
                .observe(f, {childList: true, characterData: true, subtree: true, attributes: true});
        }""")

    def flashed(self, text: str) -> dict[str, str]:
        """The first recorded #flash message containing `text` ({text, cls}), once shown."""
        found = """(t) => (window.gsFlashes || []).find((m) => m.text.includes(t)) || null"""
        self.page.wait_for_function(found, arg=text, timeout=60_000)
        return self.page.evaluate(found, text)

    def shot(self, name: str) -> Path:
        self.n += 1
        path = self.shots / f"{self.who}-{self.n:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


def test_dashboard_preemption_actions_and_other_users(browser, make_daemon, home, tmp_path):
    from playwright.sync_api import expect

    web = start_web(make_daemon, "1x80GiB")
    d = web.daemon
    shots = tmp_path / "screenshots"
    shots.mkdir()
    # The long job holds at its last steps until cancelled (it must still be there at the end, however
    # slow the browser steps are); the urgent job keeps the GPU until the page has shown it there.
    long_id = d.submit(Gate(home / "never").train(home / "long.json", 4000, 0.02), name="long-train",
                       priority="low", mem="20GiB", time_limit_s=7200)
    d.until(long_id, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 5)

    root = Page(browser, web, web.token(), shots, "root")
    p = root.page
    assert "#token" not in p.url                     # the secret is dropped from the address bar
    expect(p.locator("#sim")).to_be_visible()
    expect(p.locator("#who")).to_contain_text("root")
    root.expect_state(long_id, "RUNNING")
    expect(p.locator('.gpu[data-gpu="0"]')).to_contain_text("simulated")
    expect(p.locator('.gpu[data-gpu="0"]')).to_contain_text(f"job {long_id}")
    root.shot("long-job-running")

    # An urgent job arrives: the page shows the long job parked in RAM and the urgent one on the GPU.
    urgent_gate = Gate(home / "urgent.go")
    urgent = d.submit(urgent_gate.hold("print('eval ok')"), name="urgent-eval", priority="urgent")
    root.expect_state(long_id, "PAUSED")
    expect(root.row(long_id).locator(".where")).to_have_text("parked in RAM")
    # What the park could not free (its simulated CUDA context, 512 MiB by default) stays on GPU 0.
    expect(root.row(long_id).locator(".parked")).to_contain_text("512 MiB stays on GPU 0")
    expect(p.locator(f'.gpu[data-gpu="0"] [data-gpu-residue="{long_id}"]')).to_contain_text(
        f"job {long_id} parked in RAM keeps 512 MiB")
    expect(root.row(urgent)).to_contain_text("urgent")
    # LEFT, as `ls` says it: the long job's 2 h --time less its run time; the urgent one has no estimate.
    expect(root.row(long_id).locator(".left")).to_have_text(re.compile(r"^1h( \d\dm)?$"))
    expect(root.row(urgent).locator(".left")).to_have_text("-")
    expect(p.locator('.gpu[data-gpu="0"]')).to_contain_text(f"job {urgent}")
    expect(p.locator("#ram-text")).to_have_text(re.compile(r"^[1-9][\d.]* \w+ parked of a .* budget"))
    # The policy's own reason, as `ls` and `top` show it: the urgent job holds the GPU it parked on.
    expect(root.row(long_id).locator(".reason .code")).to_have_text("Priority")
    expect(root.row(long_id).locator(".reason")).to_contain_text(
        f"GPU 0 held by job {urgent} (urgent, not preemptible by a lower priority)")
    root.shot("urgent-preempted-long")
    # Its job page says the same beside the parked size, and the park's event names the floor.
    p.goto(f"{web.url}/ui/#/job/{long_id}")
    expect(p.locator("#job-facts")).to_contain_text(re.compile(r"ram \(.+\); 512 MiB stays on GPU 0"))
    expect(p.locator("#job-facts")).to_contain_text(re.compile(r"2h from --time; 1h \d\dm left"))
    expect(p.locator("#job-events")).to_contain_text("512.0 MiB stays on GPU 0")
    p.goto(f"{web.url}/ui/#/")
    # A job page opened on its own (a link in a new tab: the overview is never drawn there) says
    # that its GPUs are simulated, in the header and on its GPUs line, as `gpuswap show` does.
    alone = root.ctx.new_page()
    alone.goto(f"{web.url}/ui/#/job/{urgent}&token={web.token()}")
    expect(alone.locator("#job-title")).to_contain_text("urgent-eval")
    expect(alone.locator("#overview")).to_be_hidden()
    expect(alone.locator("#sim")).to_be_visible()
    expect(alone.locator("#job-facts")).to_contain_text("assigned 0 (SIMULATED GPUs — no real GPU is in use)")
    alone.close()
    urgent_gate.open()

    # The urgent job ends; the long one resumes on its own. Then root pauses it by clicking.
    root.expect_state(urgent, "COMPLETED")
    root.expect_state(long_id, "RUNNING")
    root.record_flashes()
    root.row(long_id).locator('button[data-action="pause"]').click()
    assert root.flashed(f"job {long_id}: pause requested")
    root.expect_state(long_id, "(held)")
    expect(root.row(long_id).locator(".reason .code")).to_have_text("JobHeldUser")
    root.expect_state(long_id, "PAUSED")
    root.shot("paused-by-click")
    expect(p.locator("#flash")).to_be_hidden(timeout=60_000)     # an action's message fades
    assert d.job(long_id)["held"] is True
    root.row(long_id).locator('button[data-action="resume"]').click()
    root.expect_state(long_id, "RUNNING")
    assert d.job(long_id)["held"] is False

    # The daemon restarts: the page says it lost the daemon, and stops saying so once it answers.
    d.stop()
    expect(p.locator("#flash")).to_contain_text("lost the daemon", timeout=60_000)
    expect(p.locator("#live")).to_have_class(re.compile(r"\bstale\b"), timeout=60_000)
    root.shot("daemon-down")
    d.start()
    expect(p.locator("#flash")).to_be_hidden(timeout=60_000)
    expect(p.locator("#live")).not_to_have_class(re.compile(r"\bstale\b"), timeout=60_000)
    root.expect_state(long_id, "RUNNING")

    # The job page: event timeline and log tail.
    p.locator(f'#jobs tr[data-job-id="{long_id}"] a').click()
    expect(p.locator("#job-events")).to_contain_text("parked in RAM")
    expect(p.locator("#job-events")).to_contain_text("resume requested by root")
    expect(p.locator("#job-title")).to_contain_text("long-train")
    root.shot("job-page")
    p.goto(f"{web.url}/ui/#/job/{urgent}")
    expect(p.locator("#job-log")).to_contain_text("eval ok")     # the log tail
    expect(p.locator("#job-events")).to_contain_text("exited with code 0")
    p.goto(f"{web.url}/ui/#/")

    # Another user: sees root's job (owner, state) but cannot act on it in any way.
    other = Page(browser, web, web.token("nobody"), shots, "nobody")
    q = other.page
    with web.http(web.token("nobody")) as c:
        mine = c.post("/v1/jobs", json={"argv": forever(home), "cwd": "/tmp", "name": "nobodys-job",
                                        "env": {"PATH": "/usr/bin:/bin"}}).json()["id"]
    expect(q.locator("#who")).to_contain_text("nobody")
    # nobody's normal-priority job outranks root's low one: root's job is parked for it.
    other.expect_state(mine, "RUNNING")
    other.expect_state(long_id, "PAUSED")
    expect(other.row(long_id).locator(".where")).to_have_text("parked in RAM")
    expect(other.row(long_id).locator(".owner")).to_have_text("root")
    expect(other.row(long_id).locator("button")).to_have_count(0)
    expect(other.row(long_id)).to_contain_text("(other user)")
    expect(other.row(mine).locator('button[data-action="cancel"]')).to_be_visible()
    other.shot("other-users-view")
    q.goto(f"{web.url}/ui/#/job/{long_id}")
    expect(q.locator("#flash")).to_contain_text(f"cannot show job {long_id}: no job {long_id}")
    expect(q.locator("#job-actions button")).to_have_count(0)
    other.shot("other-users-job-refused")
    status = q.evaluate("""async (id) => (await fetch(`/v1/jobs/${id}/pause`, {method: "POST",
        headers: {Authorization: `Bearer ${sessionStorage.getItem("gpuswap.token")}`,
                  "Content-Type": "application/json"}, body: JSON.stringify({to: "ram"})})).status""", long_id)
    assert status == 404
    assert d.job(long_id)["held"] is False
    q.goto(f"{web.url}/ui/#/")
    other.row(mine).locator('button[data-action="cancel"]').click()
    other.expect_state(mine, "CANCELLED")
    other.expect_state(long_id, "RUNNING")       # root's job takes the GPU back
    other.shot("own-job-cancelled")

    # A bad token lands on the sign-in form with a visible message.
    bad = Page(browser, web, "gst_000000000000_" + "A" * 43, shots, "badtoken")
    expect(bad.page.locator("#login")).to_be_visible()
    expect(bad.page.locator("#flash")).to_contain_text("token was refused")
    bad.shot("refused")
    for pg in (root, other, bad):
        pg.ctx.close()
    d.cli("cancel", str(long_id))
    print(f"\nscreenshots: {shots}")
    assert len(list(shots.glob("*.png"))) == 9


XSS_NAME = '<img src=x onerror="window.__xss=1">'
XSS_ARG = '<svg onload="window.__xss=2"></svg><script>window.__xss=3</script>'


def test_dashboard_shows_user_text_as_text_and_runs_none_of_it(browser, make_daemon, tmp_path):
    """Job names, commands and log lines are other users' words: the page shows them verbatim and
    never parses them as HTML; and the CSP blocks inline script even where HTML does get in."""
    from playwright.sync_api import expect

    web = start_web(make_daemon, "1x80GiB")
    d = web.daemon
    shots = tmp_path / "screenshots"
    shots.mkdir()
    job = d.submit([sys.executable, "-c", "import sys, time; print(sys.argv[1], flush=True); time.sleep(300)",
                    XSS_ARG], name=XSS_NAME)
    d.until(job, lambda j: j["state"] == "RUNNING")
    pg = Page(browser, web, web.token(), shots, "xss")
    p = pg.page
    csp_errors: list[str] = []
    p.on("console", lambda m: csp_errors.append(m.text) if "Content Security Policy" in m.text else None)
    p.reload()                         # the token is in sessionStorage now; watch the page's own load
    pg.expect_state(job, "RUNNING")
    assert p.evaluate("document.querySelector('#ram .bar > span').style.width").endswith("%")
    expect(pg.row(job).locator("a")).to_have_text(XSS_NAME)
    expect(p.locator("#overview img, #overview svg, #overview script")).to_have_count(0)
    pg.shot("overview")
    pg.row(job).locator("a").click()
    expect(p.locator("#job-title")).to_contain_text(XSS_NAME)
    expect(p.locator("#job-facts")).to_contain_text(XSS_ARG)          # the command
    expect(p.locator("#job-log")).to_contain_text(XSS_ARG)            # the log tail
    expect(p.locator("#jobpage img, #jobpage svg, #jobpage script")).to_have_count(0)
    pg.shot("job-page")
    assert p.evaluate("typeof window.__xss") == "undefined"
    assert not csp_errors, csp_errors  # the page itself needs nothing the CSP forbids

    # Defence in depth: HTML forced into the page still runs no inline handler (CSP script-src 'self').
    p.evaluate("""() => {
        document.addEventListener("securitypolicyviolation", (e) => { window.__csp = e.effectiveDirective; });
        document.body.insertAdjacentHTML("beforeend", '<img id="probe" src="x" onerror="window.__xss=4">');
    }""")
    # (wait_for_function would evaluate a string inside the page, which this very CSP forbids)
    for _ in range(300):
        if p.evaluate("window.__csp !== undefined && document.getElementById('probe').complete"):
            break
        p.wait_for_timeout(100)
    assert p.evaluate("window.__csp").startswith("script-src")
    assert p.evaluate("typeof window.__xss") == "undefined"
    assert csp_errors                  # and the console listener above does see violations
    pg.ctx.close()
    d.cli("cancel", str(job))


def test_dashboard_refused_pause_shows_the_reason(browser, make_daemon, tmp_path):
    """A pause the daemon refuses (409 with a reason) is reported as refused, with that reason,
    never as 'pause requested'."""
    from playwright.sync_api import expect

    web = start_web(make_daemon, "1x80GiB", "--pause-timeout", "1")
    d = web.daemon
    shots = tmp_path / "screenshots"
    shots.mkdir()
    # No gpuswap runtime and cooperative parking only: the first pause times out and leaves it
    # running, after which every pause is refused.
    job = d.submit(forever(d.home), name="no-runtime", pause_mode="cooperative")   # cancelled at the end
    d.state(job, "RUNNING")
    pg = Page(browser, web, web.token(), shots, "refused")
    p = pg.page
    pg.expect_state(job, "RUNNING")
    pg.record_flashes()
    pg.row(job).locator('button[data-action="pause"]').click()
    assert pg.flashed(f"job {job}: pause requested — now PAUSING")
    d.until(job, lambda j: any("cannot park" in e["reason"] for e in j["events"]))
    expect(p.locator("#flash")).to_be_hidden(timeout=60_000)
    pause = pg.row(job).locator('button[data-action="pause"]')
    expect(pause).to_be_visible()
    pg.record_flashes()
    pause.click()
    refused = pg.flashed(f"cannot pause job {job}: job {job} cannot be parked")
    assert "no safepoint" in refused["text"] and "requested" not in refused["text"], refused
    assert "ok" not in refused["cls"].split(), refused
    assert not [m for m in p.evaluate("window.gsFlashes") if "requested" in m["text"]]   # never said otherwise
    pg.shot("pause-refused")
    assert d.job(job)["state"] == "RUNNING" and d.job(job)["held"] is False
    pg.ctx.close()
    d.cli("cancel", str(job))


def test_dashboard_header_durations_icon_job_links_and_frozen_jobs(browser, make_daemon, tmp_path):
    """Issue 11 item 9: the admin's header reads "root admin"; the half-life reads "7 days"; the
    page's icon is served (CSP 'self'); a job link that carries a token opens that job's page; a
    driver-frozen job parked in RAM shows its parked size as such, never "-"."""
    from playwright.sync_api import expect

    web = start_web(make_daemon, "1x80GiB")
    d = web.daemon
    shots = tmp_path / "screenshots"
    shots.mkdir()
    # No runtime and no --mem: a (simulated) CUDA process holding 1 GiB whose memory NVML does not
    # report (usedGpuMemory unavailable), frozen by the driver without a measured footprint.
    ready = tmp_path / "cuda-ready"
    frozen = d.submit([sys.executable, "-c", "import sys, time; from gpuswap import simcuda; "
                       "simcuda.allocate(2**30, usage_reported=False); "
                       "open(sys.argv[1], 'w').close(); time.sleep(600)", str(ready)],
                      name="frozen", pause_mode="transparent")
    d.until(frozen, lambda j: ready.exists())
    d.client.post(f"/v1/jobs/{frozen}/pause", {"to": "ram"})
    j = d.until(frozen, lambda j: j["state"] == "PAUSED")
    assert j["parked"] == "ram" and j["mechanism"] == "transparent" and j["parked_bytes"] == 0

    pg = Page(browser, web, web.token(), shots, "edges")
    p = pg.page
    expect(p.locator("#who")).to_have_text("root admin")
    expect(p.locator("#who .badge.admin")).to_have_text("admin")
    expect(p.locator("#fair-hint")).to_contain_text("half-life of 7 days;")
    pg.expect_state(frozen, "PAUSED")
    expect(pg.row(frozen).locator(".where")).to_have_text("parked in RAM")
    parked = pg.row(frozen).locator("td.parked")
    expect(parked).to_have_text("size unknown")
    pg.shot("overview")

    icon = p.evaluate("document.querySelector('link[rel~=icon]')?.href ?? new URL('/favicon.ico', location).href")
    r = p.request.get(icon)
    assert r.status == 200 and r.headers["content-type"].startswith("image/"), (icon, r.status)

    # A job link with the token in it, in a fresh tab: the job's page, and no secret left in the URL.
    ctx = browser.new_context()
    q = ctx.new_page()
    q.goto(f"{web.url}/ui/#/job/{frozen}&token={web.token()}")
    expect(q.locator("#job-title")).to_contain_text("frozen", timeout=30_000)
    expect(q.locator("#jobpage")).to_be_visible()
    assert q.url.endswith(f"/ui/#/job/{frozen}"), q.url
    ctx.close()
    pg.ctx.close()
    d.cli("cancel", str(frozen))
