"""The web page (GET /) in headless Chromium, Debian's `chromium` and `chromium-driver` packages (nothing is downloaded
at run time): type a prompt, submit, watch the job's progress, and see the finished video play; a screenshot of the
page is saved beside the test's files and the page state is checked."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from distvideo.models.embedded import GENERIC_EXAMPLE_PROMPT, IMAGE_EXAMPLE_PROMPT
from distvideo.testing.lora_files import build_random_lora
from family_checkpoints import family_checkpoint, test_image

from serving_harness import start_server

INSTALL = "apt-get install -y chromium chromium-driver (or: bash scripts/install_system_deps.sh, as root)"


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
    )
    if browser is None or driver is None:
        pytest.fail(
            f"headless Chromium is missing (browser: {browser}, driver: {driver}); install: {INSTALL}", pytrace=False
        )
    return browser, driver


@pytest.fixture
def browser(monkeypatch):
    pytest.importorskip("selenium", reason="selenium is in the 'test' extra: run `make setup`")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = chromium_paths()
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must not look for a driver online
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1100,900",
    ):
        options.add_argument(flag)
    options.add_argument("--autoplay-policy=no-user-gesture-required")
    chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def poll(fn, what: str, timeout: float = 300.0):
    """fn() until it returns something truthy (a deadline, not a delay)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g} s")
        time.sleep(0.1)


def row_state(browser, job_id: str):
    return browser.execute_script(
        "const r = document.querySelector(`#jobs tr[data-id='${arguments[0]}']`);"
        "return r ? {status: r.dataset.status, text: r.querySelector('.status').textContent,"
        " progress: r.querySelector('progress').value} : null;",
        job_id,
    )


@pytest.mark.slow
def test_the_page_submits_a_prompt_shows_progress_and_plays_the_video(tmp_path, browser):
    """A long job submitted through the API holds the engine (it ends only when cancelled), so the page's job list
    shows its progress whatever the machine's speed; its Delete button cancels it; then the prompt typed into the
    page runs and its video plays."""
    from selenium.webdriver.common.by import By

    with start_server(tmp_path, "inline") as server:
        long = server.create(prompt="a long ride", size="48x32", num_frames=5, num_inference_steps=900)
        browser.get(server.url + "/")
        poll(lambda: "tiny-wan" in browser.find_element(By.ID, "model").text, "the model line")
        # a text-to-video model without adapters: a scene as the placeholder, no image or adapter fields
        assert browser.find_element(By.ID, "prompt").get_attribute("placeholder") == GENERIC_EXAMPLE_PROMPT
        assert not browser.find_element(By.ID, "image_field").is_displayed()
        assert not browser.find_element(By.ID, "lora_field").is_displayed()
        browser.find_element(By.ID, "prompt").send_keys("a paper boat on a pond")
        browser.find_element(By.ID, "size").send_keys("64x48")
        browser.find_element(By.ID, "num_frames").send_keys("9")
        browser.find_element(By.ID, "num_inference_steps").send_keys("4")
        browser.find_element(By.ID, "submit").click()

        def new_row_id() -> str | None:  # the list refreshes on its own clock: wait for the submitted job's row
            ids = [r.get_attribute("data-id") for r in browser.find_elements(By.CSS_SELECTOR, "#jobs tr[data-id]")]
            return next((i for i in ids if i != long["id"]), None)

        job_id = poll(new_row_id, "the submitted job's row")
        assert server.get(job_id)["prompt"] == "a paper boat on a pond"  # the page made the job the API holds
        assert server.get(job_id)["status"] == "queued"  # behind the long job

        def long_progress() -> dict | None:
            state = row_state(browser, long["id"])
            return state if state and state["status"] == "in_progress" and state["progress"] >= 1 else None

        shown = poll(long_progress, "the long job's progress on the page")
        # the step comes from the job's event stream (GET /v1/videos/{id}/events), which the page follows
        assert 1 <= shown["progress"] <= 99 and re.fullmatch(r"in_progress \(step \d+ of 900\)", shown["text"]), shown
        browser.find_element(By.CSS_SELECTOR, f"#jobs tr[data-id='{long['id']}'] button.delete").click()
        cancelled = poll(
            lambda: (row_state(browser, long["id"]) or {}).get("status") == "failed" and row_state(browser, long["id"]),
            "the cancelled job on the page",
        )
        assert "cancelled by a DELETE request" in cancelled["text"], cancelled
        assert server.wait(job_id)["status"] == "completed"
        state = poll(
            lambda: browser.execute_script(
                "const v = document.querySelector(`video[data-id='${arguments[0]}']`);"
                "return v && v.readyState >= 2 && v.currentTime > 0 ? "
                "{w: v.videoWidth, h: v.videoHeight, d: v.duration, t: v.currentTime, error: v.error && v.error.code,"
                " status: v.closest('tr').dataset.status, bar: v.closest('tr').querySelector('progress').value} : null;",
                job_id,
            ),
            "the video playing",
        )
        screenshot = tmp_path / "page.png"
        browser.save_screenshot(str(screenshot))
    assert state["w"] == 64 and state["h"] == 48 and state["error"] is None, state
    assert state["d"] == pytest.approx(9 / 16, abs=0.07) and state["t"] > 0, state
    assert state["status"] == "completed" and state["bar"] == 100, state
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000


@pytest.mark.slow
def test_the_page_sends_an_image_a_negative_prompt_guidance_and_an_adapter(tmp_path, tmp_path_factory, browser):
    """An image-to-video model served with an adapter: the page shows the image field and the adapters, and the job
    it submits (multipart, with the image) carries every field the form had."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    model = family_checkpoint(tmp_path_factory, "wan21_i2v")
    style = build_random_lora(model, tmp_path / "style.safetensors", seed=5)
    args = ["--model", str(model), "--lora-adapter", f"style={style}"]
    with start_server(tmp_path, "inline", args=args) as server:
        browser.get(server.url + "/")
        poll(lambda: "WanImageToVideoPipeline" in browser.find_element(By.ID, "model").text, "the model line")
        assert browser.find_element(By.ID, "prompt").get_attribute("placeholder") == IMAGE_EXAMPLE_PROMPT
        assert browser.find_element(By.ID, "image_field").is_displayed()
        adapters = Select(browser.find_element(By.ID, "lora"))
        assert [o.get_attribute("value") for o in adapters.options] == ["", "style"]
        browser.find_element(By.ID, "prompt").send_keys("a paper boat drifts")
        browser.find_element(By.ID, "negative_prompt").send_keys("blurry")
        browser.find_element(By.ID, "input_reference").send_keys(str(test_image(tmp_path_factory, seed=1)))
        for name, value in (("size", "32x32"), ("num_frames", "5"), ("num_inference_steps", "2")):
            browser.find_element(By.ID, name).send_keys(value)
        browser.find_element(By.ID, "guidance_scale").send_keys("3.5")
        adapters.select_by_value("style")
        strength = browser.find_element(By.ID, "lora_strength")
        strength.clear()
        strength.send_keys("0.5")
        browser.find_element(By.ID, "submit").click()
        job_id = poll(
            lambda: next(
                (r.get_attribute("data-id") for r in browser.find_elements(By.CSS_SELECTOR, "#jobs tr[data-id]")), None
            ),
            "the submitted job's row",
        )
        job = server.wait(job_id)
        message = browser.find_element(By.ID, "message").text
    assert job["status"] == "completed", (job, message)
    assert job["prompt"] == "a paper boat drifts" and job["negative_prompt"] == "blurry", job
    assert job["guidance_scale"] == 3.5 and job["size"] == "32x32" and job["num_frames"] == 5, job
    assert job["lora"] == {"name": "style", "strength": 0.5}, job
