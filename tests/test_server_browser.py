"""The chat page that `onnxgen serve` hands out at GET /, in a real headless chromium.

One real server (the SmolLM2 int4 package, started with an API key) and one browser for the module.
The page must list the model only once the key is filled (the server's 401 shown until then), stream
a reply that grows as tokens arrive and ends equal to a non-streamed greedy request with the same
messages, and stop a long reply on Stop, leaving it marked stopped, with the server still answering.

Needs Debian's `chromium` and `chromium-driver` (the Makefile's `browser` target installs them);
skips, naming the binary, where either is missing. Every wait is bounded; on a failure a screenshot
is saved under the test's tmp dir and its path is in the assertion message.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import TimeoutException, WebDriverException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

API_KEY = "browser-test-key"
MODEL_NAME = "smollm2-browser-test"
SERVER_START_S = 45.0
REPLY_S = 25.0
# Flags for chromium as root on an offline machine: no sandbox (root), no GPU, nothing fetched in
# the background; the profile is a fresh directory per run.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1200,860",
)


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no server log: {exc})"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(
    url: str, body: dict[str, Any] | None = None, key: str | None = API_KEY, timeout: float = REPLY_S
) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a GET (body None) or a JSON POST; HTTP errors are returned, not raised."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"raw": raw.decode(errors="replace")}


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def browser_binaries() -> tuple[str, str]:
    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if chromium is None:
        pytest.skip("`chromium` is not on PATH (Debian package chromium; `make browser` installs it)")
    if driver is None:
        pytest.skip("`chromedriver` is not on PATH (Debian package chromium-driver; `make browser` installs it)")
    return chromium, driver


@pytest.fixture(scope="module")
def server(
    browser_binaries: tuple[str, str], smollm2_packages: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [
        sys.executable, "-m", "onnxgen", "serve",
        "--model", str(smollm2_packages["int4-gqa"]), "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port),
        "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
        # the reply is compared with a second request for the same conversation: with prefix caching
        # that one reuses the first's KV rows and computes its last prompt token alone, arithmetic that
        # may part at a near-tie (docs/batching.md, "Same tokens alone or batched")
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    running = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"onnxgen serve exited with status {process.returncode}:\n{running.log_tail()}")
            try:
                with urllib.request.urlopen(f"{running.url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"onnxgen serve did not answer /health within {SERVER_START_S:.0f} s:\n{running.log_tail()}"
                )
            time.sleep(0.2)
        yield running
    finally:
        _stop_process(process)


@pytest.fixture(scope="module")
def driver(browser_binaries: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    chromium, chromedriver = browser_binaries
    work = tmp_path_factory.mktemp("chromium")
    options = Options()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={work / 'profile'}")
    service = Service(executable_path=chromedriver, log_output=str(work / "chromedriver.log"))
    try:
        browser = webdriver.Chrome(service=service, options=options)
    except WebDriverException as exc:
        pytest.fail(f"chromium did not start through {chromedriver}: {exc.msg}")
    try:
        browser.set_page_load_timeout(15)
        browser.set_script_timeout(10)
        yield browser
    finally:
        browser.quit()


@contextmanager
def _screenshot_on_failure(driver: WebDriver, server: Server, directory: Path, name: str) -> Iterator[None]:
    """Turns a failure inside into an AssertionError that names a screenshot of the page, the page's
    error banner and the server log's tail."""
    try:
        yield
    except Exception as exc:
        path = directory / f"{name}.png"
        try:
            where = f"screenshot: {path}" if driver.save_screenshot(str(path)) else "screenshot failed"
        except WebDriverException as shot_error:
            where = f"no screenshot ({shot_error.msg})"
        try:
            banner = driver.execute_script("return document.getElementById('error').textContent")
        except WebDriverException:
            banner = "(unreadable)"
        raise AssertionError(
            f"{type(exc).__name__}: {exc}\n{where}\npage error banner: {banner!r}\n"
            f"server log tail:\n{server.log_tail()}"
        ) from exc


def _wait(driver: WebDriver, seconds: float, condition: Callable[[WebDriver], Any], what: str) -> Any:
    try:
        return WebDriverWait(driver, seconds, poll_frequency=0.05).until(condition)
    except TimeoutException:
        raise AssertionError(f"waited {seconds:.0f} s for {what}") from None


def _js(driver: WebDriver, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


LAST_REPLY = """
const replies = document.querySelectorAll('#messages .msg[data-role="assistant"]');
const reply = replies[replies.length - 1];
if (!reply) return null;
return {text: reply.querySelector('.content').textContent, state: reply.dataset.state || '',
        note: reply.querySelector('.note').textContent, finish: reply.dataset.finishReason || ''};
"""

# Records each change of the last reply's length with its time, as the page's own DOM sees it.
WATCH_GROWTH = """
window.__growth = [];
new MutationObserver(() => {
  const replies = document.querySelectorAll('#messages .msg[data-role="assistant"]');
  const reply = replies[replies.length - 1];
  if (reply) window.__growth.push([performance.now(), reply.querySelector('.content').textContent.length]);
}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
"""


def _last_reply(driver: WebDriver) -> dict[str, str] | None:
    return _js(driver, LAST_REPLY)


def _set_field(driver: WebDriver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    if value:
        field.send_keys(value)


def _open_page(driver: WebDriver, server: Server, *, key: str | None) -> None:
    driver.get(server.url + "/")
    _wait(driver, 10, lambda d: d.find_element(By.ID, "prompt").is_displayed(), "the page's message box")
    if key is not None:
        _set_field(driver, "api-key", key)
        driver.find_element(By.ID, "api-key").send_keys(Keys.TAB)  # "change" lists the models again
        _wait(driver, 10, lambda d: _js(d, "return document.getElementById('model').value") == MODEL_NAME,
              f"the model list to offer {MODEL_NAME!r}")  # fmt: skip


def test_page_needs_the_key_and_shows_the_server_error(driver: WebDriver, server: Server, tmp_path: Path) -> None:
    status, body = _request(f"{server.url}/v1/models", key=None)
    assert status == 401 and "error" in body, (status, body)
    with _screenshot_on_failure(driver, server, tmp_path, "api-key"):
        _open_page(driver, server, key=None)
        banner = _wait(driver, 10, lambda d: d.find_element(By.ID, "error").text, "an error banner without a key")
        assert body["error"]["message"] in banner, f"the banner {banner!r} lacks the server's message {body!r}"
        assert _js(driver, "return document.getElementById('model').options.length") == 0
        _set_field(driver, "api-key", API_KEY)
        driver.find_element(By.ID, "api-key").send_keys(Keys.TAB)
        _wait(driver, 10, lambda d: _js(d, "return document.getElementById('model').value") == MODEL_NAME,
              f"the model list to offer {MODEL_NAME!r} once the key is filled")  # fmt: skip
        _wait(driver, 5, lambda d: not d.find_element(By.ID, "error").is_displayed(), "the banner to go")


def test_streamed_reply_equals_the_greedy_reply(driver: WebDriver, server: Server, tmp_path: Path) -> None:
    system = "You are a concise assistant."
    max_tokens = 48  # greedy SmolLM2 is still going then: a reply of several lines, cut at the limit
    with _screenshot_on_failure(driver, server, tmp_path, "streamed"):
        _open_page(driver, server, key=API_KEY)
        _set_field(driver, "system", system)
        _set_field(driver, "temperature", "0")
        _set_field(driver, "max-tokens", str(max_tokens))
        _js(driver, WATCH_GROWTH)
        prompt = driver.find_element(By.ID, "prompt")
        prompt.send_keys("Name three French cities.")
        prompt.send_keys(Keys.SHIFT, Keys.ENTER)  # a new line, not a send
        prompt.send_keys("Give one fact about each.")
        assert _js(driver, "return document.querySelectorAll('#messages .msg').length") == 0, "Shift+Enter sent"
        user_text = prompt.get_property("value")
        assert user_text == "Name three French cities.\nGive one fact about each."
        prompt.send_keys(Keys.ENTER)
        _wait(driver, REPLY_S, lambda d: (_last_reply(d) or {}).get("state") not in (None, "", "streaming"),
              "the streamed reply to finish")  # fmt: skip
        reply = _last_reply(driver)
        assert reply is not None and reply["state"] == "done", reply
        driver.save_screenshot(str(tmp_path / "streamed-reply.png"))

        # It streamed: the text grew in several arrivals spread over time, not in one piece.
        growth: list[list[float]] = _js(driver, "return window.__growth")
        arrivals: list[tuple[float, int]] = []
        for at, length in growth:
            if length > 0 and (not arrivals or length != arrivals[-1][1]):
                if arrivals and at - arrivals[-1][0] < 5.0:  # the same network read
                    arrivals[-1] = (arrivals[-1][0], int(length))
                else:
                    arrivals.append((at, int(length)))
        lengths = [length for _, length in arrivals]
        assert len(arrivals) >= 5 and lengths == sorted(lengths), f"no streaming seen: {arrivals}"
        assert lengths[-1] == len(reply["text"]), (lengths, len(reply["text"]))

        status, expected = _request(
            f"{server.url}/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user_text}],
                "temperature": 0,
                "max_tokens": max_tokens,
                "stream": False,
            },
        )
        assert status == 200, expected
        assert reply["text"] == expected["choices"][0]["message"]["content"]
        assert reply["text"].strip(), "an empty reply proves nothing"
        assert reply["finish"] == expected["choices"][0]["finish_reason"], (reply, expected["choices"][0])
        tps = float(driver.find_element(By.ID, "tps").text)
        assert tps > 0, driver.find_element(By.ID, "stats").text


def test_stop_ends_the_stream_and_the_server_answers_next(driver: WebDriver, server: Server, tmp_path: Path) -> None:
    with _screenshot_on_failure(driver, server, tmp_path, "stopped"):
        _open_page(driver, server, key=API_KEY)
        _set_field(driver, "temperature", "0")
        _set_field(driver, "max-tokens", "1500")
        prompt = driver.find_element(By.ID, "prompt")
        prompt.send_keys("Write a long story about a lighthouse keeper and a storm, in many paragraphs.")
        driver.find_element(By.ID, "send").click()
        _wait(driver, REPLY_S, lambda d: len((_last_reply(d) or {}).get("text", "")) >= 40,
              "the long reply to start")  # fmt: skip
        assert _last_reply(driver)["state"] == "streaming", "the long reply ended before Stop was pressed"
        driver.find_element(By.ID, "stop").click()
        _wait(driver, 5, lambda d: _last_reply(d)["state"] == "stopped", "the reply to be marked stopped")
        stopped = _last_reply(driver)
        assert "Stopped" in stopped["note"], stopped
        time.sleep(1.0)
        assert _last_reply(driver)["text"] == stopped["text"], "the reply grew after Stop"
        assert driver.find_element(By.ID, "send").is_enabled() and not driver.find_element(By.ID, "stop").is_enabled()

        # The server answers the next request: in the page (the conversation goes on) and directly.
        _set_field(driver, "max-tokens", "8")
        prompt.send_keys("Thanks. Say goodbye.", Keys.ENTER)
        _wait(driver, REPLY_S, lambda d: _js(d, "return document.querySelectorAll('#messages .msg').length") == 4
              and _last_reply(d)["state"] == "done", "the reply after the stopped one")  # fmt: skip
        status, answer = _request(
            f"{server.url}/v1/chat/completions",
            {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
        )
        assert status == 200 and answer["choices"][0]["message"]["content"], answer
        driver.find_element(By.ID, "new-chat").click()
        assert _js(driver, "return document.querySelectorAll('#messages .msg').length") == 0


def test_markup_in_a_message_is_shown_as_text(driver: WebDriver, server: Server, tmp_path: Path) -> None:
    """Messages are inserted as text, never parsed as HTML: markup stays visible as characters."""
    with _screenshot_on_failure(driver, server, tmp_path, "as-text"):
        _open_page(driver, server, key=API_KEY)
        _set_field(driver, "max-tokens", "4")
        markup = '<img src=x onerror="window.__injected=1"><b>bold</b>'
        driver.find_element(By.ID, "prompt").send_keys(markup, Keys.ENTER)
        _wait(driver, REPLY_S, lambda d: (_last_reply(d) or {}).get("state") == "done", "the short reply")
        user = _js(driver, "return document.querySelector('#messages .msg[data-role=\"user\"] .content')")
        assert user.text == markup
        assert _js(driver, "return document.querySelectorAll('#messages img, #messages b').length") == 0
        assert _js(driver, "return window.__injected === undefined")


def test_a_refused_request_shows_the_server_error(driver: WebDriver, server: Server, tmp_path: Path) -> None:
    """The server's error envelope reaches the page: its message in the banner and on the reply, the
    unanswered message handed back to the message box."""
    text = "Hello there."
    status, refused = _request(
        f"{server.url}/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 100000, "stream": True},
    )
    assert status == 400 and "error" in refused, (status, refused)
    with _screenshot_on_failure(driver, server, tmp_path, "refused"):
        _open_page(driver, server, key=API_KEY)
        _set_field(driver, "max-tokens", "100000")  # beyond the model's context: the server refuses it
        driver.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)
        _wait(driver, 10, lambda d: (_last_reply(d) or {}).get("state") == "error", "the reply to show an error")
        banner = driver.find_element(By.ID, "error").text
        assert refused["error"]["message"] in banner, (banner, refused)
        assert refused["error"]["message"] in _last_reply(driver)["note"]
        assert driver.find_element(By.ID, "prompt").get_property("value") == text
        assert driver.find_element(By.ID, "send").is_enabled()
