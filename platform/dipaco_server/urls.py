"""URL map: dashboard at /, API at /api/v1/, blob transfers at /blobs/, probes at
/healthz and /readyz, Prometheus metrics at /metrics.

Errors (handler404/403/500, and CSRF_FAILURE_VIEW) are dipaco_server.error_pages: JSON in
the API's shape under /api/ and /blobs/, pages of the site everywhere else. The dashboard
is mounted by name (``include("dipaco_web.urls")``), so this map imports nothing above it.
"""

from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path

from dipaco_server import error_pages, errors
from dipaco_server.api import api
from dipaco_server.core import probes
from dipaco_server.rounds.reports import scrape

urlpatterns = [
    path("", include("dipaco_web.urls")),
    path("api/v1/", api.urls),
    re_path(r"^api(/|$)", errors.not_found),
    path("favicon.ico", error_pages.favicon),
    # Operators' tools: probes (no token) and Prometheus' scrape (rounds.reports.scrape).
    path("healthz", probes.healthz, name="healthz"),
    path("readyz", probes.readyz, name="readyz"),
    path("metrics", scrape.metrics, name="metrics"),
    path("blobs/", include("dipaco_server.storage.urls")),
    path("admin/", admin.site.urls),
    # Static files straight from the installed apps (finders), also with
    # DEBUG off: the embedded server has no separate web server in front, and
    # the few files involved (API docs, dashboard CSS) do not need one.
    re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}),
]

handler404 = "dipaco_server.error_pages.page_not_found"
handler403 = "dipaco_server.error_pages.permission_denied"
handler500 = "dipaco_server.error_pages.server_error"
