"""The chat page at `/`, driven in a real headless Chromium (Debian's `chromium`,
installed by `make setup` as root) through Playwright. Screenshots go to
artifacts/screenshots/ (kept by CI as test artifacts)."""

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess

expect = pytest.importorskip("playwright.sync_api").expect

SHOTS = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"
CHROMIUM = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser", shutil.which("chromium") or "")
                 if p and os.path.exists(p)), None)
SERVE_ARGS = ("--served-model-name", "smollm2", "--kv-cache-gb", "0.05", "--max-model-len", "1024",
              "--max-num-seqs", "4")


def test_page_is_served_without_key_and_without_cors(smollm2_gguf):
    s = ServerProcess(smollm2_gguf, *SERVE_ARGS, "--api-key", "sekret")
    try:
        page = httpx.get(f"{s.url}/", headers={"Origin": "http://evil.example"})
        assert page.status_code == 200 and "<title>macinfer chat</title>" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "access-control-allow-origin" not in page.headers
        for asset in ("chat.js", "markdown.js", "chat.css"):
            assert httpx.get(f"{s.url}/ui/{asset}").status_code == 200
        key = {"Authorization": "Bearer sekret"}
        for path in ("/ui/%2e%2e/app.py", "/ui/..%2fapp.py", "/ui/nothing.js"):
            assert httpx.get(f"{s.url}{path}", headers=key).status_code == 404, path
        assert httpx.get(f"{s.url}/status").status_code == 401  # the data behind the page needs the key
        status = httpx.get(f"{s.url}/status", headers=key).json()
        assert status["model"] == "smollm2" and status["kv"]["blocks_used"] == 0
        pre = httpx.options(f"{s.url}/v1/chat/completions",
                            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers
    finally:
        assert "Traceback" not in s.stop()


def _browser():
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs Debian's chromium for the browser tests (make setup installs it as root)")
        pytest.skip("no chromium on this machine (make setup installs Debian's as root)")
    from playwright.sync_api import sync_playwright

    # The Makefile preloads OpenBLAS for MLX; Playwright's node driver must not inherit it
    # (its threads fail to start: "pthread_create: Invalid argument").
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        pw = sync_playwright().start()
        # Background networking off: this machine's network is closed (see the env notes).
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    return pw, browser


@pytest.fixture(scope="module")
def browser():
    pw, b = _browser()
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield b
    b.close()
    pw.stop()


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    s = ServerProcess(smollm2_gguf, *SERVE_ARGS)
    yield s
    assert "Traceback" not in s.stop()


def _until(check, timeout: float = 60.0) -> None:
    """Poll from Python: the page's CSP forbids the eval that wait_for_function uses."""
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, "timed out waiting for the page"
        time.sleep(0.1)


def _settings(page, temperature: str, max_tokens: str) -> None:
    page.click("#settings summary")
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)
    page.click("#settings summary")


def test_message_streams_then_stop_ends_the_request(browser, server):
    page = browser.new_page(viewport={"width": 1100, "height": 700})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    expect(page.locator("#model-name")).to_contain_text("smollm2")
    _settings(page, "0", "48")
    page.fill("#prompt", "What is the capital of France? Answer in one sentence.")
    page.press("#prompt", "Enter")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".meta")).to_contain_text("tok/s", timeout=60_000)
    assert "Paris" in reply.locator(".content").inner_text()
    assert "TTFT" in reply.locator(".meta").inner_text()
    expect(page.locator("#kv-usage")).to_contain_text("blocks")
    page.screenshot(path=str(SHOTS / "chat-reply.png"))

    # A long reply, stopped while it streams: the page keeps the partial text and
    # the server ends the request (nothing left running).
    _settings(page, "0.8", "600")
    page.fill("#prompt", "Write a long story about a dragon who learns to bake bread.")
    page.press("#prompt", "Enter")
    second = page.locator(".msg.assistant").nth(1)
    _until(lambda: second.count() and len(second.locator(".content").inner_text()) > 40)
    assert page.is_visible("#stop")
    page.click("#stop")
    expect(second.locator(".meta")).to_contain_text("stopped")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    page.screenshot(path=str(SHOTS / "chat-stopped.png"))
    status = httpx.get(server.url + "/status").json()
    for _ in range(50):
        if status["requests"]["running"] == 0:
            break
        page.wait_for_timeout(100)
        status = httpx.get(server.url + "/status").json()
    assert status["requests"] == {"running": 0, "waiting": 0}
    assert status["tokens"]["generation_tokens"] < 48 + 600  # the stopped request did not run on

    # The conversation survives a reload (kept in this browser).
    page.reload()
    page.wait_for_selector(".msg.assistant .meta")
    assert page.locator(".msg.user").count() == 2
    assert not errors, errors


def test_markdown_is_rendered_and_model_text_cannot_inject_html(browser, server):
    page = browser.new_page()
    page.goto(server.url + "/")
    html = page.evaluate("renderMarkdown('<img src=x onerror=alert(1)> **bold** and `a<b`\\n\\n"
                         "```python\\nprint(1 < 2)\\n```\\n- one\\n- two\\n[link](javascript:alert(1))')")
    assert "<img" not in html and "&lt;img" in html
    assert "<strong>bold</strong>" in html and "<code>a&lt;b</code>" in html
    assert '<pre><code class="language-python">print(1 &lt; 2)</code></pre>' in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert "href" not in html  # only http(s) links become links


def test_protected_server_asks_for_the_key_once(browser, smollm2_gguf):
    s = ServerProcess(smollm2_gguf, *SERVE_ARGS, "--api-key", "sekret")
    try:
        context = browser.new_context()
        page = context.new_page()
        page.goto(s.url + "/")
        page.wait_for_selector("#key-dialog[open]")
        page.screenshot(path=str(SHOTS / "chat-api-key.png"))
        page.fill("#api-key", "sekret")
        page.click("#key-form button")
        expect(page.locator("#model-name")).to_contain_text("smollm2")
        assert not page.is_visible("#key-dialog")
        _settings(page, "0", "8")
        page.fill("#prompt", "Hi")
        page.press("#prompt", "Enter")
        expect(page.locator(".msg.assistant .meta")).to_contain_text("tokens", timeout=60_000)
        # Kept in the browser: a reload goes straight to the chat.
        page.reload()
        expect(page.locator("#model-name")).to_contain_text("smollm2")
        assert not page.is_visible("#key-dialog")
        context.close()
    finally:
        assert "Traceback" not in s.stop()


def test_a_multi_model_server_gets_a_model_picker(browser, smollm2_gguf, tiny_llama):
    """Several models: the page offers them, the chosen one answers and is remembered."""
    s = ServerProcess(smollm2_gguf, tiny_llama, *SERVE_ARGS, "--no-hf-cache")
    tiny = os.path.basename(tiny_llama)
    try:
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(s.url + "/")
        pick = page.locator("#model-pick")
        expect(pick).to_be_visible()
        assert pick.locator("option").all_inner_texts() == ["smollm2", tiny]
        pick.select_option(tiny)
        expect(page.locator("#model-name")).to_contain_text("unloaded")
        _settings(page, "0", "8")
        page.fill("#prompt", "hello")
        page.press("#prompt", "Enter")
        expect(page.locator(".msg.assistant .meta").last).to_contain_text("tok/s", timeout=60_000)
        models = {m["id"]: m for m in httpx.get(f"{s.url}/status").json()["models"]}
        assert models[tiny]["state"] == "loaded" and models[tiny]["tokens"]["generation_tokens"] > 0
        assert models["smollm2"]["tokens"]["generation_tokens"] == 0
        expect(page.locator("#model-name")).not_to_contain_text("unloaded")
        page.reload()
        expect(page.locator("#model-pick")).to_have_value(tiny)
        page.screenshot(path=str(SHOTS / "chat-model-picker.png"))
        assert not errors, errors
    finally:
        assert "Traceback" not in s.stop()


def test_an_image_is_attached_previewed_sent_and_shown(browser, tmp_path):
    """A vision model's page offers images: picked from a file, and dropped on the composer;
    each is previewed, sent with the message (the server counts it) and shown in the thread."""
    from tests.vision_models import picture, tiny_vlm_dir

    path = tiny_vlm_dir(tmp_path, "llava")
    png = tmp_path / "p.png"
    picture(0).save(png)
    s = ServerProcess(path, "--served-model-name", "tiny-llava", "--max-tokens-default", "8")
    try:
        page = browser.new_context(bypass_csp=True).new_page()  # (the drop below is a script)
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(s.url + "/")
        expect(page.locator("#model-name")).to_contain_text("takes images")
        _settings(page, "0", "6")
        page.set_input_files("#image-input", str(png))
        expect(page.locator("#attachments img")).to_have_count(1)
        page.fill("#prompt", "what is in the picture?")
        page.press("#prompt", "Enter")
        reply = page.locator(".msg.assistant").last
        expect(reply.locator(".meta")).to_contain_text("tok/s", timeout=60_000)
        expect(page.locator(".msg.user img")).to_have_count(1)
        assert page.locator("#attachments img").count() == 0  # sent: the tray is empty again
        assert s.metrics()["macinfer_images_total"] == 1
        page.screenshot(path=str(SHOTS / "chat-image.png"))

        # dropped on the composer (a DataTransfer with the PNG's bytes), then sent alone
        data = list(png.read_bytes())
        page.evaluate("""(bytes) => {
            const dt = new DataTransfer();
            dt.items.add(new File([new Uint8Array(bytes)], "drop.png", { type: "image/png" }));
            document.getElementById("composer").dispatchEvent(new DragEvent("drop", { dataTransfer: dt, bubbles: true }));
        }""", data)
        expect(page.locator("#attachments img")).to_have_count(1)
        page.click("#send")
        expect(page.locator(".msg.assistant .meta")).to_have_count(2, timeout=60_000)
        assert s.metrics()["macinfer_images_total"] == 1 + 2  # the second turn resends the first image
        assert not errors, errors
    finally:
        assert "Traceback" not in s.stop()
