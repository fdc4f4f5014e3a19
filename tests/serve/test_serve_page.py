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
        _wait(lambda: browser.find_element(By.ID, "model").text == "m")
        reply = _send(browser, "hi")
        _wait(lambda: reply.get_attribute("data-done") == "true")
        assert reply.text == api  # shown as text: the markup is visible, not parsed
        assert not reply.find_elements(By.TAG_NAME, "script") and not reply.find_elements(By.TAG_NAME, "b")
        assert "tokens/s" in browser.find_element(By.ID, "speed").text
        browser.find_element(By.ID, "new-chat").click()
        assert not browser.find_elements(By.CSS_SELECTOR, ".message")


def _endless(folder):
    """`folder` with no end token (none in the configs, a template of plain text, and the tokenizer's
    <|endoftext|> renamed, since a tokenizer takes that name as its EOS): a sampled reply runs on until Stop."""
    import json

    for name, keys in (("config.json", ("eos_token_id", "bos_token_id")), ("generation_config.json",
                                                                          ("eos_token_id", "bos_token_id")),
                       ("tokenizer_config.json", ("eos_token", "bos_token"))):
        raw = json.loads((folder / name).read_text())
        raw.update({k: None for k in keys})
        if name == "tokenizer_config.json":
            raw["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}assistant: {% endif %}")
        (folder / name).write_text(json.dumps(raw))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((folder / name).read_text().replace("<|endoftext|>", "<|filler|>"))
    return folder


def test_stop_button_stops_the_stream(browser, tmp_path):
    from selenium.webdriver.common.by import By

    # a wider model streams its 3000 tokens slowly enough that Stop comes first on a fast or a loaded machine
    with RunningServer(_endless(make_folder(tmp_path / "long", "llama", n_positions=4096, width=256)),
                       max_concurrency=2) as server:
        engine = server.state.engine
        browser.get(server.url + "/")
        reply = _send(browser, "tell me everything", temperature="1", max_tokens="3000")
        _wait(lambda: len(reply.text) > 0)
        assert not browser.find_element(By.ID, "stop").get_property("disabled"), (
            reply.text, reply.get_attribute("data-done"), browser.find_element(By.ID, "error").text,
            browser.find_element(By.ID, "max-tokens").get_property("value"))
        browser.find_element(By.ID, "stop").click()
        _wait(lambda: reply.get_attribute("data-done") == "true")
        _wait(lambda: engine.counts() == (0, 0), timeout=20)  # the server freed the slot
        shown = reply.text
        time.sleep(0.3)
        assert reply.text == shown and browser.find_element(By.ID, "stop").get_property("disabled")


def _turn(browser, text, max_tokens="40"):
    """Send `text` at temperature 0 and wait for its reply (or for the error it gets); the reply's element or None."""
    from selenium.webdriver.common.by import By

    before = len(browser.find_elements(By.CSS_SELECTOR, ".message.assistant"))
    for field, value in (("temperature", "0"), ("max-tokens", max_tokens)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "prompt").send_keys(text)
    browser.find_element(By.ID, "send").click()

    def settled():
        replies = browser.find_elements(By.CSS_SELECTOR, ".message.assistant")
        if len(replies) > before and replies[-1].get_attribute("data-done") == "true":
            return replies[-1]
        return browser.find_element(By.ID, "error").text and not browser.find_element(By.ID, "send").get_property(
            "disabled") and "failed"

    outcome = _wait(settled)
    return None if outcome == "failed" else outcome


def test_three_turns_on_a_128_position_model_trim_the_history_and_keep_working(browser, tmp_path):
    import json

    from selenium.webdriver.common.by import By

    from lmkit.chat_session import CHAT_SAMPLING

    folder = make_folder(tmp_path / "small", "llama", n_positions=128)
    defaults = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**defaults, **CHAT_SAMPLING}))
    with RunningServer(folder) as server:
        browser.get(server.url + "/")
        _wait(lambda: browser.find_element(By.ID, "model").text == "m")
        value = lambda field: browser.find_element(By.ID, field).get_property("value")  # noqa: E731
        # the defaults fit the model: half its 128 positions for a reply, the folder's sampling (the API's too)
        _wait(lambda: value("max-tokens") == "64")
        assert value("temperature") == "0.7" and value("top-p") == "0.9"
        replies = [_turn(browser, text) for text in ("hello there", "what is a fox?", "and the lazy dog?")]
        assert all(r is not None and r.text.strip() for r in replies), browser.find_element(By.ID, "error").text
        notices = browser.find_elements(By.CSS_SELECTOR, ".message.notice")
        assert notices and "dropped the oldest" in notices[0].text and "128 positions" in notices[0].text
        first_user = browser.find_elements(By.CSS_SELECTOR, ".message.user")[0]
        assert "dropped" in first_user.get_attribute("class")
        count = len(browser.find_elements(By.CSS_SELECTOR, ".message"))
        long = "the quick brown fox " * 40  # cannot fit with its reply even alone: refused, not kept
        assert _turn(browser, long) is None
        assert "positions" in browser.find_element(By.ID, "error").text
        assert len(browser.find_elements(By.CSS_SELECTOR, ".message")) == count
        assert browser.find_element(By.ID, "prompt").get_property("value") == long
        browser.find_element(By.ID, "prompt").clear()
        assert _turn(browser, "one more?") is not None  # the conversation goes on
        assert not browser.find_element(By.ID, "error").text


def test_replies_render_markdown_as_text_nodes(browser, tmp_path):
    from selenium.webdriver.common.by import By

    messages = [{"role": "user", "content": "md"}]
    reply = "**hi** `a<b`\n```\n<i>x</i>\n```"
    with RunningServer(make_scripted_folder(tmp_path / "md", messages, reply)) as server:
        browser.get(server.url + "/")
        _wait(lambda: browser.find_element(By.ID, "model").text == "m")
        shown = _turn(browser, "md", max_tokens="60")
        assert shown.find_element(By.TAG_NAME, "strong").text == "hi"
        assert shown.find_element(By.CSS_SELECTOR, "p code").text == "a<b"
        assert shown.find_element(By.CSS_SELECTOR, "pre code").text == "<i>x</i>"
        assert not shown.find_elements(By.TAG_NAME, "i") and not shown.find_elements(By.TAG_NAME, "script")
