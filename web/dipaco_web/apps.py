"""The browser dashboard of the dipaco control plane (templates and static files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.apps import AppConfig
from django.core import checks

# Copied from node_modules by `npm ci` (vendor.mjs); the pages need them to draw and refresh.
VENDOR_DIR = Path(__file__).resolve().parent / "static" / "dipaco_web" / "vendor"
VENDOR_FILES = ("htmx.min.js", "uPlot.iife.min.js", "uPlot.min.css")


def vendor_files_check(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    missing = [name for name in VENDOR_FILES if not (VENDOR_DIR / name).is_file()]
    if not missing:
        return []
    return [
        checks.Warning(
            f"the dashboard's browser libraries are missing from {VENDOR_DIR}: "
            f"{', '.join(missing)}; pages load but draw no charts and do not refresh",
            hint="run `npm ci` in the repository root (it installs package-lock.json's "
            "versions and copies their files there)",
            id="dipaco_web.W001",
        )
    ]


class DipacoWebConfig(AppConfig):
    name = "dipaco_web"
    verbose_name = "dipaco dashboard"

    def ready(self) -> None:
        checks.register(vendor_files_check)
