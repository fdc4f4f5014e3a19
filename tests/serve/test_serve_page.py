"""The chat page at / in a real headless Chromium (Debian's chromium and chromium-driver, driven by selenium with
the system chromedriver): it loads, a message gets the greedy reply the API gives, a reply holding <script> shows
as text, and Stop stops a stream."""
import shutil
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
webdriver = pytest.importorskip("selenium.webdriver")
from serving_folders import RunningServer, make_folder, make_scripted_folder  # noqa: E402

CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(not (CHROMEDRIVER and CHROMIUM), reason=(
    "no system Chromium: apt-get install -y chromium chromium-driver (.ci/run does) to run the chat page tests"))

SCRIPT = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _wait(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def _send(browser, text, temperature="0", max_tokens="60"):
    from selenium.webdriver.common.by import By

    for field, value in (("temperature", temperature), ("max-tokens", max_tokens)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "prompt").send_keys(text)
    browser.find_element(By.ID, "send").click()
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant"))
    return browser.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]


def test_page_reply_equals_the_api_and_markup_shows_as_text(browser, tmp_path):
    import openai
    from selenium.webdriver.common.by import By

    messages = [{"role": "user", "content": "hi"}]
    folder = make_scripted_folder(tmp_path / "scripted", messages, SCRIPT + " & <b>bold</b>")
    with RunningServer(folder) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="m", messages=messages, temperature=0, max_tokens=60).choices[0].message.content
        assert api == SCRIPT + " & <b>bold</b>"
        browser.get(server.url + "/")
        assert browser.title == "lmkit chat"
        _wait(lambda: browser.find_element(By.ID, "model").text == "scripted")
        reply = _send(browser, "hi")
        _wait(lambda: reply.get_attribute("data-done") == "true")
        assert reply.text == api  # shown as text: the markup is visible, not parsed
        assert not reply.find_elements(By.TAG_NAME, "script") and not reply.find_elements(By.TAG_NAME, "b")
        assert "tokens/s" in browser.find_element(By.ID, "speed").text
        browser.find_element(By.ID, "new-chat").click()
        assert not browser.find_elements(By.CSS_SELECTOR, ".message")


def test_stop_button_stops_the_stream(browser, tmp_path):
    from selenium.webdriver.common.by import By

    with RunningServer(make_folder(tmp_path / "long", "llama", n_positions=4096), max_concurrency=2) as server:
        engine = server.state.engine
        browser.get(server.url + "/")
        reply = _send(browser, "tell me everything", temperature="1", max_tokens="3000")
        _wait(lambda: len(reply.text) > 0)
        assert not browser.find_element(By.ID, "stop").get_property("disabled")
        browser.find_element(By.ID, "stop").click()
        _wait(lambda: reply.get_attribute("data-done") == "true")
        _wait(lambda: engine.counts() == (0, 0), timeout=20)  # the server freed the slot
        shown = reply.text
        time.sleep(0.3)
        assert reply.text == shown and browser.find_element(By.ID, "stop").get_property("disabled")
