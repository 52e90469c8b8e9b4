"""Take the README's screenshot: the playground answering about an image and a sound.

    python scripts/screenshot_playground.py                  # -> docs/playground.png

Starts `omniserve serve` (the default model) on a free port, opens the playground in headless
Chromium (Debian's chromium and chromium-driver, as the browser tests use), attaches a demo
image and sound, asks what it sees and hears, and saves the page once the answer is done.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from bench_serving import RunningServer, ServerSpec

from omniserve.demo_model.tasks import make_example

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "playground.png")
    parser.add_argument("--seed", type=int, default=1, help="the demo example's seed")
    parser.add_argument("--index", type=int, default=0, help="the demo example's index")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        raise SystemExit("needs Debian's chromium and chromium-driver (apt-get install)")
    example = make_example(args.seed, args.index, "image_audio")
    work = Path(tempfile.mkdtemp(prefix="screenshot-"))
    (work / "shapes.png").write_bytes(example.image or b"")
    (work / "beeps.wav").write_bytes(example.audio or b"")
    command = [sys.executable, "-m", "omniserve.entrypoints.cli", "serve", "--port", "{port}"]
    server = RunningServer(ServerSpec("omniserve", command, "", {}), work)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--window-size=1200,760",
        "--hide-scrollbars",
    ):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        server.wait_ready()
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 60, poll_frequency=0.1)
        wait.until(lambda b: not b.find_element(By.ID, "send").get_attribute("disabled"))
        browser.find_element(By.ID, "attach").send_keys(
            f"{work / 'shapes.png'}\n{work / 'beeps.wav'}"
        )
        browser.find_element(By.ID, "prompt").send_keys("What do you see and hear?")
        browser.find_element(By.ID, "send").click()
        wait.until(
            lambda b: b.execute_script(
                "return document.querySelector('#chat .message:last-child')?.dataset.done"
                " === 'true';"
            )
        )
        answer = browser.find_element(By.CSS_SELECTOR, "#chat .message:last-child .body").text
        args.out.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(args.out))
        verdict = "correct" if example.is_correct(answer) else f"expected {example.answer!r}"
        print(f"{args.out}: answered {answer!r} ({verdict})")
    finally:
        browser.quit()
        server.stop()


if __name__ == "__main__":
    main()
