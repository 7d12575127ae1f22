"""The live KV-cache dashboard in a real headless browser (Debian's chromium, driven by selenium):
while a request with n=4 and a beam search run, the page's grid shows shared blocks of both;
once they finish, every block is free or kept for the prefix cache. The page sits behind the
API key, which the browser brings as `?api_key=`. A screenshot goes to results/dashboard.png."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedllm.cli import build_parser
from pagedllm.engine.engine_core import EngineCore
from tests.server.common import SERVE_FLAGS, start_server_thread

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
KEY = "dashboard-test-key"
RESULTS = Path(__file__).resolve().parents[2] / "results"
# Long prompts (two full blocks of 16 shared by every sample or beam; a different one for each
# request, so that neither takes the other's from the prefix cache) and long outputs, so that
# both requests run for several of the page's half-second updates.
PROMPTS = {"samples": list(range(100, 140)), "beams": list(range(200, 240))}
FLAGS = ["--max-model-len", "1024", "--block-size", "16", "--num-gpu-blocks", "160", "--api-key", KEY]



# The tiny model decodes a step in about a millisecond: both requests would end within one or two
# of the page's half-second updates, and the page could miss one of them. Each step of this
# module's engine is made to last at least this long, so both run together for several updates.
STEP_FLOOR_S = 0.01


@pytest.fixture(scope="module")
def server_url(tiny_llama):
    step = EngineCore.step

    def paced_step(self, *args, **kwargs):
        start = time.monotonic()
        result = step(self, *args, **kwargs)
        time.sleep(max(0.0, STEP_FLOOR_S - (time.monotonic() - start)))
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineCore, "step", paced_step)
        args = build_parser().parse_args(["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS, *FLAGS])
        server, thread, url = start_server_thread(args)
        yield url
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no chromium and chromedriver on PATH: `make setup` installs them with apt-get when run as "
                    "root (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1100"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


def test_the_dashboard_and_its_json_want_the_api_key(server_url):
    assert httpx.get(server_url + "/dashboard").status_code == 401
    assert httpx.get(server_url + "/debug/kv").status_code == 401
    page = httpx.get(server_url + "/dashboard", params={"api_key": KEY})
    assert page.status_code == 200 and "device-grid" in page.text
    # The cookie the page set admits its event stream without the key in the address.
    assert httpx.get(server_url + "/debug/kv", cookies=page.cookies).status_code == 200
    kv = httpx.get(server_url + "/debug/kv", headers={"authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert kv["kv"]["device"]["num_blocks"] == 160 and kv["kv"]["block_size"] == 16


def test_debug_kv_folds_the_grid_to_max_cells_and_refuses_a_bad_one(server_url):
    auth = {"authorization": f"Bearer {KEY}"}
    folded = httpx.get(server_url + "/debug/kv", params={"max_cells": 10}, headers=auth, timeout=30).json()
    assert folded["kv"]["device"]["blocks_per_cell"] == 16  # 160 blocks in 10 cells
    bad = httpx.get(server_url + "/debug/kv", params={"max_cells": 0}, headers=auth)
    assert bad.status_code == 400 and "max_cells" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "max_cells"  # the query parameter's own name


def _complete(server_url: str, body: dict, results: list) -> None:
    body = {"model": "tiny", "ignore_eos": True, **body}
    response = httpx.post(server_url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=300)
    results.append(response)


def _grid(driver) -> list[dict]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#device-grid .cell')].map(c => "
        "({state: c.dataset.state, shared: c.dataset.shared, owner: c.dataset.owner}));"
    )


def _screenshot(driver) -> None:
    driver.execute_script("document.querySelector('#requests li')?.click()")
    time.sleep(0.6)  # one more update, with the request's block tables open
    RESULTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(RESULTS / "dashboard.png"))


def test_shared_blocks_show_while_samples_and_beams_run_and_all_are_free_after(server_url, browser):
    browser.get(server_url + f"/dashboard?api_key={KEY}")
    deadline = time.monotonic() + 30
    while browser.execute_script("return document.querySelectorAll('#device-grid .cell').length") != 160:
        assert time.monotonic() < deadline, "the page drew no grid of 160 blocks"
        time.sleep(0.1)

    results: list[httpx.Response] = []
    requests = [
        {"prompt": PROMPTS["samples"], "n": 4, "temperature": 1.0, "seed": 1, "max_tokens": 400},
        {"prompt": PROMPTS["beams"], "n": 3, "use_beam_search": True, "temperature": 0, "max_tokens": 300},
    ]
    threads = [threading.Thread(target=_complete, args=(server_url, body, results)) for body in requests]
    for thread in threads:
        thread.start()
    shared_owners: set[str] = set()
    screenshot_taken = False
    while any(t.is_alive() for t in threads):
        shared_now = {c["owner"] for c in _grid(browser) if c["shared"] == "1" and c["state"] == "held"}
        shared_owners |= shared_now
        if len(shared_now) >= 2 and not screenshot_taken:  # both requests on screen, sharing
            _screenshot(browser)
            screenshot_taken = True
        time.sleep(0.1)
    for thread in threads:
        thread.join()
    if not screenshot_taken:
        _screenshot(browser)

    assert [r.status_code for r in results] == [200, 200], [r.text[:300] for r in results]
    assert sorted(len(r.json()["choices"]) for r in results) == [3, 4]
    # Both requests (the samples and the beams) showed blocks with a reference count above 1.
    assert len(shared_owners) >= 2, shared_owners
    assert (RESULTS / "dashboard.png").stat().st_size > 10_000

    deadline = time.monotonic() + 30
    while True:
        states = {c["state"] for c in _grid(browser)}
        if states <= {"free", "cached"}:
            break
        assert time.monotonic() < deadline, f"blocks still shown held after both requests finished: {states}"
        time.sleep(0.2)
    assert "cached" in states  # the finished prompts' full blocks stay in the prefix cache
    assert browser.find_element("css selector", "#requests").text == "no requests"
