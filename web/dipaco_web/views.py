"""Dashboard pages. For now one landing page; runs, paths and workers come later."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from dipaco import __version__


def landing(request: HttpRequest) -> HttpResponse:
    return render(request, "dipaco_web/landing.html", {"version": __version__})
