"""The HTTP API at /api/v1: one NinjaAPI, one router per app.

The OpenAPI schema is at /api/v1/openapi.json and its browsable docs at
/api/v1/docs (swagger-ui served from the ``ninja`` package's static files).
Apps add their routers below.
"""

from ninja import NinjaAPI

from dipaco import __version__
from dipaco_server.core.api import router as core_router

api = NinjaAPI(
    title="dipaco control plane",
    version=__version__,
    description="Admin, worker and inference API of a dipaco server.",
    urls_namespace="api-v1",
    docs_url="/docs",
)
api.add_router("/", core_router)
