"""The web playground at ``/`` in headless Chromium (Debian's chromium and chromium-driver,
driven by Selenium; the README's test command installs them): it loads with no console errors,
asks for the API key and takes it, streams a text turn, answers a turn with an image and a sound
showing the usage the API reports for the same content, and shows the server's error for a
broken file. ``--no-playground`` leaves it out.
"""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from omniserve.demo_model.tasks import make_example
from tests.server_utils import API_KEY, MODEL, launch_server

WAIT_S = 60


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip(
            "no headless browser: Debian's chromium and chromium-driver are not "
            "installed (the README's test command installs them with apt-get)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    session = webdriver.Chrome(service=Service(driver), options=options)
    session.set_script_timeout(WAIT_S)
    try:
        yield session
    finally:
        session.quit()


def _wait(browser: Any, script: str) -> Any:
    """Poll ``script`` (a JS expression) until it is truthy; its value."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(
        lambda b: b.execute_script(f"return {script};")
    )


def _console_errors(browser: Any) -> list[str]:
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def _ask(browser: Any, text: str) -> Any:
    """Type ``text``, send it, and return the finished (or failed) reply."""
    from selenium.webdriver.common.by import By

    before = len(browser.find_elements(By.CSS_SELECTOR, "#chat .message"))
    browser.find_element(By.ID, "prompt").send_keys(text)
    browser.find_element(By.ID, "send").click()
    _wait(
        browser,
        "document.querySelector('#chat .message:last-child')?.dataset.done === 'true'"
        " || document.querySelector('#chat .message:last-child')?.dataset.role"
        " === 'error'",
    )
    messages = browser.find_elements(By.CSS_SELECTOR, "#chat .message")
    assert len(messages) > before
    return messages[-1]


def _data_url(path: Path, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(path.read_bytes()).decode()}"


def test_playground_in_a_browser(default_server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    server = default_server
    browser.get(server.url + "/")
    # No key yet: the page says so (with no failed request in the console), then takes it.
    _wait(browser, "document.getElementById('model').textContent.includes('API key')")
    assert browser.find_element(By.ID, "send").get_attribute("disabled") is not None
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    browser.find_element(By.ID, "save-key").click()
    _wait(browser, f"document.getElementById('model').textContent === '{MODEL}'")
    limits = browser.find_element(By.ID, "limits").text
    assert "max_model_len 1024" in limits and "image" in limits and "audio" in limits

    # A text turn streams: the reply's text changes several times before it is done.
    browser.execute_script("""
        window.updates = 0;
        new MutationObserver((records) => {
          for (const r of records) for (const n of r.addedNodes)
            if (n.classList && n.classList.contains('assistant'))
              new MutationObserver(() => window.updates++).observe(
                n.querySelector('.body'), {childList: true, characterData: true, subtree: true});
        }).observe(document.getElementById('chat'), {childList: true});""")
    browser.execute_script(
        "document.getElementById('temperature').value = '0';"
        "document.getElementById('max_tokens').value = '12';"
    )
    reply = _ask(browser, "Hello there")
    assert reply.get_attribute("data-role") == "assistant"
    assert reply.find_element(By.CSS_SELECTOR, ".body").text
    assert browser.execute_script("return window.updates;") >= 2
    usage = reply.find_element(By.CSS_SELECTOR, ".usage")
    assert usage.get_attribute("data-completion") == "12" and "tokens/s" in usage.text

    # An image and a sound (a held-out demo example): the page shows the answer and the usage
    # the API gives for the same content, and the demo model answers it right.
    browser.find_element(By.ID, "clear").click()
    browser.execute_script("document.getElementById('max_tokens').value = '64';")
    example = next(
        e
        for i in range(50)
        if (e := make_example(7, i, "image_audio")).question == "What do you see and hear?"
    )
    image, sound = tmp_path / "shapes.png", tmp_path / "beeps.wav"
    image.write_bytes(example.image or b"")
    sound.write_bytes(example.audio or b"")
    browser.find_element(By.ID, "attach").send_keys(f"{image}\n{sound}")
    _wait(browser, "document.querySelectorAll('#attachments .chip').length === 2")
    reply = _ask(browser, example.question)
    assert reply.get_attribute("data-role") == "assistant", reply.text
    usage = reply.find_element(By.CSS_SELECTOR, ".usage")
    api = server.client().chat.completions.create(
        model=MODEL,
        max_tokens=64,
        temperature=0.0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(image, "image/png")}},
                    {"type": "audio_url", "audio_url": {"url": _data_url(sound, "audio/wav")}},
                    {"type": "text", "text": example.question},
                ],
            }
        ],
    )
    answer = reply.find_element(By.CSS_SELECTOR, ".body").text
    assert answer == api.choices[0].message.content and example.is_correct(answer), answer
    expected = api.usage
    assert int(usage.get_attribute("data-prompt")) == expected.prompt_tokens
    assert int(usage.get_attribute("data-image")) == expected.prompt_tokens_details.image_tokens
    assert int(usage.get_attribute("data-audio")) == expected.prompt_tokens_details.audio_tokens
    assert expected.prompt_tokens_details.image_tokens > 0
    assert expected.prompt_tokens_details.audio_tokens > 0

    assert _console_errors(browser) == []

    # A broken image: the server's 400 (which names the part and the stage) is shown as is.
    browser.find_element(By.ID, "clear").click()
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image at all")
    browser.find_element(By.ID, "attach").send_keys(str(broken))
    _wait(browser, "document.querySelectorAll('#attachments .chip').length === 1")
    reply = _ask(browser, "And this?")
    assert reply.get_attribute("data-role") == "error"
    refused = server.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _data_url(broken, "image/png")}},
                        {"type": "text", "text": "And this?"},
                    ],
                }
            ],
        },
    )
    assert refused.status_code == 400
    assert reply.text == refused.json()["error"]["message"]
    assert "messages[0].content[0]: image decode error" in reply.text
    (logged,) = _console_errors(browser)  # the browser's own note of the 400, nothing else
    assert "/v1/chat/completions" in logged and "400" in logged


@pytest.mark.slow
def test_playground_assets_and_opt_out(default_server, tmp_path):
    page = httpx.get(default_server.url + "/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/playground/playground.js" in page.text and "https://" not in page.text
    for asset, media_type in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        response = httpx.get(f"{default_server.url}/playground/{asset}", timeout=10)
        assert response.status_code == 200 and media_type in response.headers["content-type"]
        assert "https://" not in response.text  # nothing from a CDN
    assert httpx.get(default_server.url + "/playground/nope.js", timeout=10).status_code == 404
    info = httpx.get(default_server.url + "/playground/info", timeout=10).json()
    assert info == {"api_key_required": True}  # nothing about the model without the key
    info = httpx.get(
        default_server.url + "/playground/info",
        timeout=10,
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert info["model"] == MODEL and info["max_model_len"] == 1024 and info["voices"] == []
    assert set(info["media"]) == {"image", "audio", "video"}
    with launch_server(
        None,
        tmp_path,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "8MiB",
        "--no-playground",
    ) as bare:
        assert httpx.get(bare.url + "/", timeout=10).status_code == 404
        assert httpx.get(bare.url + "/playground/info", timeout=10).status_code == 404
