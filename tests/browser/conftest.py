"""The browser tests' shared fixture: one headless Chromium per module (its definition and
the page helpers live in test_dashboard_browser)."""

from tests.browser.test_dashboard_browser import browser as browser
