from django.urls import path

from dipaco_web import pages, staff, views

app_name = "dipaco_web"

urlpatterns = [
    path("", views.runs, name="runs"),
    path("live/runs/", views.runs_live, name="runs-live"),
    path("runs/new/", staff.run_new, name="run-new"),
    path("runs/<int:run_id>/", views.run, name="run"),
    path("runs/<int:run_id>/live/", views.run_live, name="run-live"),
    path("runs/<int:run_id>/actions/<slug:action>/", views.run_action, name="run-action"),
    path("runs/<int:run_id>/paths/<int:path_index>/", pages.path_page, name="path"),
    path(
        "runs/<int:run_id>/paths/<int:path_index>/generate/",
        pages.generate_view,
        name="path-generate",
    ),
    path("datasets/", staff.datasets, name="datasets"),
    path("datasets/new/", staff.dataset_new, name="dataset-new"),
    path("datasets/<int:dataset_id>/", staff.dataset, name="dataset"),
    path("enroll/", staff.enroll, name="enroll"),
    path("enroll/<int:token_id>/revoke/", staff.enroll_revoke, name="enroll-revoke"),
    path("workers/", views.workers, name="workers"),
    path("workers/live/", views.workers_live, name="workers-live"),
    path("workers/<int:worker_id>/", pages.worker, name="worker"),
    path("workers/<int:worker_id>/live/", pages.worker_live, name="worker-live"),
    path("workers/<int:worker_id>/revoke/", staff.worker_revoke, name="worker-revoke"),
    path("login/", views.login, name="login"),
    path("logout/", views.logout, name="logout"),
]
