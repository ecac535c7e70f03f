"""The playground page (GET /) in headless Chromium: a prompt streams in, tokens coloured by origin.

Needs Debian's ``chromium`` and ``chromium-driver`` packages (CI installs them; nothing downloads a
browser). Selenium is pointed at them, so its driver manager never fetches anything.
"""
from __future__ import annotations

import shutil

import pytest

from test_server import Served, _gen, folder  # noqa: F401  (the module's tiny model folder fixture)

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs Debian's chromium and chromium-driver: apt-get install chromium chromium-driver")


def test_playground_streams_coloured_tokens_and_stats(folder, tmp_path):  # noqa: F811
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    served = Served(_gen(folder))
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1000,900"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        prompt = "w20 w21 w22 w20 w21 w22 w20 w21"
        browser.get(served.url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda b: b.find_element(By.ID, "model").get_attribute("value") == "tiny")
        box = browser.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys(prompt)
        for field, value in (("temperature", "0"), ("max_tokens", "40")):
            el = browser.find_element(By.ID, field)
            el.clear()
            el.send_keys(value)
        browser.find_element(By.ID, "run").click()
        wait.until(lambda b: "α" in b.find_element(By.ID, "stats").text)
        answer = browser.find_element(By.ID, "answer")
        drafted = answer.find_elements(By.CSS_SELECTOR, "span.draft")
        own = answer.find_elements(By.CSS_SELECTOR, "span.target")
        assert drafted and own, browser.find_element(By.ID, "error").text
        assert "tokens/s" in browser.find_element(By.ID, "stats").text
        expected = served.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0)
        text = browser.execute_script("return document.getElementById('answer').textContent")
        assert text == expected.choices[0].message.content
        browser.save_screenshot(str(tmp_path / "playground.png"))
        browser.find_element(By.ID, "plain").click()  # the same prompt with speculation off
        wait.until(lambda b: "plain decoding" in b.find_element(By.ID, "stats").text
                   and "α" in b.find_element(By.ID, "stats").text)
        assert not answer.find_elements(By.CSS_SELECTOR, "span.draft")
        assert browser.execute_script("return document.getElementById('answer').textContent") == text
        browser.save_screenshot(str(tmp_path / "playground-plain.png"))
        print(f"\nplayground screenshots: {tmp_path}")
    finally:
        browser.quit()
        served.close()
